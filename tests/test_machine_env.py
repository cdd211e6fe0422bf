"""What the suite's environment does by machine (tests/testenv.py, experiments/common/cpu_isa.py).

- torch's oneDNN ISA cap on a CPU that advertises AMX but dies using it: the probe's child is
  replaced by one that kills itself with SIGILL unless capped (no torch needed, ~0.1 s a child);
  one test runs the real probe where torch is installed.
- JAX's CUDA plugin on a machine without an NVIDIA GPU (the gpu-plan extra): CPU-only.
"""

import os
import signal

import pytest

from experiments.common import cpu_isa
from experiments.gpu_check.table import isa_lines

# What the Xeon VM did: SIGILL in oneDNN's AMX bf16 kernel unless ONEDNN_MAX_CPU_ISA caps it.
DIES_ON_AMX = ("import os, signal\n"
               f"if os.environ.get({cpu_isa.VAR!r}) != {cpu_isa.CAP!r}:\n"
               "    os.kill(os.getpid(), signal.SIGILL)\n")
ALWAYS_DIES = "import os, signal; os.kill(os.getpid(), signal.SIGILL)"


@pytest.fixture
def amx(tmp_path):
    p = tmp_path / "cpuinfo"
    p.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n")
    return p


def test_sigill_on_amx_sets_the_cap(amx):
    got = cpu_isa.decide({}, probe=DIES_ON_AMX, cpuinfo=amx, torch_installed=True)
    assert got.env == {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}
    assert "SIGILL" in got.reason and got.as_record()["set"] == "AVX512_CORE_BF16"
    assert isa_lines({"cpu_isa": got.as_record()}) == [
        f"torch ran with ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16: {got.reason}.", ""]


def test_no_cap_without_cause(amx, tmp_path):
    no_amx = tmp_path / "plain"
    no_amx.write_text("flags\t\t: fpu avx2 avx512f avx512_bf16\n")
    kw = dict(probe=DIES_ON_AMX, torch_installed=True)
    cases = {  # each reason says why no probe ran, or what it found
        "already set": cpu_isa.decide({"ONEDNN_MAX_CPU_ISA": "AVX2"}, cpuinfo=amx, **kw),
        "no AMX": cpu_isa.decide({}, cpuinfo=no_amx, **kw),
        "not installed": cpu_isa.decide({}, probe=DIES_ON_AMX, cpuinfo=amx,
                                        torch_installed=False),
        "exited 0": cpu_isa.decide({}, probe="pass", cpuinfo=amx, torch_installed=True),
        "too": cpu_isa.decide({}, probe=ALWAYS_DIES, cpuinfo=amx, torch_installed=True),
        "parent": cpu_isa.decide({cpu_isa.PROBED_VAR: "ok"}, cpuinfo=amx, **kw),
    }
    for word, got in cases.items():
        assert got.value is None and word in got.reason, (word, got)
    assert cases["exited 0"].env == {cpu_isa.PROBED_VAR: "ok"}  # children do not probe again
    assert isa_lines({"cpu_isa": cases["no AMX"].as_record()}) == [] == isa_lines({})


def test_the_cap_reaches_the_suite_and_the_torch_workers(monkeypatch):
    """testenv, gpu_check's rows and compare's torch workers take cap_env; a user's value wins."""
    import testenv
    from experiments.gpu_check import driver as gpu_check

    capped = cpu_isa.IsaCap({cpu_isa.VAR: cpu_isa.CAP}, "test")
    monkeypatch.setattr(cpu_isa, "_CACHED", capped)
    monkeypatch.delenv(cpu_isa.VAR, raising=False)
    assert testenv.with_test_env({})[cpu_isa.VAR] == cpu_isa.CAP
    assert testenv.subprocess_env()[cpu_isa.VAR] == cpu_isa.CAP
    assert gpu_check.child_env(cpu_only=True)[cpu_isa.VAR] == cpu_isa.CAP
    assert testenv.with_test_env({cpu_isa.VAR: "AVX2"})[cpu_isa.VAR] == "AVX2"
    assert cpu_isa.cap_env({cpu_isa.VAR: "AVX2"}) == {}


def test_compare_torch_worker_gets_the_cap(monkeypatch):
    from experiments.compare import driver as compare

    seen = {}

    def fake_run(cmd, env, **kw):
        seen[cmd[-1]] = env
        raise compare.subprocess.TimeoutExpired(cmd, 0)

    monkeypatch.setattr(cpu_isa, "_CACHED", cpu_isa.IsaCap({cpu_isa.VAR: cpu_isa.CAP}, "test"))
    monkeypatch.delenv(cpu_isa.VAR, raising=False)
    monkeypatch.setattr(compare.subprocess, "run", fake_run)
    for fw in ("torch", "jax"):
        compare.run_in_subprocess({"framework": fw}, 1)
    envs = {json_spec.split('"framework": "')[1].split('"')[0]: env
            for json_spec, env in seen.items()}
    assert envs["torch"][cpu_isa.VAR] == cpu_isa.CAP and cpu_isa.VAR not in envs["jax"]


@pytest.mark.torch
def test_the_real_probe_runs_a_bf16_matmul():
    """The probe's own code with this machine's torch: it runs (exit 0) unless this CPU is one
    the cap is for, and then it runs with the cap."""
    env = {k: v for k, v in os.environ.items() if k != cpu_isa.VAR}
    rc = cpu_isa._probe(cpu_isa.PROBE, env, 120)
    if cpu_isa.advertises_amx() and rc is not None and rc < 0:
        assert rc == -signal.SIGILL
        assert cpu_isa._probe(cpu_isa.PROBE, {**env, cpu_isa.VAR: cpu_isa.CAP}, 120) == 0
    else:
        assert rc == 0


@pytest.mark.parametrize("plugins, gpu, user, want_platforms, want_fast", [
    ((), False, None, None, True),  # plain CPU machine: nothing to pin
    (("cuda",), False, None, "cpu", True),  # gpu-plan on a CPU machine: CPU-only, fast flag kept
    (("cuda",), False, "cuda", "cuda", False),  # the user's JAX_PLATFORMS wins
    (("cuda",), True, None, None, False),  # a GPU machine: unchanged
    (("cuda", "other"), False, None, None, False),  # a ROCm/TPU plugin: unchanged
])
def test_a_cuda_plugin_without_an_nvidia_gpu_is_cpu_only(monkeypatch, plugins, gpu, user,
                                                         want_platforms, want_fast):
    import testenv

    groups = {testenv.CUDA_PLUGINS: "cuda" in plugins, testenv.OTHER_PLUGINS: "other" in plugins,
              testenv.CUDA_PLUGINS + testenv.OTHER_PLUGINS: bool(plugins)}
    monkeypatch.setattr(testenv, "_installed", lambda names: groups[tuple(names)])
    monkeypatch.setattr(testenv, "_nvidia_gpu_present", lambda: gpu)
    env = testenv.with_test_env({} if user is None else {"JAX_PLATFORMS": user})
    assert env.get("JAX_PLATFORMS") == want_platforms
    assert (testenv.CPU_FAST_COMPILE_FLAG in env["XLA_FLAGS"].split()) == want_fast
