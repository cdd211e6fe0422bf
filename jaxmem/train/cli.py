"""`python -m jaxmem.train`: train a Llama-style model, save and resume exactly.

    python -m jaxmem.train                     # tiny preset on the built-in corpus (CPU: minutes)
    python -m jaxmem.train --preset small --precision amp-bf16 --remat dots_no_batch \
        --batch-size 16 --seq-len 1024 --steps 2000 --data 'corpus/*.txt' --out runs/small

Every flag is stored in `<out>/config.json`. The run directory also holds `metrics.jsonl` (one
JSON object per logged step) and `checkpoints/` (Orbax). `--resume` continues from the newest
committed checkpoint: a run of N steps and a run of k steps resumed to N give bitwise-identical
params and per-step losses on CPU. SIGTERM / Ctrl-C finish the current step, save and exit 0.

Bad input exits with status 2 and a one-line message before any training work, and never
creates or touches a checkpoint.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem.config.model import ConfigError, add_model_args, nonneg_float, nonneg_int, positive_int
from jaxmem.train.precision import PRECISIONS, PrecisionError
from jaxmem.model.remat import VALID_POLICIES, RematError
from jaxmem.io.rundir import RunError, config_mismatch, exit_after_failed_restore, read_config
from jaxmem.perf import device_memory, flops_per_token, peak_flops
from jaxmem.train.run import abstract_train_state, build_step_config, make_eval_fn
from jaxmem.train.step import create_train_state, jit_train_step

CONFIG_FILE, METRICS_FILE, CKPT_DIR = "config.json", "metrics.jsonl", "checkpoints"
# Flags that fix the saved state's shapes, dtypes and structure, or the data order: a resume must
# not change them (the model's own fields are compared too).
STATE_FLAGS = ("precision", "mu_dtype", "loss_scale", "clip", "grad_accum", "batch_size",
               "seq_len", "seed")


def state_fields(config: dict) -> dict:
    return {**config.get("model", {}), **{k: config.get(k) for k in STATE_FLAGS}}


# ----------------------------------------------------------------------------- flags

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jaxmem.train",
        description="Train a Llama-style model with jaxmem. With no flags: the tiny preset on the "
                    "built-in corpus (the Python standard library's source, byte-level), a few "
                    "minutes on a 2-core CPU. Uses the GPU when JAX sees one.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_args(p)
    g = p.add_argument_group("memory and precision")
    g.add_argument("--precision", default="fp32", choices=list(PRECISIONS), metavar="MODE",
                   help=f"precision mode: {', '.join(PRECISIONS)} (docs/precision.md)")
    g.add_argument("--remat", default="none",
                   help=f"remat policy for each decoder block: {', '.join(VALID_POLICIES)}")
    g.add_argument("--mu-dtype", default=None, choices=["fp32", "bf16"],
                   help="dtype of Adam's first moment (default: the params' dtype)")
    g.add_argument("--loss-scale", default=None,
                   help="dynamic | static:VALUE | none (default: dynamic for amp-fp16, else none)")
    g.add_argument("--loss-scale-init", type=float, default=2.0**16,
                   help="initial dynamic loss scale (torch GradScaler's default)")
    g.add_argument("--loss-scale-growth-interval", type=positive_int, default=2000,
                   help="finite steps before the dynamic scale doubles")
    g.add_argument("--max-consecutive-skips", type=positive_int, default=100,
                   help="stop with an error after this many non-finite steps in a row")
    g = p.add_argument_group("optimization")
    g.add_argument("--batch-size", type=positive_int, default=16, help="micro-batch size (sequences)")
    g.add_argument("--seq-len", type=positive_int, default=128, help="tokens per sequence")
    g.add_argument("--grad-accum", type=positive_int, default=1,
                   help="micro-batches per optimizer step (global batch = batch-size x grad-accum)")
    g.add_argument("--steps", type=positive_int, default=300, help="optimizer steps in total")
    g.add_argument("--lr", type=nonneg_float, default=3e-3, help="peak learning rate")
    g.add_argument("--min-lr", type=nonneg_float, default=3e-4, help="cosine decay floor")
    g.add_argument("--warmup-steps", type=nonneg_int, default=30, help="linear warmup steps")
    g.add_argument("--weight-decay", type=nonneg_float, default=0.1,
                   help="AdamW decoupled weight decay (not on norms or embeddings)")
    g.add_argument("--clip", type=nonneg_float, default=1.0,
                   help="clip gradients to this global norm after unscaling (0: off)")
    g = p.add_argument_group("data")
    g.add_argument("--data", default=None,
                   help="text files, a directory, a glob, or token files (.bin uint16, .u32.bin "
                        "uint32, .npy); comma-separated lists work (default: built-in corpus)")
    g.add_argument("--tokenizer", default=None,
                   help="a Hugging Face `tokenizers` JSON file (default: byte-level)")
    g = p.add_argument_group("run directory")
    g.add_argument("--out", default=None,
                   help="run directory (default: a new runs/<date>-<time>; required with --resume)")
    g.add_argument("--resume", action="store_true",
                   help="continue from the newest committed checkpoint in --out")
    g.add_argument("--stop-at", type=positive_int, default=None, metavar="STEP",
                   help="stop after STEP steps as if interrupted (save; continue later with "
                        "--resume), e.g. to fit a job's time limit; the schedule still spans --steps")
    g.add_argument("--save-every", type=nonneg_int, default=100, help="save every N steps (0: only at the end)")
    g.add_argument("--keep", type=positive_int, default=3, help="checkpoints to keep")
    g.add_argument("--eval-every", type=nonneg_int, default=100, help="evaluate every N steps (0: only at the end)")
    g.add_argument("--eval-batches", type=positive_int, default=8, help="batches per evaluation")
    g.add_argument("--log-every", type=positive_int, default=10, help="write metrics every N steps")
    g.add_argument("--seed", type=nonneg_int, default=0, help="init and data-order seed")
    g.add_argument("--sample-tokens", type=nonneg_int, default=200,
                   help="tokens to generate at the end (0: none)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar (logs only)")
    return p


# ----------------------------------------------------------------------------- setup

def _check_writable(out: Path) -> None:
    probe = out
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise RunError(f"--out {out}: cannot write to {probe}")


def setup(args, parser):
    """Validate everything and load the data; exits 2 (parser.error) on bad input."""
    from jaxmem.io.checkpoint import CheckpointError, Checkpointer
    from jaxmem.data import DataError, load_corpus, load_tokenizer

    try:
        model_cfg, step_cfg, loss_scale = build_step_config(vars(args))
        remat, precision = step_cfg.remat, step_cfg.precision
        if remat.kind == "offload":
            remat.jax_policy()  # a clear error where the backend cannot offload
        if args.seq_len > model_cfg.max_position_embeddings:
            raise RunError(f"--seq-len {args.seq_len} exceeds the model's max_position_embeddings "
                           f"{model_cfg.max_position_embeddings}")
        out = Path(args.out)
        _check_writable(out)
        if not args.resume and ((out / CONFIG_FILE).exists() or (out / CKPT_DIR).exists()):
            raise RunError(f"--out {out} already holds a run; pass --resume to continue it or "
                           f"choose another --out (nothing was changed)")
        tokenizer = load_tokenizer(args.tokenizer)
        if tokenizer.vocab_size > model_cfg.vocab_size:
            raise RunError(f"--tokenizer has {tokenizer.vocab_size} ids but the model's vocab_size "
                           f"is {model_cfg.vocab_size} (set --vocab-size)")
        train_tokens, eval_tokens, stats = load_corpus(args.data, tokenizer, model_cfg.vocab_size,
                                                       seq_len=args.seq_len)
        config = {**vars(args), "model": {k: getattr(model_cfg, k) for k in model_cfg.__dataclass_fields__}}
        ckpt, resume_from = None, None
        if args.resume:
            saved = read_config(out / CONFIG_FILE)
            diff = config_mismatch(state_fields(saved), state_fields(config))
            if diff:
                raise RunError(f"--resume: the run in {out} was made with a different config: {diff}")
            if saved.get("data_sha256") not in (None, stats["tokens_sha256"]):
                raise RunError(f"--resume: --data differs from the run's data (token hash changed)")
            ckpt = Checkpointer(out / CKPT_DIR, keep=args.keep)
            resume_from = ckpt.latest_step()
            if resume_from is None:
                raise RunError(f"--resume: no committed checkpoint in {out / CKPT_DIR}")
            abstract = abstract_train_state(step_cfg, loss_scale, args.seed)
            state, _ = ckpt.restore(resume_from, abstract)  # CheckpointError names step and path
        else:
            state = None
    except (ConfigError, RematError, PrecisionError, RunError, DataError, CheckpointError,
            ValueError) as e:
        if isinstance(e, CheckpointError):
            exit_after_failed_restore(parser, str(e).splitlines()[0])
        parser.error(str(e).splitlines()[0] if str(e) else repr(e))
    config["data_stats"] = stats
    config["data_sha256"] = stats["tokens_sha256"]
    return dict(model_cfg=model_cfg, step_cfg=step_cfg, loss_scale=loss_scale, out=out,
                tokenizer=tokenizer, train_tokens=train_tokens, eval_tokens=eval_tokens,
                config=config, ckpt=ckpt, state=state, resume_from=resume_from)


# ----------------------------------------------------------------------------- the loop

class _Stop:
    """SIGTERM / SIGINT set a flag; the loop finishes its step, saves and exits 0."""

    def __init__(self):
        self.requested = None
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now (committed checkpoints are safe)
        self.requested = signal.Signals(signum).name

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _truncate_metrics(path: Path, last_step: int) -> None:
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= last_step]
    path.write_text("".join(line + "\n" for line in keep))


def _fmt_bytes(n):
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB"


def train(args, parser) -> int:
    from tqdm import tqdm

    from jaxmem.io.checkpoint import Checkpointer
    from jaxmem.data import Batcher, eval_batches

    s = setup(args, parser)
    out, step_cfg, config = s["out"], s["step_cfg"], s["config"]
    out.mkdir(parents=True, exist_ok=True)
    if not args.resume:
        (out / CONFIG_FILE).write_text(json.dumps(config, indent=2, default=str))
    ckpt = s["ckpt"] or Checkpointer(out / CKPT_DIR, keep=args.keep)
    state = s["state"] or create_train_state(step_cfg, s["loss_scale"], args.seed)
    start = int(state.step)
    if start >= args.steps:
        print(f"{out}: already at step {start} of {args.steps}; nothing to do")
        return 0

    batcher = Batcher(s["train_tokens"], args.batch_size, args.seq_len, seed=args.seed, pad_id=s["tokenizer"].pad_id)
    evals = eval_batches(s["eval_tokens"], args.batch_size, args.seq_len, args.eval_batches,
                         pad_id=s["tokenizer"].pad_id)
    train_step, eval_fn = jit_train_step(step_cfg), make_eval_fn(step_cfg)
    device = jax.devices()[0]
    peak = peak_flops(device, step_cfg.precision.compute_dtype)
    fpt = flops_per_token(s["model_cfg"], args.seq_len)

    def next_batch(position):
        mbs = [batcher.batch_at(position + i) for i in range(args.grad_accum)]
        return {k: np.stack([mb[k] for mb in mbs]) for k in mbs[0]}

    def evaluate(st):
        if not evals:
            return None
        totals = [eval_fn(st.params, b) for b in evals]
        return float(sum(t for t, _ in totals) / max(sum(c for _, c in totals), 1.0))

    def save(st, step):
        ckpt.save(step, st, {"step": step, "config": config}, wait=True)

    if args.resume:  # drop records of steps after the checkpoint: they are about to be redone
        _truncate_metrics(out / METRICS_FILE, start)
    metrics_file = open(out / METRICS_FILE, "a")
    print(f"jaxmem: {args.preset} ({s['model_cfg'].num_params():,} params), {args.precision}, "
          f"remat {step_cfg.remat}, {device.platform}: {device.device_kind}; "
          f"{len(s['train_tokens']):,} train tokens; run dir {out}"
          + (f"; resuming at step {start}" if args.resume else ""), flush=True)
    bar = tqdm(total=args.steps, initial=start, disable=args.no_progress, dynamic_ncols=True,
               unit="step", file=sys.stdout)
    tokens_per_step = args.batch_size * args.seq_len * args.grad_accum
    t_start = t_last = time.perf_counter()
    timing = {"steps": 0, "seconds": 0.0}
    last, skips_run, eval_loss = {}, 0, None

    def tokens_per_sec():
        return tokens_per_step * timing["steps"] / timing["seconds"] if timing["seconds"] else 0.0

    def record(step, metrics, seconds, evaluated=None):
        """Host side of a finished step: progress bar, metrics.jsonl, the skip counter."""
        nonlocal skips_run
        m = {k: float(v) for k, v in jax.device_get(metrics).items()}
        if step > start + 2:  # the first steps of a process include compilation and dispatch lag
            timing["steps"] += 1
            timing["seconds"] += seconds
        skips_run = skips_run + 1 if m["skipped"] else 0
        rec = {"step": step, "loss": m["loss"], "lr": m["lr"], "grad_norm": m["grad_norm"],
               "loss_scale": m["loss_scale"], "skipped": bool(m["skipped"]),
               "tokens_per_sec": tokens_per_sec()}
        if evaluated is not None:
            rec["eval_loss"] = evaluated
        if step % args.log_every == 0 or step == args.steps or evaluated is not None:
            metrics_file.write(json.dumps(rec) + "\n")
            metrics_file.flush()
        mem = device_memory(device)
        bar.set_postfix(loss=f"{m['loss']:.3f}", tok_s=f"{tokens_per_sec():,.0f}",
                        scale=f"{m['loss_scale']:g}",
                        **({"mem": _fmt_bytes(mem["bytes_in_use"])} if mem else {}), refresh=False)
        return rec

    with _Stop() as stop:
        step, pending = start, None
        end = min(args.steps, args.stop_at or args.steps)
        while step < end and stop.requested is None and skips_run <= args.max_consecutive_skips:
            state, metrics = train_step(state, next_batch(step * args.grad_accum))
            step += 1
            now = time.perf_counter()
            if pending is not None:  # read the previous step's metrics while this one runs
                last = record(*pending)
            pending, t_last = (step, metrics, now - t_last), now
            bar.update(1)
            due_eval = step == args.steps or (args.eval_every and step % args.eval_every == 0)
            due_save = args.save_every and step % args.save_every == 0 and step < args.steps
            if due_eval or due_save:
                if due_eval:
                    eval_loss = evaluate(state)
                last, pending = record(*pending, evaluated=eval_loss if due_eval else None), None
                if due_save:
                    save(state, step)
                t_last = time.perf_counter()  # evaluation and saving are not step time
        if pending is not None:
            last = record(*pending)
        bar.close()
        if skips_run > args.max_consecutive_skips:
            metrics_file.close()
            print(f"error: {skips_run} non-finite steps in a row (more than "
                  f"--max-consecutive-skips {args.max_consecutive_skips}); loss scale now "
                  f"{float(state.loss_scale.loss_scale):g}. Nothing was saved for these steps; "
                  f"the newest checkpoint in {out / CKPT_DIR} is untouched.", file=sys.stderr)
            return 1
        save(state, step)
        ckpt.close()
    metrics_file.close()
    if stop.requested or step < args.steps:
        why = stop.requested or f"--stop-at {args.stop_at}"
        print(f"{why}: saved step {step} to {out / CKPT_DIR}; continue with --resume")
        return 0

    if eval_loss is None:
        eval_loss = evaluate(state)
    tps = tokens_per_sec()
    mem = device_memory(device)
    mfu = tps * fpt / peak if peak and tps else None
    print(f"done: step {step}, train loss {last.get('loss', float('nan')):.4f}, "
          f"eval loss {eval_loss if eval_loss is None else round(eval_loss, 4)}, "
          f"{f'{tps:,.0f}' if tps else 'n/a'} tokens/s, MFU {'n/a' if mfu is None else f'{100 * mfu:.1f}%'}, "
          f"peak memory {_fmt_bytes(mem and mem['peak_bytes_in_use'])}, "
          f"wall {time.perf_counter() - t_start:.0f} s")
    if args.sample_tokens:
        from jaxmem.generate.sampling import generate_text
        sample = generate_text(s["model_cfg"], state.params, s["tokenizer"], prompt="def ",
                               max_new_tokens=args.sample_tokens, temperature=0.8, top_k=40,
                               seed=args.seed, compute_dtype=step_cfg.precision.compute_dtype)
        print("sample:\n" + sample)
    return 0


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.out is None:
        if args.resume:
            parser.error("--resume needs --out: the run directory to continue")
        args.out = time.strftime("runs/%Y%m%d-%H%M%S")
    return train(args, parser)


if __name__ == "__main__":
    sys.exit(main())
