"""`python -m jaxmem.launch --processes N --devices-per-process D -- <train flags>`: a
multi-process run on one machine (jaxmem.parallel.launch, docs/distributed.md)."""

import sys

from jaxmem.parallel.launch import main

if __name__ == "__main__":
    sys.exit(main())
