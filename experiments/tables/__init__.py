"""The scripts behind the tables and numbers of docs/: each one a command,
`python -m experiments.tables.NAME`, that prints its table and writes its JSON to
experiments/results/ (a new dated file).

memory_table, what_fits: docs/memory.md; fit_speed: docs/memory.md (`--fit`); mesh_memory,
fsdp_comm: docs/distributed.md; finetune_memory: docs/finetune.md; precision_curves:
docs/precision.md and docs/optimizers.md; hf_load_memory: host memory of reading a checkpoint."""
