"""The fp8 study: why an fp8 train step is or is not faster than bf16.

    python -m experiments.fp8_diag ...          where the step's time and GEMMs go (driver.py)
    python -m experiments.fp8_diag.bench ...    fp8 vs bf16 projection matmuls, timed

driver: the command; hlo: XLA's HLO text and a profiler trace read on any machine; table: what
an optimized GPU module runs per step and its roofline estimate; bench: the matmul benchmark."""
