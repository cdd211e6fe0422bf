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
import signal
import sys
import time
from pathlib import Path

import jax
import numpy as np

from jaxmem.data import PackedData, PreferencePairs, train_batcher
from jaxmem.data.examples import describe
from jaxmem.decode.sampling import generate_text
from jaxmem.decode.stopping import eos_ids, sample_dtype
from jaxmem.io.checkpoint import Checkpointer
from jaxmem.train.rundir import (CKPT_DIR, copy_tokenizer,
                              write_run_config)
from jaxmem import target
from jaxmem.perf import device_memory
from jaxmem.xla.timing import Machine, step_time
from jaxmem.train import failures
from jaxmem.train.placement import Placement
from jaxmem.train.evaluate import EvalBatches, evaluate
from jaxmem.train.run import make_eval_fn, step_tokens
from jaxmem.train.reference import (WithReference, reference_tables, save_tables,
                                    with_reference_eval)
from jaxmem.train.step import create_train_state, jit_train_step
from jaxmem.train.records import Records, fmt_bytes
from jaxmem.train.trackers import eval_metrics, plain_progress
from jaxmem.train.setup import Setup
from jaxmem.families.params import model_flops, num_params


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


PROFILED_STEPS = 3  # --profile traces the run's last steps, compiled and warm
PROFILE_STEPS_FILE = "profiled_steps.json"  # beside the trace: which steps it holds


def _predicted(s, compiled, steps: int) -> str | None:
    """On a card jaxmem.target knows, the step's predicted time read from its compiled program
    (jaxmem.xla.timing), and the run's: a line for the banner. None elsewhere (a CPU)."""
    card = target.card_here()
    if card is None or compiled is None:
        return None
    t = step_time(compiled.as_text(), Machine.of_card(card))
    tokens = step_tokens(s.cfg, s.step_cfg)
    mfu = model_flops(s.model_cfg, s.cfg.data.seq_len) * tokens / t.seconds / (card.peak_tflops[0] * 1e12)
    return (f"predicted on the {card.name} (its compiled step, jaxmem.xla.timing; not a "
            f"measurement): {t.seconds:.3f} s/step, {tokens / t.seconds:,.0f} tokens/s, MFU "
            f"{mfu:.1%}; {steps:,} steps ~ {_duration(steps * t.seconds)}")


def _duration(seconds: float) -> str:
    h, m = divmod(round(seconds / 60), 60)
    return f"{h} h {m:02d} min" if h else f"{m} min" if m else f"{seconds:.0f} s"


class _Batches:
    """The run's training batches (a step's `--grad-accum` micro-batches stacked, placed on the
    mesh) and its fixed evaluation batches, from plain token streams or packed example rows."""

    def __init__(self, s, par: Placement, reference=None):
        d, pad = s.cfg.data, s.tokenizer.pad_id
        self.par, self.grad_accum = par, d.grad_accum
        self.batcher = train_batcher(s.train_tokens, d.batch_size, d.seq_len, d.seed, pad_id=pad)
        # the first --eval-batches of the held-out split, built once (jaxmem.train.evaluate)
        self.evals = list(EvalBatches(s.eval_tokens, d.batch_size, d.seq_len, pad,
                                      s.cfg.run.eval_batches))
        if reference is not None:  # DPO's precomputed reference (jaxmem.train.reference)
            self.batcher = WithReference(self.batcher, reference["train"], d.seq_len)
            self.evals = with_reference_eval(self.evals, reference["eval"], d.batch_size,
                                             d.seq_len)

    def at(self, position: int) -> dict:
        """The step that starts at batch `position` (batches consumed so far)."""
        mbs = [self.batcher.batch_at(position + i) for i in range(self.grad_accum)]
        return self.par.batch({k: np.stack([mb[k] for mb in mbs]) for k in mbs[0]})


class _Saves:
    """The run's checkpoint writes: each step saved at most once, asynchronously; the seconds
    the loop was held by each save and the seconds each background write took."""

    def __init__(self, ckpt: Checkpointer, cfg, saved_step: int | None):
        self.ckpt, self.cfg, self.saved_step = ckpt, cfg, saved_step
        self.pauses, self.writes = [], []

    def save(self, state, step: int) -> float | None:
        """Start writing `step`; the seconds the loop was held, or None when this step was
        saved already (a save step that also ends the run is saved once)."""
        if step == self.saved_step:
            return None
        self.ckpt.save(step, state, {"step": step, "config": self.cfg.to_dict()}, wait=False)
        self.pauses.append(self.ckpt.last_pause_s)
        self.saved_step = step
        return self.pauses[-1]

    def written(self, seconds: float | None) -> None:
        if seconds is not None:
            self.writes.append(seconds)

    def finish(self, say) -> None:
        """Wait for the last write to commit, then say what the saves cost."""
        self.written(self.ckpt.wait())
        if self.pauses:
            p, w = self.pauses, self.writes
            say(f"checkpoints: {len(p)} saved; the loop paused {sum(p) / len(p):.2f} s per "
                f"save (max {max(p):.2f}), writing took {sum(w) / max(len(w), 1):.2f} s "
                f"(max {max(w, default=0):.2f}) in the background")


def _prepare(s, par: Placement, start: int) -> Checkpointer:
    """The run directory, before the first step: config.json, the tokenizer and chat files
    (process 0), and the checkpointer."""
    s.out.mkdir(parents=True, exist_ok=True)
    if par.is_main:
        _write_config(s, start)
        copy_tokenizer(s.out, s.cfg)  # generate, eval and export need only the run directory
    return s.ckpt or Checkpointer(s.out / CKPT_DIR, keep=s.cfg.run.keep)


def _banner(s, state, start: int, resumed: bool, device) -> str:
    return (f"jaxmem: {s.cfg.init.init_from or s.cfg.model.preset} "
            f"({num_params(s.model_cfg):,} params), {s.cfg.precision.mode}, "
            f"remat {s.step_cfg.remat}, {device.platform}: {device.device_kind}; "
            f"{describe(s.stats, s.cfg.data.seq_len)}; run dir {s.out}"
            + "".join(f"; {d}" for d in [s.step_cfg.trainable.describe(state.params)] if d)
            + (f"; resuming at step {start}" if resumed else "")
            + ("; no committed checkpoint, starting at step 0" if s.continuing and not resumed
               else ""))


class _Run:
    """One invocation's training from `start` to `end`: the compiled programs, the batches, the
    state, the saves and the records."""

    def __init__(self, s, par: Placement):
        self.s, self.par, self.cfg, self.r = s, par, s.cfg, s.cfg.run
        self.resumed = s.state is not None
        # one device, nothing on the host: today's functions, called by name here
        self.one = par.mesh is None and not par.host_parts
        step_cfg, seed = s.step_cfg, s.cfg.data.seed
        self.state = s.state if self.resumed else (
            create_train_state(step_cfg, s.loss_scale, seed, params=s.init_params) if self.one
            else par.init_state(step_cfg, s.loss_scale, seed, params=s.init_params,
                                progress=par.is_main and not plain_progress(self.r.no_progress)))
        s.init_params = None  # --init-from's host copy: the state holds the weights now
        # the device's peak once the state exists: what making (or restoring) it took, which a
        # GPU run's process peak alone cannot tell from its steps' (experiments.gpu_check)
        jax.block_until_ready(self.state)
        self.state_peak = (device_memory(jax.devices()[0]) or {}).get("peak_bytes_in_use")
        self.steps = self.cfg.optim.total_steps
        self.start = int(par.host(self.state.step))
        self.end = min(self.steps, self.r.stop_at or self.steps)
        self.reference = reference_tables(s, self.state.params, par, self.resumed)
        self.batches = _Batches(s, par, self.reference)
        self.train_step, self.eval_fn = (
            (jit_train_step(step_cfg), make_eval_fn(step_cfg)) if self.one
            else (par.train_step(step_cfg, self.state), par.eval_fn(step_cfg)))
        self.frozen = step_cfg.trainable.step_args(s.frozen)  # LoRA: (the frozen base,)
        # batches consumed so far, as the state recorded them
        self.position = int(par.host(self.state.data_position))

    def compiled(self):
        """The train step compiled for the run's arguments where the backend reports the
        device's size (a GPU; the run's own compile: its first call finds the executable in
        jit's cache, no second compile), else None (the CPU: nothing to check or predict)."""
        if self.start >= self.end or not failures.device_bytes():
            return None
        args = (self.state, self.batches.at(self.position), *self.frozen)
        return self.train_step.lower(*args).compile()

    def refusal(self, compiled) -> str | None:
        """Why the compiled step does not fit the device (else None)."""
        if compiled is None or self.r.no_memory_check:
            return None
        return failures.too_big_message(
            self.cfg, failures.compiled_peak(compiled), failures.device_bytes(),
            1 if self.par.mesh is None else self.par.mesh.size)

    def evaluate(self):
        """The objective's mean on the held-out batches (None: there are none), by the function
        `python -m jaxmem.eval` calls too: the loss, or (the loss, the objective's metrics)
        where it has any (a preference objective's rewards)."""
        if not self.batches.evals:
            return None
        result = evaluate(self.eval_fn, self.state.params, self.batches.evals, self.frozen,
                          self.par.eval_batch, self.par.host, objective=self.s.step_cfg.objective)
        return (result.loss, result.metrics) if result.metrics else result.loss

    def loop(self, rec: Records, saves: _Saves, stop: _Stop) -> tuple[int, float | None]:
        """Steps until the end, a signal or too many non-finite steps in a row; each step's
        metrics are read while the next one runs. Returns the last step and eval loss.

        Step time (Records' tokens/s): every second of the loop belongs to one step except the
        evaluations and saves. A step's time runs from where the previous one's ended to this
        step's dispatch; while steps are queued on the device that is one step's work. Before
        an eval or a save, after the last untimed (compiling) step and at the end, the loop
        waits for the step's result first and takes the time then, so the device's work in
        flight is counted to its step and never hidden in the eval or save that waits for it."""
        r, steps = self.r, self.steps
        step, pending, eval_loss, t_last = self.start, None, None, time.perf_counter()
        max_skips = self.cfg.precision.max_consecutive_skips
        # the last PROFILED_STEPS steps, after compilation where the run has enough steps
        trace_from = max(self.start, self.end - PROFILED_STEPS, min(rec.first_timed,
                                                                   self.end - 1)) \
            if r.profile else None
        while step < self.end and stop.requested is None and rec.skips_in_a_row <= max_skips:
            if step == trace_from:  # the last steps, compiled: a profile of the steady state
                jax.profiler.start_trace(r.profile, create_perfetto_trace=True)
            self.state, metrics = self.train_step(self.state, self.batches.at(self.position),
                                                  *self.frozen)
            step, self.position = step + 1, self.position + self.batches.grad_accum
            due_eval = step == steps or (r.eval_every and step % r.eval_every == 0)
            due_save = r.save_every and step % r.save_every == 0 and step < steps
            if due_eval or due_save or step == rec.first_timed - 1 or step == self.end:
                jax.block_until_ready(metrics)  # the step's time ends with its result
            now = time.perf_counter()
            if pending is not None:  # read the previous step's metrics while this one runs
                rec.record(*pending)
            pending, t_last = (step, metrics, now - t_last), now
            rec.bar.update(1)
            saves.written(saves.ckpt.poll())  # a background write committed: its time, no waiting
            if due_eval or due_save:
                paused = time.perf_counter()
                if due_eval:
                    eval_loss = self.evaluate()
                pause = saves.save(self.state, step) if due_save else None
                t_last += time.perf_counter() - paused  # eval and saving are not step time
                rec.record(*pending, evaluated=eval_loss if due_eval else None, save_pause=pause)
                pending = None
        if pending is not None:  # the last step (end, --stop-at, signal, skip limit): to its result
            jax.block_until_ready(pending[1])
            rec.record(*pending[:2], pending[2] + time.perf_counter() - t_last)
        if trace_from is not None and step > trace_from:
            jax.profiler.stop_trace()
            Path(r.profile, PROFILE_STEPS_FILE).write_text(json.dumps(
                {"first": trace_from + 1, "last": step, "steps": step - trace_from}))
            rec.say(f"profile of steps {trace_from + 1}-{step}: {r.profile}")
        rec.bar.close()
        return step, eval_loss

    def too_many_skips(self, rec: Records, saves: _Saves) -> int:
        max_skips = self.cfg.precision.max_consecutive_skips
        rec.close()
        saves.ckpt.close()
        print(f"error: {rec.skips_in_a_row} non-finite steps in a row (more than "
              f"--max-consecutive-skips {max_skips}); loss scale now "
              f"{float(self.par.host(self.state.loss_scale.loss_scale)):g}. Nothing was saved "
              f"for these steps; the newest checkpoint in {self.s.out / CKPT_DIR} is untouched.",
              file=sys.stderr)
        return 1


def train(s: Setup) -> int:
    """Run the loop for a validated `Setup` (jaxmem.train.cli.setup); returns the exit status."""
    par = s.placement or Placement.single()  # one device, or a mesh (jaxmem.parallel)
    run = _Run(s, par)
    compiled = run.compiled()
    refusal = run.refusal(compiled)  # before anything is written: the run directory stays as it was
    if refusal:
        if s.ckpt is not None:
            s.ckpt.close()
        print(refusal, file=sys.stderr, flush=True)
        return 2
    ckpt = _prepare(s, par, run.start)
    save_tables(s, run.reference, par)
    if run.start >= run.end:
        ckpt.close()
        print(f"{s.out}: already at step {run.start} of {run.steps}"
              + (f" (--stop-at {run.r.stop_at})" if run.end < run.steps else "") + "; nothing to do")
        return 0
    rec = Records(s, par, run.start, run.end, int(run.state.skips_in_a_row),
                  state_peak=run.state_peak)
    saves = _Saves(ckpt, s.cfg, run.start if run.resumed else None)
    rec.say(_banner(s, run.state, run.start, run.resumed, rec.device), flush=True)
    predicted = _predicted(s, compiled, run.end - run.start)
    if predicted:
        rec.say(predicted, flush=True)
    t_start = time.perf_counter()
    with _Stop() as stop:
        step, eval_loss = run.loop(rec, saves, stop)
        if rec.skips_in_a_row > s.cfg.precision.max_consecutive_skips:
            return run.too_many_skips(rec, saves)
        saves.save(run.state, step)
        saves.finish(rec.say)
        ckpt.close()
    rec.close()
    if stop.requested or step < run.steps:
        why = stop.requested or f"--stop-at {run.r.stop_at}"
        rec.say(f"{why}: saved step {step} to {s.out / CKPT_DIR}; continue with --resume")
        return 0
    if eval_loss is None:
        eval_loss = run.evaluate()
    rec.say(_done_line(s, rec, step, eval_loss, time.perf_counter() - t_start))
    if s.cfg.sample.max_new_tokens and jax.process_count() == 1:  # sharded params: one process
        _sample(s, run.state)
    return 0


def _done_line(s, rec: Records, step: int, eval_loss: float | None, wall_s: float) -> str:
    tps = rec.tokens_per_sec()
    mem = device_memory(rec.device)
    mfu = rec.mfu(tps)
    if isinstance(eval_loss, tuple):  # a preference objective: its accuracy and margin
        loss, extra = eval_loss
        ev = f"eval loss {loss:.4f}" + "".join(f", eval {k} {extra[k]:.4g}" for k in (
            "rewards/accuracies", "rewards/margins") if k in extra)
    else:
        ev = "eval loss n/a" if eval_loss is None else f"eval loss {eval_loss:.4f}" + "".join(
            f", {k[5:].replace('_', ' ')} {v:.4g}"
            for k, v in eval_metrics(eval_loss, s.tokenizer.name == "bytes").items())
    return (f"done: step {step}, train loss {rec.last.get('loss', float('nan')):.4f}, {ev}, "
            f"{f'{tps:,.0f}' if tps else 'n/a'} tokens/s, "
            f"MFU {'n/a' if mfu is None else f'{100 * mfu:.1f}%'}, "
            f"peak memory {fmt_bytes(mem and mem['peak_bytes_in_use'])}"
            + (f" ({fmt_bytes(rec.state_peak)} once the state was made)" if rec.state_peak else "")
            + f", wall {wall_s:.0f} s")


def _sample(s, state) -> None:
    """The end-of-training sample: `--prompt`, else the eval data's first line, continued."""
    sm, step_cfg = s.cfg.sample, s.step_cfg
    params, _ = step_cfg.trainable.model_params(state.params, s.frozen, None)
    ev_tokens = (s.eval_tokens.examples.tokens if isinstance(s.eval_tokens, PackedData)
                 else np.concatenate(s.eval_tokens.prompt[:1] or [np.zeros(0, np.int32)])
                 if isinstance(s.eval_tokens, PreferencePairs)  # the first prompt
                 else s.eval_tokens)
    prompt = sm.prompt if sm.prompt is not None else eval_prompt(ev_tokens, s.tokenizer)
    try:
        sample = generate_text(s.model_cfg, params, s.tokenizer, prompt=prompt,
                               max_new_tokens=sm.max_new_tokens, temperature=sm.temperature,
                               top_k=sm.top_k, seed=s.cfg.data.seed, note=print,
                               compute_dtype=sample_dtype(sm.dtype, step_cfg.precision.compute_dtype),
                               eos_ids=eos_ids(s.tokenizer),
                               stop=(sm.stop,) if sm.stop else ())
    except ValueError as e:  # a --prompt longer than the model's context: the run is saved
        print(f"sample skipped: {e}")
    else:
        print(f"sample (prompt {prompt!r}"
              + (", from the eval data" if sm.prompt is None else "") + "):\n" + sample)
