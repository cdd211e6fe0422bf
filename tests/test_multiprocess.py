"""Multi-process runs (jax.distributed on CPU, gloo collectives), mesh changes across resume,
a lost peer, and bad --mesh / process flags. Every run is a subprocess: the device count and
jax.distributed must be set before JAX starts."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from runs import SMALL, error_line, losses
from testenv import subprocess_env

ROOT = Path(__file__).resolve().parents[1]
# batch 8: divisible by every mesh below; a save at step 2 of 4
FLAGS = list(SMALL) + ["--steps", "4", "--save-every", "2"]
FLAGS[FLAGS.index("--batch-size") + 1] = "8"
SLOW = pytest.mark.slow


def _env(devices=None):
    """Simulated CPU devices (JAX_PLATFORMS=cpu: on a GPU machine JAX would take the GPU)."""
    return subprocess_env(cpu_devices=devices, cpu=True)


def train(args, devices=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "jaxmem.train", *args], cwd=ROOT,
                          env=_env(devices), capture_output=True, text=True, timeout=timeout)


def launch(args, processes, devices, timeout=300):
    return subprocess.run([sys.executable, "-m", "jaxmem.launch", "--processes", str(processes),
                           "--devices-per-process", str(devices), "--", *args], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=timeout)


def _loss_curve(run):
    return np.array([(step, loss) for step, loss, *_ in losses(run)])


def _ok(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
def test_two_processes_match_one_and_resume_on_other_meshes(tmp_path, corpus):
    """2 processes x 2 devices give the per-step losses of 1 process x 4 devices (1e-5 rel);
    the 2-process run stopped at step 2 resumes in 1 process on 1 device, and a run stopped
    on 8 devices resumes on 4, both continuing with the straight run's losses (1e-5 rel)."""
    base = FLAGS + ["--data", corpus]
    straight = tmp_path / "straight4"
    _ok(train(base + ["--out", str(straight)], devices=4))
    reference = _loss_curve(straight)
    np.testing.assert_array_equal(reference[:, 0], [1, 2, 3, 4])

    multi = tmp_path / "multi"
    _ok(launch(base + ["--out", str(multi)], processes=2, devices=2))
    np.testing.assert_allclose(_loss_curve(multi), reference, rtol=1e-5)

    moved = tmp_path / "moved"  # 2 processes x 2 devices -> 1 process, 1 device
    _ok(launch(base + ["--out", str(moved), "--stop-at", "2"], processes=2, devices=2))
    assert (moved / "checkpoints" / "2").is_dir()
    _ok(train(["--out", str(moved), "--resume"], devices=1))
    np.testing.assert_allclose(_loss_curve(moved), reference, rtol=1e-5)

    shrunk = tmp_path / "shrunk"  # 8 devices -> 4 devices
    _ok(train(base + ["--out", str(shrunk), "--stop-at", "2", "--mesh", "fsdp=8"], devices=8))
    _ok(train(["--out", str(shrunk), "--resume", "--mesh", "data=2,fsdp=2"], devices=4))
    np.testing.assert_allclose(_loss_curve(shrunk), reference, rtol=1e-5)


@pytest.mark.slow
def test_killing_a_process_ends_the_other_naming_it(tmp_path, corpus):
    """SIGKILL to process 1 mid-run: process 0 exits non-zero within 60 s (JAX's coordination
    service reports task 1's missing heartbeat and aborts it), and the launcher names process 1."""
    out = tmp_path / "run"
    args = [*FLAGS[:FLAGS.index("--steps")], "--steps", "5000", "--save-every", "0",
            "--eval-every", "0", "--data", corpus, "--out", str(out)]
    launcher = subprocess.Popen([sys.executable, "-m", "jaxmem.launch", "--processes", "2",
                                 "--devices-per-process", "1", "--", *args], cwd=ROOT, env=_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert launcher.poll() is None and time.monotonic() < deadline, "run did not start"
        time.sleep(0.5)
    children = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True,
                              text=True).stdout.split()
    (victim,) = [int(c) for c in children
                 if "--process-id\x001\x00" in Path(f"/proc/{c}/cmdline").read_text() + "\x00"]
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    _, stderr = launcher.communicate(timeout=120)
    elapsed = time.monotonic() - killed
    assert launcher.returncode != 0
    assert elapsed < 60, elapsed
    lines = [l for l in stderr.splitlines() if l.startswith("jaxmem.launch: failed:")]
    assert len(lines) == 1, stderr[-3000:]
    assert f"process 1 (pid {victim}) was killed by SIGKILL" in lines[0]
    assert "then process 0" in lines[0]  # the survivor ended non-zero on its own or was ended


@pytest.mark.parametrize("args, devices, message", [
    (["--mesh", "fsdp=2"], None, "--mesh fsdp=2: the axis sizes multiply to 2, but there are 1 devices"),
    # a JAX process each; slow: the first runs by default
    pytest.param(["--mesh", "pipe=2"], None,
                 "--mesh 'pipe=2': unknown axis 'pipe' (axes: data, fsdp, tensor, context)", marks=SLOW),
    pytest.param(["--mesh", "tensor=4"], 4,
                 "--mesh tensor=4: tensor=4 does not divide the model's num_kv_heads 2", marks=SLOW),
    pytest.param(["--num-processes", "2"], None, "--num-processes needs --coordinator HOST:PORT",
                 marks=SLOW),
])
def test_bad_parallel_input_exits_2_with_one_line(tmp_path, corpus, args, devices, message):
    out = tmp_path / "run"
    proc = train(FLAGS + ["--data", corpus, "--out", str(out), *args], devices=devices)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in error_line(proc.stderr)
    assert not (out / "checkpoints").exists()
