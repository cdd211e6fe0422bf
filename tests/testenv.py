"""The test suite's environment, for this process and the subprocesses tests start (imported by
name, like runs.py: pytest puts tests/ on sys.path).

The suite runs on a CPU (development, CI) and on a GPU machine (`experiments.gpu_check --suite`:
`pytest -n 8` on one GPU). What differs there, and what this module pins:

- fp32 matmuls run in reduced precision (TF32) unless asked otherwise: every process of the
  suite runs with `JAX_DEFAULT_MATMUL_PRECISION=highest` (and `NVIDIA_TF32_OVERRIDE=0` for
  cuBLAS/cuDNN calls outside XLA's precision config). XLA:CPU ignores the setting: on a CPU it
  changes nothing.
- each JAX process preallocates 75% of the GPU: 8 pytest workers plus the subprocesses their
  tests start run out of memory. `XLA_PYTHON_CLIENT_PREALLOCATE=false` everywhere.
- GPU scatter-adds (the embedding gradient) use atomics, so two runs of one program may differ
  in the last bit; the bitwise resume tests compare two runs. `--xla_gpu_deterministic_ops=true`
  (an XLA flag every backend's flag parser knows; it changes nothing on a CPU).
- where JAX has only the CPU, XLA:CPU generates code at LLVM -O0 (`CPU_FAST_COMPILE_FLAG`):
  compiling is most of the suite's time; the flag changes no HLO, no buffer assignment.
- multi-device tests simulate devices on the CPU: their subprocesses must say `JAX_PLATFORMS=cpu`,
  or JAX picks the one GPU and the mesh does not fit (`subprocess_env(cpu_devices=N)`).
- a CPU machine with JAX's CUDA plugin installed (the gpu-plan extra: compiling for a GPU that
  is not there) has no NVIDIA GPU to run on (no /dev/nvidiactl, no /proc/driver/nvidia): there
  the suite sets `JAX_PLATFORMS=cpu` (unless JAX_PLATFORMS is set already), so JAX does not try
  CUDA when it starts and the machine keeps the -O0 flag below. `jaxmem.target` compiles for the
  GPU from a CPU-only JAX. A machine with an NVIDIA GPU, or a ROCm/TPU plugin, is left as it is.
- torch on a CPU that advertises AMX but may not use it (a Xeon VM: torch's oneDNN bf16 matmul
  died with SIGILL): `ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`, decided once by a probe
  (experiments/common/cpu_isa.py; only where torch is installed and the CPU advertises AMX).

`conftest.py` applies `TEST_ENV` to os.environ before JAX starts, so the pytest process (and
every worker of pytest-xdist) and anything it starts inherit it; `subprocess_env` builds the
environment for a test's own subprocess explicitly, so a test reads what its child gets.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TEST_ENV = {
    "JAX_DEFAULT_MATMUL_PRECISION": "highest",
    "NVIDIA_TF32_OVERRIDE": "0",
    "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
}
DETERMINISTIC_FLAG = "--xla_gpu_deterministic_ops=true"
# Only where JAX can take nothing but the CPU: LLVM's -O0 for XLA:CPU's generated code. The suite's
# programs are tiny and compiled once each, so compiling is most of its time; measured (2-core CPU,
# jax 0.10.2, cold cache) tests/test_lean.py::test_lean_ops_match_autodiff_fp32 took 4.7 s of CPU
# with it, 11.3 s without. HLO passes, buffer assignment and so memory_analysis() do not depend on
# it; set JAXMEM_TEST_LLVM_OPT=1 to test with XLA's default code generation.
CPU_FAST_COMPILE_FLAG = "--xla_backend_optimization_level=0"


CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_plugins.xla_cuda12",
                "jax_plugins.xla_cuda13")
OTHER_PLUGINS = ("jax_rocm60_plugin", "jax_rocm7_plugin", "libtpu")
# What the NVIDIA driver makes where there is a GPU it can use (a container given a GPU has both).
NVIDIA_DEVICE_PATHS = ("/dev/nvidiactl", "/proc/driver/nvidia")


def _installed(names) -> bool:
    import importlib.util
    for name in names:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except (ImportError, ValueError):
            pass
    return False


def _nvidia_gpu_present() -> bool:
    return any(os.path.exists(p) for p in NVIDIA_DEVICE_PATHS)


def _cpu_only_machine(env: dict) -> bool:
    """No GPU/TPU plugin for JAX is installed, or JAX is told to use the CPU."""
    if env.get("JAX_PLATFORMS", "").strip() == "cpu":
        return True
    return not _installed(CUDA_PLUGINS + OTHER_PLUGINS)


def _cuda_plugin_without_gpu() -> bool:
    """JAX's CUDA plugin is installed (gpu-plan), no ROCm/TPU plugin, and no NVIDIA GPU is here."""
    return (_installed(CUDA_PLUGINS) and not _installed(OTHER_PLUGINS)
            and not _nvidia_gpu_present())


def _onednn_cap(env: dict) -> dict:
    """ONEDNN_MAX_CPU_ISA for torch where this CPU needs it (experiments/common/cpu_isa.py),
    else {}."""
    import sys
    if str(ROOT) not in sys.path:  # a worker script started as tests/<name>.py
        sys.path.append(str(ROOT))
    from experiments.common import cpu_isa
    return cpu_isa.cap_env(env)


def with_test_env(env: dict) -> dict:
    """`env` with TEST_ENV set (overriding), JAX_PLATFORMS=cpu where a CUDA plugin has no GPU
    (unless set), the oneDNN ISA cap where torch needs it, and the test flags added to
    XLA_FLAGS."""
    env = dict(env)
    env.update(TEST_ENV)
    if not env.get("JAX_PLATFORMS") and _cuda_plugin_without_gpu():
        env["JAX_PLATFORMS"] = "cpu"
    env.update(_onednn_cap(env))
    flags = env.get("XLA_FLAGS", "").split()
    if not any(f.startswith("--xla_gpu_deterministic_ops") for f in flags):
        flags.append(DETERMINISTIC_FLAG)
    if (_cpu_only_machine(env) and env.get("JAXMEM_TEST_LLVM_OPT", "0") == "0"
            and not any(f.startswith("--xla_backend_optimization_level") for f in flags)):
        flags.append(CPU_FAST_COMPILE_FLAG)
    env["XLA_FLAGS"] = " ".join(flags)
    return env


def subprocess_env(cpu_devices: int | None = None, cpu: bool = False, **extra: str) -> dict:
    """The environment for a subprocess a test starts: this process's, with TEST_ENV, the
    checkout first on PYTHONPATH, and

    cpu_devices: N simulated CPU devices (`JAX_PLATFORMS=cpu`, `JAX_NUM_CPU_DEVICES=N`): on a
        GPU machine JAX would otherwise take the GPU, which has one device.
    cpu: `JAX_PLATFORMS=cpu` without setting a device count (one device, or the child sets it).
    extra: more variables (a value of None removes the variable).
    """
    env = with_test_env(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(
        os.pathsep) if p and p != str(ROOT)])
    env.pop("JAX_NUM_CPU_DEVICES", None)
    if cpu or cpu_devices:
        env["JAX_PLATFORMS"] = "cpu"
    if cpu_devices:
        env["JAX_NUM_CPU_DEVICES"] = str(cpu_devices)
    for k, v in extra.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def backend() -> str:
    """JAX's default backend in this process ("cpu", "gpu", "tpu")."""
    import jax
    return jax.default_backend()


def on_gpu() -> bool:
    return backend() == "gpu"


def worker_jax(devices: int):
    """In a test's worker script, before anything imports jax: `devices` simulated CPU devices
    (on a GPU machine too, where JAX would otherwise take the GPU), matmul precision highest, and
    the suite's persistent compilation cache when the parent set one (conftest). Returns jax."""
    os.environ["JAX_NUM_CPU_DEVICES"] = str(devices)
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax  # noqa: PLC0415 (after the environment above)

    jax.config.update("jax_default_matmul_precision", "highest")
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return jax


def run_worker(script: str, out, *args: str, timeout: int = 900) -> None:
    """Run tests/<script> with 8 simulated CPU devices, writing into `out`; fails the test with
    the end of its stderr when it exits non-zero."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    proc = subprocess.run([sys.executable, str(ROOT / "tests" / script), str(out), *args],
                          cwd=ROOT, env=subprocess_env(cpu_devices=8), capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
