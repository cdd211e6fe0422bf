import sys

from jaxmem.recipes.cli import main

sys.exit(main())
