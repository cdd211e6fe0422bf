"""What jaxmem reads and writes on disk: Orbax checkpoints, the run directory, Hugging Face files.

    checkpoint   Checkpointer (Orbax CheckpointManager of the whole state + JSON metadata)
    rundir       config.json (RunConfig, schema versions), metrics.jsonl, load_run
    hf           Hugging Face Llama directories: config mapping, load_hf, hf_tokenizer
    hf_names     jaxmem param paths <-> HF tensor names and layouts
    hf_export    save_hf: an HF directory transformers loads (sharded safetensors + index)
"""

from jaxmem.io.checkpoint import CheckpointError, Checkpointer
from jaxmem.io.rundir import LoadedRun, RunError, load_run, read_run_config, write_run_config

__all__ = ["CheckpointError", "Checkpointer", "LoadedRun", "RunError", "load_run",
           "read_run_config", "write_run_config"]
