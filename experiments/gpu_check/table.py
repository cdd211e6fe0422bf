"""experiments.gpu_check's two files: gpu_check.json (everything, as measured) and gpu_check.md
(the table), both replaced atomically whenever a row or a plan finishes; and the machine's
description at their top (without importing jax, which would take the GPU)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
from pathlib import Path

GiB = 2**30
HEAD = ["row", "status", "tok/s", "MFU", "peak (measured)", "plan: analytic", "plan: compiled",
        "measured / compiled", "s", "notes"]


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _gib(x) -> str:
    if x is None:
        return "n/a"
    return f"{x / GiB:.2f} GiB" if x >= GiB else f"{x / 2**20:.2f} MiB"  # --smoke: tiny


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def row_cells(r: dict) -> list[str]:
    plan = r.get("plan") or {}
    status = r["status"]
    note = r.get("why") if status == "skipped" else r.get("error") if status == "FAILED" else None
    notes = [f"{r['what']}"] + ([note] if note else []) + ([r["note"]] if r.get("note") else [])
    if plan.get("error"):
        notes.append(f"plan failed: {plan['error']}")
    tps, mfu, peak = r.get("tokens_per_s"), r.get("mfu"), r.get("peak_bytes")
    compiled = plan.get("compiled_bytes")
    where = f" ({plan['where']}" + (f"; {plan['largest_phase']}" if plan.get("largest_phase")
                                    else "") + ")" if plan.get("where") and not plan.get("error") else ""
    pending = "pending" if r.get("kind") == "train" and "plan" not in r else "n/a"
    return [r["name"], status, "n/a" if tps is None else f"{tps:,.0f}",
            "n/a" if mfu is None else f"{100 * mfu:.1f}%",
            _gib(peak) + (f" (state {_gib(r['state_peak_bytes'])})"
                          if peak and r.get("state_peak_bytes") else ""),
            _gib(plan.get("analytic_bytes")) if plan else pending,
            _gib(compiled) + where if compiled else (pending if not plan else "n/a"),
            f"{peak / compiled:.2f}" if peak and compiled else "n/a",
            f"{r['seconds']:.0f}" if r.get("seconds") else "",
            "; ".join(_cell(n) for n in notes)]


def markdown(doc: dict) -> str:
    total = "running" if doc["total_s"] is None else f"{doc['total_s']:.0f} s"
    v = ", ".join(f"{k} {x}" for k, x in doc["versions"].items() if x)
    lines = [f"# gpu_check ({doc['mode']}), {doc['date']}", "",
             f"Machine: {doc['gpu'] or 'no GPU (nvidia-smi absent)'}; host {doc['host']}; "
             f"project commit {doc['commit'] or 'unknown (no git)'}; {v}. Total: {total}.",
             "Measured peak: the row process's GPU `peak_bytes_in_use` (state creation, steps and "
             "the evaluation; in brackets, the peak once the state was made); plan: "
             "`python -m jaxmem.memory --json` for the same flags "
             "(analytic total; XLA's compiled peak, compiled where named: a card's name is its own "
             "compiler run deviceless on the host, `--target`; with the run's largest compiled "
             "phase).", "",
             *isa_lines(doc),
             "| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    lines += ["| " + " | ".join(row_cells(r)) + " |" for r in doc["rows"]]
    for r in doc["rows"]:
        t = r.get("tests")
        if t and (t["failed"] or t["errors"]):
            lines += ["", f"## {r['name']}: {len(t['failed'])} failed, {len(t['errors'])} errors",
                      ""]
            lines += [f"- FAILED {name}" for name in t["failed"]]
            lines += [f"- ERROR {name}" for name in t["errors"]]
    return "\n".join(lines) + "\n"


def isa_lines(doc: dict) -> list[str]:
    """A line when torch ran under a oneDNN ISA cap (experiments/common/cpu_isa.py), else none."""
    isa = doc.get("cpu_isa") or {}
    if not isa.get("set"):
        return []
    return [f"torch ran with {isa['var']}={isa['set']}: {isa['reason']}.", ""]


def write_report(out: Path, doc: dict) -> None:
    _write(out / "gpu_check.json", json.dumps(doc, indent=1, default=str) + "\n")
    _write(out / "gpu_check.md", markdown(doc))


def gpu_name() -> str | None:
    """nvidia-smi's name and memory of GPU 0 (jax is not imported here: see the docstring)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        p = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return p.stdout.strip().splitlines()[0] if p.returncode == 0 and p.stdout.strip() else None


def commit(root: Path) -> str | None:
    try:
        p = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                           text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return p.stdout.strip() or None if p.returncode == 0 else None


def versions() -> dict:
    out = {"python": platform.python_version()}
    for name in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "torch", "transformers"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out
