import sys

from jaxmem.memory.cli import main

sys.exit(main())
