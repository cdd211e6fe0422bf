"""`python -m experiments.gpu_check`: experiments.gpu_check.driver's command."""
from experiments.gpu_check.driver import main

if __name__ == "__main__":
    raise SystemExit(main())
