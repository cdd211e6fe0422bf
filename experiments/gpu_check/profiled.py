"""`experiments.gpu_check --profile`: a train row's jax.profiler trace against the time model on
the program the row ran (its optimized HLO, dumped by XLA), per kernel class and per kernel.
Reads text files only: the driver never imports jax."""

from __future__ import annotations

import json
from pathlib import Path

from experiments.gpu_check.rows import Row


def profile_row(row: Row, run_dir: Path, out: Path, card: str) -> dict:
    """The row's profile against the time model on the program it ran (jaxmem.xla.profile):
    DIR/ROW.profile.md and .json; {"error": ...} where the trace or the HLO is missing. Reads
    text files only: this process never imports jax."""
    from jaxmem.target._cards import CARDS  # noqa: PLC0415 (plain data)
    from jaxmem.xla import profile  # noqa: PLC0415 (text readers: no jax)
    from jaxmem.xla.timing import Machine, step_time  # noqa: PLC0415
    hlo = sorted(p for p in (run_dir / "hlo").glob("*train_step*after_optimizations.txt"))
    try:
        measured = profile.kernel_times(run_dir / "profile")
    except FileNotFoundError as e:
        return {"error": str(e)}
    if not hlo:
        return {"error": f"no optimized HLO of the train step under {run_dir / 'hlo'}"}
    predicted = step_time(hlo[-1].read_text(), Machine.of_card(CARDS[card]))
    done = run_dir / "profile" / "profiled_steps.json"  # jaxmem.train.loop.PROFILE_STEPS_FILE
    steps = json.loads(done.read_text())["steps"] if done.is_file() else 3
    classes = profile.by_class(measured, predicted, steps)
    top = profile.costliest(measured, predicted, steps, 30)
    text = (f"# {row.name}: measured (jax.profiler, {steps} steps) against predicted "
            f"(jaxmem.xla.timing on the program it ran, card {card})\n\n"
            f"predicted step {predicted.seconds:.4f} s\n\n" + profile.markdown(classes, top))
    (out / f"{row.name}.profile.md").write_text(text + "\n")
    doc = {"card": card, "predicted_s": predicted.seconds, "by_class": classes, "costliest": top}
    (out / f"{row.name}.profile.json").write_text(json.dumps(doc, indent=2))
    return {"predicted_s": predicted.seconds, "by_class": classes}
