"""The PyTorch comparison, the GPU check and the measurement scripts behind docs/: run from the
repository root as modules, so `experiments` and this checkout's `jaxmem` import without any
sys.path edits. Not installed with jaxmem: it needs torch, and its results are documents, not
library code. One subpackage per purpose:

    compare/     the torch baseline           python -m experiments.compare
    gpu_check/   every GPU claim, measured    python -m experiments.gpu_check --out DIR
    fp8_diag/    the fp8 study                python -m experiments.fp8_diag, ...fp8_diag.bench
    tables/      the tables of docs/          python -m experiments.tables.memory_table, ...
    common/      what they share (result files, torch's oneDNN ISA cap)
    adamw8bit_vs_bnb.py                       python -m experiments.adamw8bit_vs_bnb
    results/     the measured JSON files docs/ cite
"""
