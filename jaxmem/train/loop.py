"""The training loop of `python -m jaxmem.train`: steps, progress, metrics, eval, saves, signals.

The device state is the one source of truth for where the run is: the loop reads the step, the
data position and the count of non-finite steps in a row from the train state (the latter from
each step's metrics, read while the next step runs), never from host counters that a resume
would reset. A step is saved at most once: a save step that is also the last step (`--stop-at`,
a signal, the end) is not saved twice.

Saves are asynchronous (jaxmem.io.checkpoint): the loop pauses only while Orbax copies the state
to host memory (`save_pause_s` in the saved step's metrics record), then trains on while the
files are written; the end of the run, `--stop-at` and SIGTERM / Ctrl-C wait for the last write
to commit before the process exits, and a summary line gives the pauses and write times.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import jax
import numpy as np

from jaxmem.data import Batcher, PackedData, eval_batches
from jaxmem.data.chat import copy_chat_files
from jaxmem.data.examples import describe
from jaxmem.decode.sampling import generate_text
from jaxmem.decode.stopping import eos_ids, sample_dtype
from jaxmem.io.checkpoint import Checkpointer
from jaxmem.train.rundir import (CKPT_DIR, METRICS_FILE, copy_tokenizer, truncate_metrics,
                              write_run_config)
from jaxmem.perf import device_memory, flops_per_token, peak_flops
from jaxmem.train import failures
from jaxmem.train.placement import Placement
from jaxmem.train.run import make_eval_fn
from jaxmem.train.step import create_train_state, jit_train_step
from jaxmem.train.trackers import Trackers, eval_metrics


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


def _fmt_bytes(n):
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB"


def _write_config(s, start: int) -> None:
    """config.json: the run's RunConfig now, and every mutable change with its first step."""
    changes = list(s.record.get("changes", [])) + [
        {"step": start, "field": p, "from": a, "to": b} for p, a, b in s.changes]
    write_run_config(s.out, s.cfg, data_stats=s.stats, data_sha256=s.stats["tokens_sha256"],
                     changes=changes, **({"peft_base": s.base_record} if s.base_record else {}))


def eval_prompt(eval_tokens, tokenizer, max_chars: int = 60) -> str:
    """The end-of-training sample's default prompt: the first whole non-empty line of the
    held-out data (after its first document start, else after its first newline: the eval split
    may begin mid-line), at most `max_chars` characters."""
    ids = np.asarray(eval_tokens[:4096])
    starts = np.flatnonzero(ids == tokenizer.bos_id)
    ids = ids[starts[0] + 1:] if starts.size else ids
    ids = ids[(ids != tokenizer.eos_id) & (ids != tokenizer.pad_id)][:1024]
    lines = tokenizer.decode(ids).split("\n")
    lines = lines if starts.size else lines[1:]
    line = next((l for l in lines[:-1] if l.strip()), lines[0] if lines else "")
    return line[:max_chars] + "\n" if len(line) <= max_chars else line[:max_chars]


def _too_big(cfg, par, train_step, args) -> str | None:
    """Where the backend reports the device's size: the train step compiled for these arguments
    (the run's own compile: its first call finds the executable in jit's cache, no second
    compile), and `failures.too_big_message` when its peak exceeds the device. Else None."""
    limit = failures.device_bytes()
    if not limit:  # the CPU reports no size: nothing to compare with
        return None
    peak = failures.compiled_peak(train_step.lower(*args).compile())
    return failures.too_big_message(cfg, peak, limit, 1 if par.mesh is None else par.mesh.size)


def train(s) -> int:
    """Run the loop for a validated `jaxmem.train.cli.Setup`; returns the exit status."""
    from tqdm import tqdm

    cfg, out, step_cfg = s.cfg, s.out, s.step_cfg
    par = s.placement or Placement.single()  # one device, or a mesh (jaxmem.parallel)
    main = par.is_main  # only process 0 writes config.json, metrics and the progress bar
    d, r = cfg.data, cfg.run
    steps = cfg.optim.total_steps
    resumed = s.state is not None
    one = par.mesh is None  # one device: today's functions, called by name here
    state = s.state if resumed else (
        create_train_state(step_cfg, s.loss_scale, d.seed, params=s.init_params) if one
        else par.init_state(step_cfg, s.loss_scale, d.seed, params=s.init_params))
    s.init_params = None  # --init-from's host copy: the state holds the weights now
    start = int(par.host(state.step))
    end = min(steps, r.stop_at or steps)
    pad = s.tokenizer.pad_id
    if isinstance(s.train_tokens, PackedData):  # example rows, packed (jaxmem.data.examples)
        batcher = s.train_tokens.batcher(d.batch_size, d.seq_len, d.seed, pad)
        evals = s.eval_tokens.eval_batches(d.batch_size, d.seq_len, r.eval_batches, pad)
    else:
        batcher = Batcher(s.train_tokens, d.batch_size, d.seq_len, seed=d.seed, pad_id=pad)
        evals = eval_batches(s.eval_tokens, d.batch_size, d.seq_len, r.eval_batches, pad_id=pad)
    train_step, eval_fn = ((jit_train_step(step_cfg), make_eval_fn(step_cfg)) if one
                           else (par.train_step(step_cfg, state), par.eval_fn(step_cfg)))
    frozen = () if s.frozen is None else (s.frozen,)  # LoRA: the frozen base (jaxmem.peft)
    position = int(par.host(state.data_position))  # batches consumed so far, as the state recorded them

    def next_batch(position):
        mbs = [batcher.batch_at(position + i) for i in range(d.grad_accum)]
        return par.batch({k: np.stack([mb[k] for mb in mbs]) for k in mbs[0]})

    if start < end and not r.no_memory_check:  # before anything is written: the dir stays as it was
        refusal = _too_big(cfg, par, train_step, (state, next_batch(position), *frozen))
        if refusal:
            if s.ckpt is not None:
                s.ckpt.close()
            print(refusal, file=sys.stderr, flush=True)
            return 2
    out.mkdir(parents=True, exist_ok=True)
    if main:
        _write_config(s, start)
        copy_tokenizer(out, cfg)  # generate then works from any directory
        copy_chat_files(out, cfg.data.tokenizer)  # and finds the chat template there
    ckpt = s.ckpt or Checkpointer(out / CKPT_DIR, keep=r.keep)
    if start >= end:
        ckpt.close()
        print(f"{out}: already at step {start} of {steps}"
              + (f" (--stop-at {r.stop_at})" if end < steps else "") + "; nothing to do")
        return 0

    device = jax.devices()[0]
    peak = peak_flops(device, step_cfg.precision.compute_dtype)
    fpt = flops_per_token(s.model_cfg, d.seq_len)

    def evaluate(st):
        if not evals:
            return None
        totals = par.host([eval_fn(st.params, par.eval_batch(b), *frozen) for b in evals])
        return float(sum(t for t, _ in totals) / max(sum(c for _, c in totals), 1.0))

    saved_step = start if resumed else None
    saves = {"pause": [], "write": []}  # seconds: the loop held by each save, each write

    def save(st, step):
        """Start writing `step` (asynchronous); the seconds the loop was held, or None when
        this step was saved already."""
        nonlocal saved_step
        if step == saved_step:  # a step is saved once, even when a save step ends the run
            return None
        ckpt.save(step, st, {"step": step, "config": cfg.to_dict()}, wait=False)
        saves["pause"].append(ckpt.last_pause_s)
        saved_step = step
        return saves["pause"][-1]

    def written(seconds):
        if seconds is not None:
            saves["write"].append(seconds)

    def save_summary():
        written(ckpt.wait())  # the last write is committed before the process goes on or exits
        if saves["pause"]:
            p, w = saves["pause"], saves["write"]
            say(f"checkpoints: {len(p)} saved; the loop paused {sum(p) / len(p):.2f} s per "
                f"save (max {max(p):.2f}), writing took {sum(w) / max(len(w), 1):.2f} s "
                f"(max {max(w, default=0):.2f}) in the background")

    if main:
        truncate_metrics(out, start)  # records after the checkpoint are about to be redone
    metrics_file = open(out / METRICS_FILE if main else os.devnull, "a")
    say = print if main else (lambda *a, **k: None)
    # other processes of a multi-process run log nothing (no TensorBoard, W&B or console lines)
    trackers = (Trackers.open(out, cfg, s.tokenizer, steps, start_step=start) if main
                else Trackers(steps, False, plain=False))
    say(f"jaxmem: {cfg.init.init_from or cfg.model.preset} ({s.model_cfg.num_params():,} params), {cfg.precision.mode}, "
          f"remat {step_cfg.remat}, {device.platform}: {device.device_kind}; "
          f"{describe(s.stats, d.seq_len)}; run dir {out}"
          + "".join(f"; {d}" for d in [s.step_cfg.trainable.describe(state.params)] if d)
          + (f"; resuming at step {start}" if resumed else "")
          + ("; no committed checkpoint, starting at step 0" if s.continuing and not resumed else ""),
          flush=True)
    bar = tqdm(total=steps, initial=start, disable=trackers.plain or not main, dynamic_ncols=True,
               unit="step", file=sys.stdout)
    tokens_per_step = d.batch_size * d.seq_len * d.grad_accum
    t_start = t_last = time.perf_counter()
    timing = {"steps": 0, "seconds": 0.0}
    last, skips_run, eval_loss = {}, int(state.skips_in_a_row), None
    max_skips = cfg.precision.max_consecutive_skips

    def tokens_per_sec():
        return tokens_per_step * timing["steps"] / timing["seconds"] if timing["seconds"] else 0.0

    def record(step, metrics, seconds, evaluated=None, save_pause=None):
        """Host side of a finished step: progress bar, metrics.jsonl, the skip counter."""
        nonlocal skips_run
        m = {k: float(v) for k, v in par.host(metrics).items()}
        if step > start + 2:  # the first steps of a process include compilation and dispatch lag
            timing["steps"] += 1
            timing["seconds"] += seconds
        skips_run = int(m["skips_in_a_row"])
        rec = {"step": step, "loss": m["loss"], "lr": m["lr"], "grad_norm": m["grad_norm"],
               "loss_scale": m["loss_scale"], "skipped": bool(m["skipped"]),
               "tokens_per_sec": tokens_per_sec()}
        if evaluated is not None:
            rec = trackers.with_eval_metrics({**rec, "eval_loss": evaluated})
        if save_pause is not None:
            rec["save_pause_s"] = round(save_pause, 4)
        mem = device_memory(device)
        if peak and rec["tokens_per_sec"]:  # GPU: what the end-of-run line prints, per record
            rec["mfu"] = rec["tokens_per_sec"] * fpt / peak
        if mem:  # the process's peak so far (experiments.gpu_check reads it from the record)
            rec["peak_bytes_in_use"] = mem["peak_bytes_in_use"]
        # a skipped (non-finite) step is always recorded: plots and audits count them
        if (step % r.log_every == 0 or step == steps or evaluated is not None or rec["skipped"]
                or save_pause is not None):
            metrics_file.write(json.dumps(rec) + "\n")
            metrics_file.flush()
            rate = timing["seconds"] / timing["steps"] if timing["steps"] else None
            trackers.log(rec, eta_s=rate and rate * (end - step),
                         memory_bytes=mem and mem["bytes_in_use"])
        bar.set_postfix(loss=f"{m['loss']:.3f}", tok_s=f"{tokens_per_sec():,.0f}",
                        scale=f"{m['loss_scale']:g}",
                        **({"mem": _fmt_bytes(mem["bytes_in_use"])} if mem else {}), refresh=False)
        return rec

    with _Stop() as stop:
        step, pending = start, None
        while step < end and stop.requested is None and skips_run <= max_skips:
            state, metrics = train_step(state, next_batch(position), *frozen)
            step, position = step + 1, position + d.grad_accum
            now = time.perf_counter()
            if pending is not None:  # read the previous step's metrics while this one runs
                last = record(*pending)
            pending, t_last = (step, metrics, now - t_last), now
            bar.update(1)
            written(ckpt.poll())  # a background write committed: its time, no waiting
            due_eval = step == steps or (r.eval_every and step % r.eval_every == 0)
            due_save = r.save_every and step % r.save_every == 0 and step < steps
            if due_eval or due_save:
                if due_eval:
                    eval_loss = evaluate(state)
                pause = save(state, step) if due_save else None
                last, pending = record(*pending, evaluated=eval_loss if due_eval else None,
                                       save_pause=pause), None
                t_last = time.perf_counter()  # evaluation and saving are not step time
        if pending is not None:
            last = record(*pending)
        bar.close()
        if skips_run > max_skips:
            metrics_file.close()
            trackers.close()
            ckpt.close()
            print(f"error: {skips_run} non-finite steps in a row (more than "
                  f"--max-consecutive-skips {max_skips}); loss scale now "
                  f"{float(par.host(state.loss_scale.loss_scale)):g}. Nothing was saved for these steps; "
                  f"the newest checkpoint in {out / CKPT_DIR} is untouched.", file=sys.stderr)
            return 1
        save(state, step)
        save_summary()
        ckpt.close()
    metrics_file.close()
    trackers.close()
    if stop.requested or step < steps:
        why = stop.requested or f"--stop-at {r.stop_at}"
        say(f"{why}: saved step {step} to {out / CKPT_DIR}; continue with --resume")
        return 0

    if eval_loss is None:
        eval_loss = evaluate(state)
    tps = tokens_per_sec()
    mem = device_memory(device)
    mfu = tps * fpt / peak if peak and tps else None
    ev = "eval loss n/a" if eval_loss is None else f"eval loss {eval_loss:.4f}" + "".join(
        f", {k[5:].replace('_', ' ')} {v:.4g}"
        for k, v in eval_metrics(eval_loss, s.tokenizer.name == "bytes").items())
    say(f"done: step {step}, train loss {last.get('loss', float('nan')):.4f}, {ev}, "
          f"{f'{tps:,.0f}' if tps else 'n/a'} tokens/s, MFU {'n/a' if mfu is None else f'{100 * mfu:.1f}%'}, "
          f"peak memory {_fmt_bytes(mem and mem['peak_bytes_in_use'])}, "
          f"wall {time.perf_counter() - t_start:.0f} s")
    sm = cfg.sample
    if sm.max_new_tokens and jax.process_count() == 1:  # sharded params: one process only
        params, _ = step_cfg.trainable.model_params(state.params, s.frozen, None)
        ev_tokens = (s.eval_tokens.examples.tokens if isinstance(s.eval_tokens, PackedData)
                     else s.eval_tokens)
        prompt = sm.prompt if sm.prompt is not None else eval_prompt(ev_tokens, s.tokenizer)
        try:
            sample = generate_text(s.model_cfg, params, s.tokenizer, prompt=prompt,
                                   max_new_tokens=sm.max_new_tokens, temperature=sm.temperature,
                                   top_k=sm.top_k, seed=d.seed, note=print,
                                   compute_dtype=sample_dtype(sm.dtype,
                                                              step_cfg.precision.compute_dtype),
                                   eos_ids=eos_ids(s.tokenizer, cfg.init.init_from),
                                   stop=(sm.stop,) if sm.stop else ())
        except ValueError as e:  # a --prompt longer than the model's context: the run is saved
            print(f"sample skipped: {e}")
        else:
            print(f"sample (prompt {prompt!r}"
                  + (", from the eval data" if sm.prompt is None else "") + "):\n" + sample)
    return 0
