"""`python -m experiments.compare`: experiments.compare.driver's command."""
from experiments.compare.driver import main

if __name__ == "__main__":
    raise SystemExit(main())
