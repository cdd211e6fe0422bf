"""Floating-point formats: the table read from ml_dtypes (`table`) and a run's real gradients
cast into each format (`gradients`); `python -m jaxmem.dtypes [--gradients RUN_DIR]`."""

from jaxmem.dtypes.table import available_dtypes, describe, format_table

__all__ = ["available_dtypes", "describe", "format_table"]
