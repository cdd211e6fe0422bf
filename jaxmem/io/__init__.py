"""What jaxmem reads and writes on disk: Orbax checkpoints, the run directory, Hugging Face files.

    checkpoint   Checkpointer (Orbax CheckpointManager of the whole state + JSON metadata)
    hf           Hugging Face checkpoint directories of the families: config mapping, load_hf, hf_tokenizer
    hf_names     jaxmem param paths <-> HF tensor names and layouts
    hf_export    save_hf: an HF directory transformers loads (sharded safetensors + index)
"""

from jaxmem.io.checkpoint import CheckpointError, Checkpointer

__all__ = ["CheckpointError", "Checkpointer"]
