import sys

from jaxmem.memory.report import main

sys.exit(main())
