"""The data error type (its own module so every data module can raise it)."""


class DataError(ValueError):
    """Data cannot be loaded; the one-line message names the file or value at fault."""
