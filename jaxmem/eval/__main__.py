import sys

from jaxmem.eval.cli import main

sys.exit(main())
