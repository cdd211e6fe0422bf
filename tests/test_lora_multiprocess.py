"""LoRA / QLoRA across processes: 2 processes x 2 simulated devices equal 1 process x 4, a
checkpoint written by 2 processes resumes on 1 device with the same losses, a mesh run's PEFT
export loads in peft with the logits of a one-device run's export, and processes whose bases
differ stop naming the odd one. Every run is a subprocess (device count and jax.distributed are
set before JAX starts); the base is a tiny fp32 Hugging Face checkpoint read shard by shard."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hf_files import peft_model_of_run, random_params, write_tokenizer
from testenv import subprocess_env

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ["--lora-rank", "4", "--quantize-base", "nf4", "--double-quant", "--batch-size", "8",
         "--seq-len", "16", "--steps", "4", "--save-every", "2", "--lr", "1e-2",
         "--warmup-steps", "1", "--sample-tokens", "0", "--no-progress", "--log-every", "1",
         "--eval-batches", "1"]


def _cfg():
    from jaxmem.families.config import ModelConfig
    return ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, max_position_embeddings=64)


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory):
    pytest.importorskip("tokenizers")
    from jaxmem.io.hf_export import save_hf

    d = tmp_path_factory.mktemp("mp_lora")
    write_tokenizer(d / "tok", "def return import class self None for in if else " * 100)
    save_hf(d / "hf", _cfg(), random_params(_cfg(), seed=7),
            tokenizer=str(d / "tok" / "tokenizer.json"), bos_token_id=0, eos_token_id=1)
    return d / "hf"


def _train(args, devices):
    return subprocess.run([sys.executable, "-m", "jaxmem.train", *args], cwd=ROOT,
                          env=subprocess_env(cpu_devices=devices, cpu=True), capture_output=True,
                          text=True, timeout=600)


def _launch(args, processes, devices):
    return subprocess.run([sys.executable, "-m", "jaxmem.launch", "--processes", str(processes),
                           "--devices-per-process", str(devices), "--", *args], cwd=ROOT,
                          env=subprocess_env(cpu=True), capture_output=True, text=True,
                          timeout=600)


def _ok(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]


def _losses(run):
    rows = [json.loads(l) for l in (Path(run) / "metrics.jsonl").read_text().splitlines()]
    return np.array([[r["step"], r["loss"]] for r in rows if "loss" in r])


@pytest.mark.slow  # four runs (three JAX start-ups with jax.distributed): ~150 s CPU on 2 cores
def test_two_processes_qlora_equal_four_devices_resume_on_one_and_export(hf_base, corpus,
                                                                         tmp_path):
    """QLoRA NF4 + double quant, fp32, tiny, fsdp=4: 2 processes x 2 devices give the losses of
    1 process x 4 devices (1e-6 relative) over 4 steps; its step-2 checkpoint (adapters and
    their AdamW state, sharded over 2 processes) resumes on 1 device and redoes steps 3-4 with
    the same losses; the 4-device run's PEFT export, loaded by peft onto the base, gives the
    logits of a one-device run's export within 1e-4."""
    base = FLAGS + ["--init-from", str(hf_base), "--data", corpus]
    four, multi, one = tmp_path / "four", tmp_path / "multi", tmp_path / "one"
    _ok(_train(base + ["--mesh", "fsdp=4", "--out", str(four)], devices=4))
    reference = _losses(four)
    np.testing.assert_array_equal(reference[:, 0], [1, 2, 3, 4])

    _ok(_launch(base + ["--mesh", "fsdp=4", "--out", str(multi)], processes=2, devices=2))
    np.testing.assert_allclose(_losses(multi), reference, rtol=1e-6)
    saved = json.loads((multi / "config.json").read_text())["peft_base"]
    assert saved["source"] == str(hf_base) and saved["quantize"] == "nf4"

    # 2 processes -> 1 device: steps 3-4 redone from the 2-process checkpoint of step 2
    _ok(_train(["--out", str(multi), "--resume", "--resume-step", "2"], devices=1))
    np.testing.assert_allclose(_losses(multi), reference, rtol=1e-6)

    _ok(_train(base + ["--out", str(one)], devices=1))
    np.testing.assert_allclose(_losses(one), reference, rtol=1e-5)

    pytest.importorskip("peft")
    torch = pytest.importorskip("torch")
    ids = torch.tensor([[0, 5, 17, 42, 99, 150, 200, 7]])
    logits = []
    for run in (four, one):
        model = peft_model_of_run(hf_base, run, tmp_path / f"peft_{run.name}")
        with torch.no_grad():
            logits.append(model(ids).logits.numpy())
    assert np.abs(logits[0]).max() > 0
    np.testing.assert_allclose(logits[0], logits[1], atol=1e-4, rtol=1e-4)


def test_differing_base_names_the_process():
    """Each process's sha256 gathered: the odd process names itself, the others name it."""
    from jaxmem.peft.slices import differing_base

    same = ["ab" * 32] * 3
    assert differing_base(same, 0) is None and differing_base(same, 2) is None
    odd = ["ab" * 32, "cd" * 32, "ab" * 32]
    assert differing_base(odd, 1).startswith("process 1: its base weights differ from process "
                                             "0's (sha256 cdcdcdcdcdcdcdcd... vs abababab")
    assert differing_base(odd, 2).startswith("process 1: its base weights differ from process "
                                             "0's") and "process 2 stops too" in differing_base(
                                                 odd, 2)


@pytest.mark.slow  # two JAX start-ups with jax.distributed: 31 s wall (12 s CPU) here
def test_process_with_another_base_stops_naming_it(hf_base, corpus, tmp_path):
    """Two processes (--coordinator, 1 device each, fsdp=2) given bases with other weights: both
    exit 2 with one error line, and both lines name process 1."""
    import socket

    from jaxmem.io.hf_export import save_hf

    other = tmp_path / "other_hf"
    save_hf(other, _cfg(), random_params(_cfg(), seed=8),
            tokenizer=str(hf_base / "tokenizer.json"), bos_token_id=0, eos_token_id=1)
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen(
        [sys.executable, "-m", "jaxmem.train", *FLAGS, "--data", corpus, "--mesh", "fsdp=2",
         "--init-from", str(hf_base if i == 0 else other), "--out", str(tmp_path / "run"),
         "--coordinator", f"localhost:{port}", "--num-processes", "2", "--process-id", str(i)],
        cwd=ROOT, env=subprocess_env(cpu_devices=1, cpu=True), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True) for i in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    for i, (p, (_, err)) in enumerate(zip(procs, results)):
        assert p.returncode == 2, err[-2000:]
        lines = [l for l in err.splitlines() if l.startswith("python -m jaxmem.train: error: ")]
        assert len(lines) == 1, err[-2000:]
        assert lines[0].startswith("python -m jaxmem.train: error: process 1: its base weights "
                                   "differ from process 0's"), lines[0]
        assert "Traceback" not in err
