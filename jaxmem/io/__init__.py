"""What jaxmem reads and writes on disk: Orbax checkpoints and the run directory.

    checkpoint   Checkpointer (Orbax CheckpointManager of the whole state + JSON metadata)
    rundir       config.json (RunConfig, schema versions), metrics.jsonl, load_run
"""

from jaxmem.io.checkpoint import CheckpointError, Checkpointer
from jaxmem.io.rundir import LoadedRun, RunError, load_run, read_run_config, write_run_config

__all__ = ["CheckpointError", "Checkpointer", "LoadedRun", "RunError", "load_run",
           "read_run_config", "write_run_config"]
