"""What a training run reports while it runs: plain log lines, eval perplexity, TensorBoard, W&B.

    trackers = Trackers.open(out, cfg, tokenizer, total_steps)   # in the loop, before step 1
    rec = trackers.with_eval_metrics(rec)    # adds eval_perplexity (and eval_bits_per_byte)
    trackers.log(rec, eta_s=..., memory=...) # one metrics record: console line, TB, W&B
    trackers.close()

metrics.jsonl stays the record of a run (jaxmem.train.rundir); everything here is a view of the same
records, so a TensorBoard scalar equals the metrics.jsonl value of the same step and key.

- Plain lines: when the progress bar is off (`--no-progress`, or stdout is not a terminal, as in
  a batch job writing a log file) one line per logged step (`--log-every`), so a log file gets
  readable lines instead of a redrawn bar's carriage returns.
- TensorBoard (`tensorboard/` in the run directory; on when `tensorboardX` is installed, off with
  `--no-tensorboard`). tensorboardX, not `torch.utils.tensorboard` or `tf.summary`: it writes the
  same event files with only numpy and protobuf, where the other two need PyTorch or TensorFlow;
  it is what MaxText writes with. An optional extra (`pip install -e '.[tensorboard]'`).
- Weights & Biases when `--wandb-project` is given (`pip install -e '.[wandb]'`); its files go to
  `<run>/wandb/`; `WANDB_MODE=offline` keeps them local (`wandb sync` uploads them later).
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

# metrics.jsonl keys written to TensorBoard / W&B, under these tags
TAGS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
        "loss_scale": "train/loss_scale", "skipped": "train/skipped",
        "tokens_per_sec": "perf/tokens_per_sec", "eval_loss": "eval/loss",
        "eval_perplexity": "eval/perplexity", "eval_bits_per_byte": "eval/bits_per_byte"}


def plain_progress(no_progress: bool, stream=None) -> bool:
    """True when the loop prints plain log lines instead of a progress bar."""
    stream = stream or sys.stdout
    return no_progress or not (hasattr(stream, "isatty") and stream.isatty())


def eval_metrics(eval_loss: float, byte_level: bool) -> dict:
    """Perplexity exp(loss) and, for the byte tokenizer, bits per byte = loss / ln 2.

    Byte-level ids are one byte each (BOS/EOS count as tokens too, a small bias on short
    documents), so nats per token / ln 2 is bits per byte. For another tokenizer bits per byte
    needs the bytes per token of the eval text, which the eval batches do not keep: not reported.
    """
    out = {"eval_perplexity": math.exp(eval_loss) if eval_loss < 700 else float("inf")}
    if byte_level:
        out["eval_bits_per_byte"] = eval_loss / math.log(2)
    return out


def _eta(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def format_line(rec: dict, total_steps: int, eta_s: float | None = None,
                memory_bytes: int | None = None) -> str:
    """One plain log line for a metrics record."""
    parts = [f"step {rec['step']}/{total_steps}", f"loss {rec['loss']:.4f}", f"lr {rec['lr']:.3g}",
             f"grad norm {rec['grad_norm']:.3g}", f"scale {rec['loss_scale']:g}"]
    if rec.get("skipped"):
        parts.append("SKIPPED (non-finite)")
    tps = rec.get("tokens_per_sec")
    parts.append(f"{tps:,.0f} tok/s" if tps else "tok/s n/a")
    if memory_bytes is not None:
        parts.append(f"mem {memory_bytes / 2**30:.2f} GiB")
    if "rewards/accuracies" in rec:  # a preference objective's step
        parts.append(f"acc {rec['rewards/accuracies']:.3f} margin {rec['rewards/margins']:.3g}")
    if "eval_loss" in rec and rec["eval_loss"] is not None:
        ev = f"eval loss {rec['eval_loss']:.4f}"
        if "eval_perplexity" in rec:
            ev += f" ppl {rec['eval_perplexity']:.3g}"
        if "eval_bits_per_byte" in rec:
            ev += f" bpb {rec['eval_bits_per_byte']:.3f}"
        if "eval_rewards/accuracies" in rec:
            ev += (f" acc {rec['eval_rewards/accuracies']:.3f} margin "
                   f"{rec['eval_rewards/margins']:.3g}")
        parts.append(ev)
    parts.append(f"ETA {_eta(eta_s)}")
    return " | ".join(parts)


class Trackers:
    """The console lines, TensorBoard writer and W&B run of one training process."""

    def __init__(self, total_steps: int, byte_level: bool, plain: bool, tb=None, wandb_run=None,
                 stream=None):
        self.total_steps, self.byte_level, self.plain = total_steps, byte_level, plain
        self.tb, self.wandb_run = tb, wandb_run
        self.stream = stream or sys.stdout

    @classmethod
    def open(cls, out: Path, cfg, tokenizer, total_steps: int, start_step: int = 0,
             notes=None) -> "Trackers":
        """Trackers for the run in `out`; `notes(msg)` gets one line for each tracker skipped.

        start_step: the step the run continues from; TensorBoard drops the events an earlier
        process wrote after it (those steps are redone, as metrics.jsonl is truncated).
        """
        r = cfg.run
        notes = notes or (lambda m: print(m, file=sys.stderr))
        tb = None
        if not r.no_tensorboard:
            try:
                from tensorboardX import SummaryWriter  # noqa: PLC0415 (optional extra)
            except ImportError:
                pass  # on by default only where installed: nothing to say
            else:
                # tensorboardX names event files by the second: a run continued within the
                # same second would reopen (and truncate) the first file; the nanosecond suffix
                # keeps every file and sorts them in order for TensorBoard's directory reader
                tb = SummaryWriter(logdir=str(Path(out) / "tensorboard"), flush_secs=10,
                                   purge_step=start_step + 1 if start_step else None,
                                   filename_suffix=f".{time.time_ns()}")
        run = None
        if r.wandb_project:
            try:
                import wandb  # noqa: PLC0415 (optional extra)
            except ImportError:
                notes("note: --wandb-project given but wandb is not installed "
                      "(pip install -e '.[wandb]'); not logging to W&B")
            else:
                run = wandb.init(project=r.wandb_project, dir=str(out), name=Path(out).name,
                                 config=cfg.to_dict(), resume="allow",
                                 id=_wandb_id(out))
        return cls(total_steps, getattr(tokenizer, "name", "") == "bytes",
                   plain_progress(r.no_progress), tb, run)

    def with_eval_metrics(self, rec: dict) -> dict:
        if rec.get("eval_loss") is not None:
            rec.update(eval_metrics(rec["eval_loss"], self.byte_level))
        return rec

    def log(self, rec: dict, eta_s: float | None = None, memory_bytes: int | None = None) -> None:
        """One logged metrics record (the same dict written to metrics.jsonl)."""
        step = int(rec["step"])
        scalars = {TAGS[k]: float(v) for k, v in rec.items() if k in TAGS and v is not None}
        if self.tb is not None:
            for tag, value in scalars.items():
                self.tb.add_scalar(tag, value, step)
            self.tb.flush()  # on disk with metrics.jsonl: a crash loses no logged step
        if self.wandb_run is not None:
            self.wandb_run.log(scalars, step=step)
        if self.plain:
            print(format_line(rec, self.total_steps, eta_s, memory_bytes), file=self.stream,
                  flush=True)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None


def _wandb_id(out) -> str:
    """A W&B run id kept in the run directory, so a resumed run logs into the same W&B run."""
    import secrets  # noqa: PLC0415

    path = Path(out) / "wandb_id.txt"
    if path.exists():
        return path.read_text().strip()
    run_id = secrets.token_hex(8)
    path.write_text(run_id + "\n")
    return run_id
