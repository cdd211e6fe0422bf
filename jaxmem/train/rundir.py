"""The run directory and what it holds.

    <run>/config.json     {"schema_version": 2, "config": RunConfig.to_dict(), "resolved_model":
                          the ModelConfig's fields, "data_stats": ..., "data_sha256": ...,
                          "changes": [{"step", "field", "from", "to"}, ...]}  (rewritten on resume)
    <run>/metrics.jsonl   one JSON object per logged step
    <run>/checkpoints/    Orbax steps (jaxmem.io.checkpoint)
    <run>/tokenizer.json, tokenizer_config.json, special_tokens_map.json, chat_template.jinja,
        generation_config.json: the run's tokenizer as its checkpoint had it (`copy_tokenizer`)

`load_run` restores the newest committed step with the run's own config; a config.json written
before RunConfig existed (schema 1: the flat flags) is read too (jaxmem.config.run).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from jaxmem.errors import ConfigError
from jaxmem.families.config import upgrade_fields
from jaxmem.config.run import RunConfig
from jaxmem.data.special_tokens import (GENERATION_CONFIG, TOKENIZER_FILES, TOKENIZER_JSON,
                                        TokenizerFiles, tokenizer_json)
from jaxmem.data.tokenizers import section_tokenizer
from jaxmem.io.checkpoint import CheckpointError, Checkpointer
from jaxmem.train.run import abstract_train_state, build_step_config

CONFIG_FILE, METRICS_FILE, CKPT_DIR = "config.json", "metrics.jsonl", "checkpoints"


class RunError(ValueError):
    """Bad input to a run (flag, file or run directory); the message names it."""


def fail(parser, message: str):
    """Exit 2 with one line `<prog>: error: <message>`, without argparse's usage block: for
    errors that are not about a flag's syntax (a run directory, a file, a checkpoint)."""
    import sys

    sys.stdout.flush()
    print(f"{parser.prog}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def exit_after_failed_restore(parser, message: str) -> None:
    """The one-line error exit (status 2, no usage block), and nothing printed after it.

    After a failed Orbax restore, TensorStore reads still in flight fail again on their own
    threads and print tracebacks into stderr, before, between and after the lines of the error
    (PyErr_Print from native threads: no Python hook reliably catches them). So stderr is
    pointed at /dev/null first, the message goes to the real stderr, and the process exits at
    once. Nothing is left to save at that point: no training has run.
    """
    import os
    import sys

    text = f"{parser.prog}: error: {message}\n"
    sys.stdout.flush()
    sys.stderr.flush()
    real_stderr = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.write(real_stderr, text.encode())
    os._exit(2)


def read_record(run_dir: Path) -> dict:
    """config.json of a run directory as a dict (RunError naming the file when it cannot)."""
    path = Path(run_dir) / CONFIG_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise RunError(f"{path}: no run config here (was this directory made by jaxmem.train?)")
    except (OSError, json.JSONDecodeError) as e:
        raise RunError(f"{path}: unreadable run config ({e})")


def read_run_config(run_dir: Path) -> tuple[RunConfig, dict]:
    """(RunConfig, the whole config.json record) of a run; schema 1 is converted."""
    record = read_record(run_dir)
    try:
        if record.get("schema_version", 1) == 1:
            return RunConfig.from_dict(record), {**record, "resolved_model": record.get("model")}
        if record.get("resolved_model"):  # as this ModelConfig names its fields
            record = {**record, "resolved_model": upgrade_fields(record["resolved_model"])}
        return RunConfig.from_dict({"schema_version": record["schema_version"],
                                    **record.get("config", {})}), record
    except ConfigError as e:
        raise RunError(f"{Path(run_dir) / CONFIG_FILE}: {e}") from None


def write_run_config(run_dir: Path, cfg: RunConfig, **extras: Any) -> None:
    """Write config.json (atomically: a temp file renamed over the old one)."""
    d = cfg.to_dict()
    record = {"schema_version": d.pop("schema_version"), "config": d,
              "resolved_model": dataclasses.asdict(cfg.model_config()), **extras}
    path = Path(run_dir) / CONFIG_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=2, default=str))
    tmp.replace(path)


def truncate_metrics(run_dir: Path, last_step: int) -> None:
    """Drop metrics.jsonl records after `last_step` (a resume redoes those steps)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= last_step]
    path.write_text("".join(line + "\n" for line in keep))


@dataclasses.dataclass
class LoadedRun:
    """A run restored from its directory (see `load_run`)."""

    config: RunConfig
    record: dict
    model_config: Any
    step_config: Any
    state: Any
    tokenizer: Any


def older_steps_hint(steps: list[int], failed: int, flag: str = "--resume --resume-step") -> str:
    """'; older committed steps: 100, 200 (pick one with --resume-step 200)' or ''."""
    older = [s for s in steps if s < failed]
    if not older:
        return "; no older committed step to fall back to"
    return (f"; older committed steps: {', '.join(map(str, older))} (restore one with "
            f"{flag} {older[-1]})")


LAYOUT_HINT = ("; an adamw8bit checkpoint saved by jaxmem before 2026-11-25 cannot be restored "
               "when a weight's last axis is neither a multiple nor a divisor of 256 (the tiny "
               "and small presets' 259-token heads, tiny's MLP): its 8-bit moments' blocks are "
               "laid out differently now (docs/optimizers.md); the checkpoint is unchanged: "
               "resume it with that jaxmem, or start a new run")


def restore_hint(steps: list[int], failed: int, error: str, optimizer: str,
                 flag: str = "--resume --resume-step") -> str:
    """What to try after step `failed` did not restore: `LAYOUT_HINT` when an adamw8bit state
    met a stored shape of another layout, else `older_steps_hint`."""
    if optimizer == "adamw8bit" and "stored shape" in error:
        return LAYOUT_HINT
    return older_steps_hint(steps, failed, flag)


def load_run(run_dir: Path, step: int | None = None) -> LoadedRun:
    """A committed step of a run (default: the newest), rebuilt from the run's own config."""
    cfg, record = read_run_config(run_dir)
    model_cfg, step_cfg, loss_scale = build_step_config(cfg)
    with Checkpointer(Path(run_dir) / CKPT_DIR, keep=cfg.run.keep) as ckpt:
        steps = ckpt.all_steps()
        if not steps:
            raise RunError(f"--run {run_dir}: no committed checkpoint in {Path(run_dir) / CKPT_DIR}")
        if step is not None and step not in steps:
            raise RunError(f"--step {step}: no committed checkpoint step {step} in "
                           f"{Path(run_dir) / CKPT_DIR} (committed: {', '.join(map(str, steps))})")
        step = steps[-1] if step is None else step
        try:
            state, _ = ckpt.restore(step, abstract_train_state(step_cfg, loss_scale, cfg.data.seed))
        except CheckpointError as e:
            raise CheckpointError(str(e).splitlines()[0] + restore_hint(
                steps, step, str(e), cfg.optim.optimizer, "--step")) from e
    tokenizer = section_tokenizer(cfg.data, run_tokenizer(run_dir, cfg))
    return LoadedRun(cfg, record, model_cfg, step_cfg, state, _older_run_stops(tokenizer, cfg,
                                                                               Path(run_dir)))


def _older_run_stops(tokenizer, cfg: RunConfig, run_dir: Path):
    """`tokenizer`, with the stop ids of its --init-from checkpoint where the run directory
    keeps no generation_config.json (a run made before the directory kept one, 2026-11-28):
    what generation stopped at then."""
    init_from = cfg.init.init_from
    if (getattr(tokenizer, "files", None) is None or (run_dir / GENERATION_CONFIG).exists()
            or not init_from or not Path(init_from).is_dir()):
        return tokenizer
    files = TokenizerFiles.read(init_from)
    tokenizer.stop_ids = files.stop_ids(tokenizer.eos_id)
    tokenizer.generation_ids = files.generation_ids()
    return tokenizer


def copy_tokenizer(run_dir: Path, cfg: RunConfig) -> None:
    """Copy the run's tokenizer into the run directory, once (existing copies are kept): its
    tokenizer.json, and the checkpoint's files beside it that say its special tokens, chat
    template and stop ids (tokenizer_config.json, special_tokens_map.json, chat_template.jinja,
    generation_config.json). A checkpoint whose stop ids are in its config.json alone gets a
    generation_config.json of those ids, as transformers derives one
    (GenerationConfig.from_model_config): the run directory then needs nothing of the checkpoint
    to load its tokenizer, generate or export."""
    import shutil  # noqa: PLC0415

    if cfg.data.tokenizer is None:
        return
    src, run_dir = tokenizer_json(cfg.data.tokenizer), Path(run_dir)
    for name in TOKENIZER_FILES:
        file, copy = (src if name == TOKENIZER_JSON else src.parent / name), run_dir / name
        if file.is_file() and not copy.exists() and file.resolve() != copy.resolve():
            shutil.copyfile(file, copy)
    gen = run_dir / GENERATION_CONFIG
    if not gen.exists() and src.parent.resolve() != run_dir.resolve():
        ids = TokenizerFiles.read(src.parent).generation_ids()  # config.json's, as transformers
        if ids:
            gen.write_text(json.dumps(ids, indent=2) + "\n")


def run_tokenizer(run_dir: Path, cfg: RunConfig) -> str | None:
    """The run's tokenizer file: the copy in the run directory (made at training time, so a
    relative --tokenizer path no longer matters), else the configured path, else None (bytes)."""
    if cfg.data.tokenizer is None:
        return None
    copy = Path(run_dir) / TOKENIZER_JSON
    return str(copy) if copy.is_file() else cfg.data.tokenizer
