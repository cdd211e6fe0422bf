import sys

from jaxmem.train.cli import main

sys.exit(main())
