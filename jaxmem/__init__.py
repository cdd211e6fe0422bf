"""jaxmem: train Llama-style models in JAX/Flax with as little memory as possible."""

__version__ = "0.1.0"
