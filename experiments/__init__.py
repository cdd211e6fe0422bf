"""The PyTorch comparison and the measurement scripts behind docs/: run from the repository root
as modules (`python -m experiments.compare`, `python -m experiments.tables.memory_table`, ...), so
`experiments` and this checkout's `jaxmem` import without any sys.path edits. Not installed with
jaxmem: it needs torch, and its results are documents, not library code."""
