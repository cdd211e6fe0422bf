"""`python -m jaxmem.generate`: text from a run directory or a Hugging Face checkpoint (cli.py),
and `bench.py` (cached vs uncached tokens/s). The sampler itself is the library jaxmem.decode
(`generate_ids`, `sample_tokens`, `generate_text`, `lower_sample` for the planner), which the
trainer samples with too."""
