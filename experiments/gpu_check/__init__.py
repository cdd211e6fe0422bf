"""The GPU check: every GPU claim of jaxmem, measured, in one table.

    python -m experiments.gpu_check --out DIR     (driver.py's docstring has the flags)

driver: the command (runs each row, writes the report); rows: what each row runs and how its
numbers are read back; table: gpu_check.json / gpu_check.md and the machine's description."""
