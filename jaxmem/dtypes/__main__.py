import sys

from jaxmem.dtypes.table import main

sys.exit(main())
