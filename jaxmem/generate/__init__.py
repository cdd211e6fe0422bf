"""Text generation with a KV cache: `generate_ids` / `sample_tokens` / `generate_text`,
`lower_sample` for the planner (library), and `python -m jaxmem.generate`."""

from jaxmem.decode.sampling import (generate_ids, generate_text, lower_sample, sample_tokens,
                                      sample_tokens_uncached)

__all__ = ["generate_ids", "generate_text", "lower_sample", "sample_tokens",
           "sample_tokens_uncached"]
