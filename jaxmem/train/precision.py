"""Precision modes and `cast_params` live in `jaxmem.model.precision` (the sampler uses them
without the trainer); this name stays for code written against `jaxmem.train.precision`."""

from jaxmem.model.precision import (PRECISIONS, Precision, PrecisionError, cast_floating,
                                    cast_params, get_precision)

__all__ = ["PRECISIONS", "Precision", "PrecisionError", "cast_floating", "cast_params",
           "get_precision"]
