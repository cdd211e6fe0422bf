"""`python -m experiments.offload_peak`: a run's device memory phase by phase on a GPU (the fresh
state, each step, the evaluation); the command is in __main__.py."""
