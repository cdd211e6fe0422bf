import sys

from jaxmem.export.cli import main

sys.exit(main())
