"""`python -m experiments.fp8_diag`: experiments.fp8_diag.driver's command."""
from experiments.fp8_diag.driver import main

if __name__ == "__main__":
    raise SystemExit(main())
