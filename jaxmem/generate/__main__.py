import sys

from jaxmem.generate.cli import main

sys.exit(main())
