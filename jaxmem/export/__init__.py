"""`python -m jaxmem.export`: a run's weights as a Hugging Face checkpoint (jaxmem.io.hf_export)."""
