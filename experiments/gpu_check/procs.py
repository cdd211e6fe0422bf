"""The subprocesses of experiments.gpu_check: every row's environment (`child_env`), one
command run in its own process group with a time limit (`run`), and the line that says what
went wrong (`error_line`). Nothing here imports jax."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from experiments.common import cpu_isa
from experiments.gpu_check.rows import ROOT


def child_env(cpu_only: bool = False, **extra) -> dict:
    """The environment of every row: this checkout first on PYTHONPATH (no install needed), no
    preallocation (the peak is what the process used, and the planner's background compile
    never takes 75% of the GPU); `cpu_only` (--smoke, the background plans): no GPU at all, so
    --smoke checks the same thing on a GPU machine as on a CPU one; torch's oneDNN kept off AMX
    where the CPU advertises it but dies using it (experiments/common/cpu_isa.py)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
        XLA_PYTHON_CLIENT_PREALLOCATE="false")
    env.update(cpu_isa.cap_env(env))
    if cpu_only:
        env.update(JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="")
    env.update(extra)
    return env


def run(cmd: list[str], log: Path, timeout: float, env: dict, stdout: Path | None = None) -> dict:
    """Run `cmd` in its own process group, stdout (or to `stdout`) + stderr to `log`; kill the
    group at `timeout`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "w") as f, open(stdout or os.devnull, "w") as so:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=so if stdout else f,
                             stderr=subprocess.STDOUT if stdout is None else f,
                             start_new_session=True)
        try:
            rc, timed_out = p.wait(timeout=timeout), False
        except subprocess.TimeoutExpired:
            for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, None)):
                try:
                    os.killpg(p.pid, sig)  # the row's own process group (pytest -n workers too)
                    p.wait(timeout=wait)
                    break
                except (subprocess.TimeoutExpired, ProcessLookupError):
                    continue
            rc, timed_out = p.returncode, True
    text = log.read_text(errors="replace")
    return {"rc": rc, "timed_out": timed_out, "seconds": time.perf_counter() - t0, "text": text}


def error_line(res: dict, timeout: float) -> str:
    """The line that says what went wrong: the last error-looking line, else the last line."""
    if res["timed_out"]:
        return f"timed out after {timeout:.0f} s"
    lines = [ln.strip() for ln in res["text"].splitlines() if ln.strip()]
    errs = [ln for ln in lines if any(w in ln for w in ("Error", "error:", "RESOURCE_EXHAUSTED",
                                                        "out of memory", "Exception"))]
    return f"exit {res['rc']}: " + ((errs or lines or ["(no output)"])[-1])[:400]
