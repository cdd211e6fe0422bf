"""oneDNN's CPU ISA cap for torch on a CPU that advertises AMX but may not use it.

A Xeon VM advertised AMX (`amx_bf16` in /proc/cpuinfo) but its hypervisor forbade it: torch
2.13's oneDNN bf16 CPU matmul died with SIGILL, taking the interpreter with it (`pytest -m torch`,
the torch rows of `experiments.gpu_check --smoke`). `ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16` keeps
oneDNN off AMX and avoided it. oneDNN reads the variable once, when torch starts, so it has to be
in the environment of every process before torch is imported.

`cap_env(environ)` decides once per process, with a probe: only where torch is installed, the CPU
advertises AMX and ONEDNN_MAX_CPU_ISA is not set already, a child Python does a tiny bf16 matmul;
if it dies of a signal (SIGILL: a negative returncode), a second child confirms that the cap
avoids it, and the cap is returned. Everything else (no torch, no AMX, the variable set by the
user, the probe passed) returns no cap, and the probe costs nothing. Users: tests/testenv.py (the
suite, its pytest workers and subprocesses), experiments.compare's workers and every row of
experiments.gpu_check (which records the decision in gpu_check.json as `cpu_isa`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

VAR = "ONEDNN_MAX_CPU_ISA"
CAP = "AVX512_CORE_BF16"  # the newest ISA below AMX (AVX-512 with bf16 instructions)
# Set in the environment once a probe passed, so the children that inherit it do not probe again.
PROBED_VAR = "JAXMEM_ONEDNN_PROBED"
PROBE = ("import torch\n"
         "a = torch.ones(64, 64, dtype=torch.bfloat16)\n"
         "assert float((a @ a).float().sum()) == 64.0 ** 3\n")
PROBE_TIMEOUT_S = 120.0


@dataclasses.dataclass(frozen=True)
class IsaCap:
    """What to add to a torch process's environment, and why."""
    env: dict  # {} or {VAR: CAP} (or {PROBED_VAR: "ok"}: probed, no cap needed)
    reason: str

    @property
    def value(self) -> str | None:
        """The cap this decision sets (None: none)."""
        return self.env.get(VAR)

    def as_record(self) -> dict:
        """For a result file: the variable, the value set (None: none) and why."""
        return {"var": VAR, "set": self.value, "reason": self.reason}


def advertises_amx(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """The CPU's flags include an AMX feature (amx_bf16, amx_tile, amx_int8, ...)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            return any(f.startswith("amx") for f in line.split(":", 1)[-1].split())
    return False


def _probe(code: str, environ: dict, timeout: float) -> int | None:
    """The returncode of `python -c code` (negative: killed by that signal; None: timed out)."""
    try:
        return subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True,
                              timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        return None


def _signal_name(rc: int) -> str:
    try:
        return signal.Signals(-rc).name
    except ValueError:
        return f"signal {-rc}"


def decide(environ: dict, *, probe: str = PROBE, cpuinfo: Path = Path("/proc/cpuinfo"),
           torch_installed: bool | None = None, timeout: float = PROBE_TIMEOUT_S) -> IsaCap:
    """The cap for processes with `environ` (no cache; `probe` is the child's code: tests
    replace it)."""
    if environ.get(VAR):
        return IsaCap({}, f"{VAR}={environ[VAR]} already set")
    if environ.get(PROBED_VAR):
        return IsaCap({}, "a parent process probed: bf16 matmul runs")
    if torch_installed is None:
        torch_installed = importlib.util.find_spec("torch") is not None
    if not torch_installed:
        return IsaCap({}, "torch is not installed")
    if not advertises_amx(cpuinfo):
        return IsaCap({}, "the CPU advertises no AMX")
    rc = _probe(probe, dict(environ), timeout)
    if rc is None:
        return IsaCap({}, f"the bf16 matmul probe timed out after {timeout:.0f} s; no cap")
    if rc >= 0:  # ran (or failed with an exception, which is not what the cap is for)
        return IsaCap({PROBED_VAR: "ok"}, f"the CPU advertises AMX; the bf16 matmul probe "
                                          f"exited {rc}: no cap")
    died = _signal_name(rc)
    rc2 = _probe(probe, {**environ, VAR: CAP}, timeout)
    if rc2 != 0:
        return IsaCap({}, f"the CPU advertises AMX; torch's bf16 matmul died of {died}, and "
                          f"with {VAR}={CAP} too (exit {rc2}): no cap")
    return IsaCap({VAR: CAP}, f"the CPU advertises AMX but torch's bf16 matmul died of {died}; "
                              f"with {VAR}={CAP} it runs")


_CACHED: IsaCap | None = None


def cap() -> IsaCap:
    """This process's decision for its own environment (probed at most once per process)."""
    global _CACHED
    if _CACHED is None:
        _CACHED = decide(dict(os.environ))
    return _CACHED


def cap_env(environ: dict | None = None) -> dict:
    """The variables to add to `environ` (default: os.environ) for a process that may start
    torch: {} unless this machine needs the cap (see the module docstring). An `environ` that
    sets ONEDNN_MAX_CPU_ISA keeps its own value."""
    environ = os.environ if environ is None else environ
    if environ.get(VAR):
        return {}
    return dict(cap().env)
