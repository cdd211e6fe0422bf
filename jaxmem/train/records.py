"""The host side of a run's finished steps (`Records`, used by jaxmem.train.loop): the progress
bar, metrics.jsonl, the trackers (TensorBoard, W&B, console lines), throughput and MFU, and the
count of non-finite steps in a row as the last step's metrics report it."""

from __future__ import annotations

import json
import os
import sys

import jax

from jaxmem.perf import device_memory, peak_flops
from jaxmem.train.placement import Placement
from jaxmem.train.run import step_tokens
from jaxmem.train.rundir import METRICS_FILE, truncate_metrics
from jaxmem.train.trackers import Trackers
from jaxmem.families.params import model_flops


# the train step's own metrics (jaxmem.train.step); any other key is the objective's
STEP_METRICS = ("loss", "lr", "grad_norm", "loss_scale", "skipped", "tokens", "skips_in_a_row")


def fmt_bytes(n) -> str:
    """Bytes as 'x.xx GiB' ('n/a' for None)."""
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB"


class Records:
    """The host side of finished steps: the progress bar, metrics.jsonl, the trackers
    (TensorBoard, W&B, console), throughput and MFU, and the count of non-finite steps in a row
    as the last step's metrics report it. Process 0 writes; the others only count."""

    def __init__(self, s, par: Placement, start: int, end: int, skips_in_a_row: int,
                 state_peak: int | None = None):
        """state_peak: the device's peak once the state was made or restored (GPU; else None),
        written beside each record's process peak."""
        from tqdm import tqdm

        cfg, d = s.cfg, s.cfg.data
        self.par, self.start, self.end, self.steps = par, start, end, cfg.optim.total_steps
        self.log_every = cfg.run.log_every
        self.main = par.is_main
        self.say = print if self.main else (lambda *a, **k: None)
        if self.main:
            truncate_metrics(s.out, start)  # records after the checkpoint are about to be redone
        self.file = open(s.out / METRICS_FILE if self.main else os.devnull, "a")
        # other processes of a multi-process run log nothing (no TensorBoard, W&B or console)
        self.trackers = (Trackers.open(s.out, cfg, s.tokenizer, self.steps, start_step=start)
                         if self.main else Trackers(self.steps, False, plain=False))
        self.bar = tqdm(total=self.steps, initial=start, unit="step", file=sys.stdout,
                        disable=self.trackers.plain or not self.main, dynamic_ncols=True)
        self.device = jax.devices()[0]
        self.peak = peak_flops(self.device, s.step_cfg.precision.compute_dtype)
        self.flops_per_token = model_flops(s.model_cfg, d.seq_len)
        self.tokens_per_step = step_tokens(s.cfg, s.step_cfg)
        # a process's first two steps include compilation: not timed (the loop waits for the
        # second's result, so the first timed step starts with the device idle)
        self.first_timed = start + 3
        self.timed_steps, self.seconds = 0, 0.0
        self.skips_in_a_row, self.last = skips_in_a_row, {}
        self.state_peak = state_peak

    def tokens_per_sec(self) -> float:
        """Tokens trained per second of the timed steps' time (jaxmem.train.loop: the loop's
        wall time less evaluations and saves, each step timed up to its result on the device
        wherever the loop waits for one)."""
        return self.tokens_per_step * self.timed_steps / self.seconds if self.seconds else 0.0

    def mfu(self, tokens_per_sec: float) -> float | None:
        return tokens_per_sec * self.flops_per_token / self.peak if self.peak and tokens_per_sec else None

    def record(self, step, metrics, seconds, evaluated=None, save_pause=None) -> dict:
        """A finished step: its metrics read from the device, the bar, and (every --log-every
        steps, on evaluation, saves and skipped steps) a metrics.jsonl line and the trackers.
        seconds: the step's share of the loop's time (jaxmem.train.loop._Run.loop)."""
        m = {k: float(v) for k, v in self.par.host(metrics).items()}
        if step >= self.first_timed:
            self.timed_steps += 1
            self.seconds += seconds
        self.skips_in_a_row = int(m["skips_in_a_row"])
        rec = {"step": step, "loss": m["loss"], "lr": m["lr"], "grad_norm": m["grad_norm"],
               "loss_scale": m["loss_scale"], "skipped": bool(m["skipped"]),
               "tokens_per_sec": self.tokens_per_sec()}
        # the objective's own metrics (a preference objective's rewards/..., logps/...)
        rec.update({k: v for k, v in m.items() if k not in STEP_METRICS})
        if evaluated is not None:
            if isinstance(evaluated, tuple):  # a preference objective: its metrics, no perplexity
                loss, extra = evaluated
                rec.update(eval_loss=loss, **{f"eval_{k}": v for k, v in extra.items()})
            else:
                rec = self.trackers.with_eval_metrics({**rec, "eval_loss": evaluated})
        if save_pause is not None:
            rec["save_pause_s"] = round(save_pause, 4)
        mem = device_memory(self.device)
        if self.mfu(rec["tokens_per_sec"]) is not None:  # GPU: the end-of-run line's MFU, per record
            rec["mfu"] = self.mfu(rec["tokens_per_sec"])
        if mem:  # the process's peak so far (experiments.gpu_check reads it from the record)
            rec["peak_bytes_in_use"] = mem["peak_bytes_in_use"]
        if self.state_peak is not None:  # and what it was once the state existed
            rec["state_peak_bytes_in_use"] = self.state_peak
        # a skipped (non-finite) step is always recorded: plots and audits count them
        if (step % self.log_every == 0 or step == self.steps or evaluated is not None
                or rec["skipped"] or save_pause is not None):
            self._log(rec, step, mem)
        self.bar.set_postfix(loss=f"{m['loss']:.3f}", tok_s=f"{self.tokens_per_sec():,.0f}",
                             scale=f"{m['loss_scale']:g}",
                             **({"mem": fmt_bytes(mem["bytes_in_use"])} if mem else {}),
                             refresh=False)
        self.last = rec
        return rec

    def _log(self, rec: dict, step: int, mem) -> None:
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()
        rate = self.seconds / self.timed_steps if self.timed_steps else None
        self.trackers.log(rec, eta_s=rate and rate * (self.end - step),
                          memory_bytes=mem and mem["bytes_in_use"])

    def close(self) -> None:
        self.file.close()
        self.trackers.close()
