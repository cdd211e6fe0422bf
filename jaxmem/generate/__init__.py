"""Text generation: `sample_tokens` / `generate_text` (library) and `python -m jaxmem.generate`."""

from jaxmem.generate.sampling import generate_text, sample_tokens

__all__ = ["generate_text", "sample_tokens"]
