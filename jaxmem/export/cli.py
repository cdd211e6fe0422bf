"""`python -m jaxmem.export`: write a run's newest checkpoint as a Hugging Face checkpoint
directory of its model family.

    python -m jaxmem.export --run runs/ft --out hf/ft                  # merged full weights
    python -m jaxmem.export --run runs/ft --out hf/ft --dtype bfloat16 --max-shard-mb 2048

The output is what transformers' `AutoModelForCausalLM.from_pretrained` and `jaxmem.generate --hf`
load: safetensors (sharded with model.safetensors.index.json above --max-shard-mb), config.json
(jaxmem.io.hf.config_to_hf) and the run's tokenizer files. Bad input exits 2 with one line;
nothing is written into a directory that already holds a checkpoint.

What is exported is chosen in EXPORTERS (below): "full" writes the full weights; `--adapters-only`
runs the "adapters" exporter, which jaxmem.peft registers there (LoRA adapters in PEFT's layout).
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path
from typing import Callable

import numpy as np

from jaxmem.data import DataError
from jaxmem.io.checkpoint import CheckpointError
from jaxmem.io.hf_export import DEFAULT_MAX_SHARD_BYTES, DTYPES
from jaxmem.train.rundir import RunError, exit_after_failed_restore, load_run
from jaxmem.export.merged import export_merged, write_hf
from jaxmem.peft.lora import LoraSpec


def full_params(run):
    """The run's full weights as plain arrays; a LoRA run's adapters merged into its original
    base weights (jaxmem.peft.export)."""
    return run.step_config.trainable.merged_params(run)


def export_full(run, out: Path, args) -> list[Path]:
    """Full weights + config.json + tokenizer files; a LoRA run's merge is streamed tensor by
    tensor (jaxmem.export.merged)."""
    return _export_full(run.step_config.trainable, run, out, args)


@functools.singledispatch
def _export_full(trainable, run, out: Path, args) -> list[Path]:
    params = full_params(run)
    dtype = args.dtype or np.dtype(next(iter(_leaves(params))).dtype).name
    return write_hf(run, out, args, params, dtype)


@_export_full.register
def _(trainable: LoraSpec, run, out: Path, args) -> list[Path]:
    return export_merged(run, out, args)


def _leaves(tree):
    import jax  # noqa: PLC0415

    return jax.tree_util.tree_leaves(tree)


# kind -> exporter(run, out, args) -> files written.
EXPORTERS: dict[str, Callable] = {
    "full": export_full,
    "adapters": lambda run, out, args: run.step_config.trainable.export_adapters(run, out, args)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxmem.export",
                                description="Write a run's newest checkpoint as a Hugging Face "
                                            "checkpoint directory of the run's model family that "
                                            "transformers loads.")
    p.add_argument("--run", required=True, help="run directory (the --out of jaxmem.train)")
    p.add_argument("--out", required=True, help="Hugging Face directory to write (new or empty)")
    p.add_argument("--dtype", choices=list(DTYPES),
                   help="dtype of the written weights (default: the run's stored params' dtype)")
    p.add_argument("--max-shard-mb", type=float, default=DEFAULT_MAX_SHARD_BYTES / 2**20,
                   help="split the weights into shards of at most this many MiB, with an index "
                        f"(default: {DEFAULT_MAX_SHARD_BYTES / 2**20:.0f})")
    p.add_argument("--adapters-only", action="store_true",
                   help="write only the LoRA adapters, in PEFT's layout (a LoRA run)")
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if not args.max_shard_mb > 0:
        p.error(f"--max-shard-mb must be > 0, got {args.max_shard_mb}")
    try:
        run = load_run(Path(args.run))
    except CheckpointError as e:
        exit_after_failed_restore(p, str(e).splitlines()[0])
    except (RunError, DataError, ValueError) as e:
        p.error(str(e).splitlines()[0])
    try:
        files = EXPORTERS["adapters" if args.adapters_only else "full"](run, Path(args.out), args)
    except (RunError, DataError, ValueError) as e:
        p.error(str(e).splitlines()[0])
    print(f"{args.out}: wrote {', '.join(f.name for f in files)} (step {int(run.state.step)})")
    return 0
