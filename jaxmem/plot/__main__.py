from jaxmem.plot.cli import main

raise SystemExit(main())
