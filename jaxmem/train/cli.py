"""`python -m jaxmem.train`: train a decoder language model, save and resume exactly.

    python -m jaxmem.train                     # tiny preset on the built-in corpus (CPU: minutes)
    python -m jaxmem.train --preset small --precision amp-bf16 --remat dots_no_batch \
        --batch-size 16 --seq-len 1024 --steps 2000 --data 'corpus/*.txt' --out runs/small
    python -m jaxmem.train --out runs/small --resume      # continue with the saved config
    python -m jaxmem.train --config qlora.yaml --lr 1e-4 --dry-run   # the config and its plan

The flags, a config file (`--config FILE`, YAML with RunConfig's sections as keys; a run's
config.json starts a new run) and a recipe (`--recipe NAME`) are layered: default < recipe <
file < flag (jaxmem.config.files). `--dry-run` prints every value with where it came from and
the plan of the run's phases (jaxmem.memory), and exits without training or making a directory.

The flags are generated from RunConfig (jaxmem.config.run); the run's RunConfig is stored in
`<out>/config.json`. The run directory also holds `metrics.jsonl` and `checkpoints/` (Orbax).

Continuing a run. `--out DIR` on a directory that holds a run continues it when the flags given
agree with its config: from the newest committed checkpoint, or from step 0 when the run died
before its first one (a preempted job is relaunched with the same command line). `--resume`
continues with the saved config, so no flag needs retyping; flags given with it are compared
field by field. Fields that fix the state, the data or the schedule (shapes, dtypes, precision,
remat, optimizer and schedule, data, seed, batch) cannot change: the run is refused, naming the
fields. Fields of the run directory, evaluation, logging, the skip limit and the final sample
may change; config.json records each change with the step it took effect. `--steps` is part of
the schedule (the cosine spans it), so a run is never silently stretched: stop early with
`--stop-at` instead (it applies to one invocation: a later `--resume` does not inherit it).

A run of N steps and a run of k steps resumed to N give bitwise-identical params and per-step
losses on CPU. SIGTERM / Ctrl-C finish the current step, save and exit 0. Bad input exits 2 with
a one-line message before any training work and never creates or touches a checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from jaxmem.config.files import Layers, add_config_flags, provenance_lines
from jaxmem.config.flags import add_run_flags
from jaxmem.config.run import RunConfig, is_mutable
from jaxmem import target
from jaxmem.data import DataError, load_corpus
from jaxmem.data.tokenizers import TOKEN_NAMES, load_tokenizer, section_tokenizer
from jaxmem.data.checks import data_warnings
from jaxmem.data.examples import example_options
from jaxmem.io.checkpoint import CheckpointError, Checkpointer
from jaxmem.memory.layered import model_inputs, run_layers
from jaxmem.train.rundir import (CKPT_DIR, CONFIG_FILE, RunError, exit_after_failed_restore, fail,
                              read_run_config, restore_hint, run_tokenizer)
from jaxmem.parallel.distributed import add_process_flags, initialize_from_args
from jaxmem.parallel.mesh import run_mesh
from jaxmem.train.placement import Placement, check_offload
from jaxmem.train.init_from import init_from_overrides, init_params_from
from jaxmem.train.reference import REFERENCE_FILE
from jaxmem.train.run import (abstract_train_state, build_step_config, preference_options,
                              step_tokens)
from jaxmem.train.setup import Setup

SECTIONS = ("model", "init", "precision", "remat", "optim", "data", "run", "sample", "peft", "parallel",
            "objective")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jaxmem.train",
        description="Train a decoder language model with jaxmem. With no flags: the tiny preset on the "
                    "built-in corpus (the Python standard library's source, byte-level), a few "
                    "minutes on a 2-core CPU. Uses the GPU when JAX sees one. --out on a directory "
                    "that holds a run continues it (see --resume).")
    files = p.add_argument_group("config files and dry run")
    add_config_flags(files)
    files.add_argument("--dry-run", action="store_true",
                       help="print the resolved config (each value with where it came from: "
                            "default, recipe, FILE:LINE or flag), the plan of the run's phases "
                            "and the verdict (jaxmem.memory), and exit without training or "
                            "making the run directory")
    files.add_argument("--target", choices=sorted(target.CARDS), metavar="GPU",
                       help="with --dry-run: plan for this GPU (default: the config's card:, "
                            "else the GPU here, else the analytic plan): "
                            + ", ".join(sorted(target.CARDS)))
    groups = add_run_flags(p, SECTIONS)
    groups["run directory"].add_argument(
        "--resume", action="store_true",
        help="continue the run in --out with its saved config; flags given with it are compared "
             "(shapes, dtypes, data, seed and schedule cannot change; run-directory, eval, "
             "logging and sampling flags can)")
    groups["run directory"].add_argument(
        "--resume-step", type=int, default=None, metavar="STEP",
        help="with --resume: continue from this committed step instead of the newest (e.g. when "
             "the newest checkpoint is damaged); the later checkpoints are deleted")
    add_process_flags(groups["devices and processes"])
    return p


def _check_writable(out: Path) -> None:
    probe = out
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise RunError(f"--out {out}: cannot write to {probe}")


def _fixed_differences(saved: RunConfig, record: dict, cfg: RunConfig) -> list[str]:
    """'field: saved -> new' for every difference a resume cannot accept."""
    diffs = [f"{p}: {a!r} -> {b!r}" for p, a, b in saved.differences(cfg) if not is_mutable(p)]
    resolved = record.get("resolved_model") or {}
    if not diffs and resolved:  # same flags, but the preset itself changed since the run began
        now = json.loads(json.dumps(dataclasses.asdict(cfg.model_config())))  # as recorded
        diffs = [f"resolved model {k}: {v!r} -> {now.get(k)!r}" for k, v in resolved.items()
                 if now.get(k) != v]
    return diffs


def _choose_config(overrides: dict, resume: bool, out: Path):
    """(config, continuing, saved record, mutable changes) for a new or continued run."""
    if not (out / CONFIG_FILE).exists():
        if resume:
            read_run_config(out)  # raises RunError: no run config here
        if (out / CKPT_DIR).exists():
            raise RunError(f"--out {out} has {CKPT_DIR}/ but no {CONFIG_FILE}; choose another --out "
                           f"(nothing was changed)")
        return RunConfig().replace(overrides), False, {}, []
    saved, record = read_run_config(out)
    # --stop-at is an instruction to one invocation, not part of the run: never inherited;
    # nor are --mesh (a resumed run gets the default mesh of the devices it has now) and
    # --no-memory-check (the check is about the device this invocation runs on) and --profile.
    base = saved.replace({"run.stop_at": None, "parallel.mesh": None,
                          "run.no_memory_check": False, "run.profile": None}) if resume \
        else RunConfig()
    cfg = base.replace(overrides)
    fixed = _fixed_differences(saved, record, cfg)
    if fixed and resume:
        raise RunError(f"--resume: the run in {out} was made with a different config: "
                       f"{', '.join(fixed)} (these cannot change on resume)")
    if fixed:
        raise RunError(f"--out {out} already holds a run made with a different config "
                       f"({', '.join(fixed)}); pass --resume to continue it with its saved config, "
                       f"or choose another --out (nothing was changed)")
    changes = [(p, a, b) for p, a, b in saved.differences(cfg) if p != "run.out"]
    return cfg, True, record, changes


def _layers(args) -> Layers:
    """The run's overrides: --recipe, --config, then the flags (jaxmem.config.files). A run's
    config.json starts a new run, never its own again (that is --resume)."""
    lay = run_layers(args)
    out = lay.overrides.get("run.out")
    for f in lay.files:
        if f.record and out is not None and Path(out).resolve() == f.path.parent.resolve():
            raise RunError(f"--config {f.path} is the config of the run in --out {out}: to "
                           f"continue that run, pass --out {out} --resume without --config; to "
                           f"start a new one, choose another --out (nothing was changed)")
    return lay


def setup(args, parser) -> Setup:
    """Validate everything and load the data; exits 2 (parser.error) on bad input."""
    lay = Layers()  # (empty until read: an error in a file names its own line)
    try:
        lay = _layers(args)
        overrides = dict(lay.overrides)
        initialize_from_args(args)  # multi-process runs: before anything touches the backend
        if "run.out" not in overrides:
            if args.resume:
                raise RunError("--resume needs --out: the run directory to continue")
            overrides["run.out"] = time.strftime("runs/%Y%m%d-%H%M%S")
        out = Path(overrides["run.out"])
        overrides = init_from_overrides(overrides)  # --init-from: the checkpoint's model, tokenizer
        _check_writable(out)
        given_tokenizer = _vocab_from_tokenizer(overrides)
        cfg, continuing, record, changes = _choose_config(overrides, args.resume, out)
        # a new run's tokenizer is the one just loaded (the same file and names); a continued
        # run's is its directory's copy
        tokenizer = (section_tokenizer(cfg.data, run_tokenizer(out, cfg)) if continuing
                     else given_tokenizer or section_tokenizer(cfg.data, cfg.data.tokenizer))
        for line in tokenizer.notes:  # a bare tokenizer.json: its special tokens were guessed
            print(line, file=sys.stderr)
        if cfg.precision.fp8_gemms:  # fp8 GEMMs need these XLA flags (jaxmem.model.fp8)
            from jaxmem.model.fp8_compile import set_xla_flags
            set_xla_flags()
        model_cfg, step_cfg, loss_scale = build_step_config(cfg)
        if tokenizer.vocab_size > model_cfg.vocab_size:
            raise RunError(f"--tokenizer has {tokenizer.vocab_size} ids but --vocab-size is "
                           f"{model_cfg.vocab_size} (leave it out to use the tokenizer's)")
        train_tokens, eval_tokens, stats = load_corpus(cfg.data.data, tokenizer, model_cfg.vocab_size,
                                                       seq_len=cfg.data.seq_len,
                                                       **example_options(cfg.data),
                                                       **preference_options(cfg, step_cfg))
        for line in data_warnings(stats, step_tokens(cfg, step_cfg), cfg.optim.total_steps):
            print(line, file=sys.stderr)
        s = Setup(cfg, model_cfg, step_cfg, loss_scale, out, tokenizer, train_tokens, eval_tokens,
                  stats, continuing=continuing, record=record, changes=changes)
        s.placement = _placement(cfg, model_cfg)
        # LoRA / QLoRA: the frozen base, checked against the run's record (None: full)
        s.frozen, s.base_record = step_cfg.trainable.prepare_frozen(
            cfg, model_cfg, step_cfg, record if continuing else None, cfg.init.init_from,
            s.placement.base_shardings(step_cfg))
        if continuing:
            _restore(args, s)
        elif args.resume_step is not None:
            raise RunError("--resume-step needs --resume (or --out of an existing run)")
        if s.state is None and cfg.init.init_from is not None:  # LoRA: None (it is the base)
            s.init_params = step_cfg.trainable.params_from_checkpoint(lambda: init_params_from(
                cfg.init.init_from, model_cfg, step_cfg.precision.param_dtype))
    except CheckpointError as e:
        exit_after_failed_restore(parser, str(e).splitlines()[0])
    except (RunError, DataError, ValueError) as e:  # ConfigError, RematError ... are ValueErrors
        fail(parser, lay.explain(str(e).splitlines()[0]) if str(e) else repr(e))
    return s


def _vocab_from_tokenizer(overrides: dict):
    """The tokenizer --tokenizer names when --vocab-size is not given, its vocabulary size put
    in `overrides` as the model's (an explicit smaller one is refused later); else None."""
    if "data.tokenizer" not in overrides or "model.vocab_size" in overrides:
        return None
    tokenizer = load_tokenizer(overrides["data.tokenizer"], **{
        k: overrides.get(f"data.{k}") for k in TOKEN_NAMES})
    overrides["model.vocab_size"] = tokenizer.vocab_size
    return tokenizer


def _placement(cfg: RunConfig, model_cfg) -> Placement:
    """Where the run's state lives: one device, or the mesh of --mesh (or of the devices here);
    refuses --optimizer-in-backward on a mesh and an offload the device cannot hold."""
    mesh = run_mesh(cfg.parallel.mesh, model_cfg, cfg.data.batch_size, seq_len=cfg.data.seq_len)
    if mesh is not None and cfg.optim.in_backward:
        raise RunError(f"--optimizer-in-backward runs on one device; this run has a mesh "
                       f"({dict(mesh.shape)}): pass --mesh with one device, or drop the flag")
    check_offload(cfg.optim)
    return (Placement.single(cfg.optim.offload_optimizer, cfg.optim.offload_params)
            if mesh is None else Placement.on(mesh, cfg.peft.offload_base,
                                              cfg.optim.offload_optimizer))


def _restore(args, s: Setup) -> None:
    """A continued run: checks its data against the record, opens its checkpointer and restores
    the step it continues from (`_resume_step`), deleting the later ones."""
    cfg, out, step_cfg = s.cfg, s.out, s.step_cfg
    if s.record.get("data_sha256") not in (None, s.stats["tokens_sha256"]):
        raise RunError(f"--out {out}: --data differs from the run's data (token hash changed)")
    s.ckpt = Checkpointer(out / CKPT_DIR, keep=cfg.run.keep)
    steps = s.ckpt.all_steps()
    step = _resume_step(args, steps, out)
    if step is not None and step_cfg.objective.reference and s.frozen is None and \
            not (out / REFERENCE_FILE).is_file():
        raise RunError(f"--out {out}: {REFERENCE_FILE} is missing, so the run's DPO "
                       f"reference (its step-0 model's log-probs) cannot be recomputed "
                       f"at step {step}; start a new run")
    if step is None:  # the run died before its first checkpoint: it starts at 0
        return
    # targets with the current mesh's shardings: a run saved on any mesh resumes here
    abstract = s.placement.abstract(abstract_train_state(step_cfg, s.loss_scale, cfg.data.seed))
    try:
        s.state, _ = s.ckpt.restore(step, abstract)  # names step and path
    except CheckpointError as e:
        raise CheckpointError(str(e).splitlines()[0] + restore_hint(
            steps, step, str(e), cfg.optim.optimizer)) from e
    for later in (x for x in steps if x > step):  # --resume-step: redone from here
        s.ckpt.delete(later)


def _resume_step(args, steps: list[int], out: Path) -> int | None:
    """The step to continue from: --resume-step, else the newest committed one (or None)."""
    if args.resume_step is None:
        return steps[-1] if steps else None
    if args.resume_step not in steps:
        raise RunError(f"--resume-step {args.resume_step}: no committed step {args.resume_step} in "
                       f"{out / CKPT_DIR} (committed: {', '.join(map(str, steps)) or 'none'})")
    return args.resume_step


def dry_run(args, parser) -> int:
    """--dry-run: the resolved config with each value's source, then the plan (jaxmem.memory);
    reads --init-from's config.json (not its weights) and, with --out of a run, its config.json
    as a real run would (--resume: the saved config under the flags); makes nothing."""
    from jaxmem.memory.commands import plan_run  # noqa: PLC0415

    lay, note = Layers(), "a new run"
    try:
        lay = model_inputs(_layers(args))
        out = lay.overrides.get("run.out")
        if args.resume and out is None:
            raise RunError("--resume needs --out: the run directory to continue")
        cfg = RunConfig().replace(lay.overrides)
        if out is not None and (args.resume or (Path(out) / CONFIG_FILE).exists()):
            cfg, continuing, _, _ = _choose_config(lay.overrides, args.resume, Path(out))
            for p in (p for p, _, _ in RunConfig().differences(cfg) if p not in lay.sources):
                lay.sources[p] = f"{Path(out) / CONFIG_FILE}: the run's saved config"
            note = f"continues the run in {out}" if continuing else note
        build_step_config(cfg)  # validates shapes, remat, precision, the sections together
    except (RunError, DataError, ValueError) as e:
        fail(parser, lay.explain(str(e).splitlines()[0]) if str(e) else repr(e))
    print(f"{parser.prog} --dry-run ({note}): nothing is trained and no run directory is made "
          f"or changed")
    if lay.description:
        print(f"description: {lay.description}")
    if lay.replaced:
        print(f"the checkpoint (--init-from) sets the model in place of: {', '.join(lay.replaced)}")
    print("resolved config (value, and where it came from):")
    print("\n".join(provenance_lines(cfg, lay.sources)) + "\n", flush=True)
    return plan_run(cfg, args.target or lay.card, parser.prog)


def main(argv=None) -> int:
    from jaxmem.train.loop import train

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.dry_run:
        return dry_run(args, parser)
    if args.target is not None:
        parser.error("--target plans for a GPU: it needs --dry-run")
    s = setup(args, parser)
    try:
        return train(s)
    except Exception as e:  # XLA's RESOURCE_EXHAUSTED: a paragraph of help instead of pages
        from jaxmem.train.failures import is_oom, oom_message

        if not is_oom(e):
            raise
        mesh = s.placement.mesh
        print(oom_message(s.cfg, s.out, e, devices=1 if mesh is None else mesh.size),
              file=sys.stderr, flush=True)
        return 1
