import sys

from jaxmem.dtypes.cli import main

sys.exit(main())
