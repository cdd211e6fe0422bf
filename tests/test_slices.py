"""The frozen LoRA base built shard by shard from a checkpoint's safetensors slices
(jaxmem.peft.slices): bitwise the one-device quantization, about 1/N of the bytes read per
process, the same sha256, and pytorch_model.bin refused."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hf_files import random_params
from testenv import subprocess_env

ROOT = Path(__file__).resolve().parents[1]


def _config():
    from jaxmem.families.config import ModelConfig
    return ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    pytest.importorskip("safetensors")
    from jaxmem.io.hf_export import save_hf
    d = tmp_path_factory.mktemp("hf") / "tiny"
    cfg = _config()
    save_hf(d, cfg, random_params(cfg, seed=3), dtype="bfloat16")
    return d


def test_one_device_base_equals_base_on_device_and_hash(hf_dir):
    """On one device (SingleDeviceSharding) NF4 + double quant from slices is bitwise the
    quantization of the whole host base, reads each tensor's bytes once, and the streamed
    sha256 is base_sha256 of the host tree."""
    import jax

    from jaxmem.peft.slices import HFSlices, abstract_base, sharded_base, streamed_sha256
    from jaxmem.peft.base import base_on_device, base_on_host, base_sha256
    from jaxmem.peft.lora import LoraSpec

    cfg, spec = _config(), LoraSpec(4, quantize="nf4", double_quant=True)
    _, host = base_on_host(cfg, 0, str(hf_dir))
    source = HFSlices(hf_dir)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = abstract_base(cfg, spec, np.float32, source.dtype)
    got = sharded_base(source, cfg, spec, np.float32, jax.tree.map(lambda _: one, abstract))
    ref = base_on_device(host, spec, np.float32)
    for r, g in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
        assert g.dtype == r.dtype
        np.testing.assert_array_equal(np.asarray(g), np.asarray(r))
    total = sum(np.asarray(a).nbytes for a in jax.tree.leaves(host))
    assert source.bytes_read == total
    assert streamed_sha256(HFSlices(hf_dir), cfg) == base_sha256(host)


def test_pickle_checkpoint_cannot_be_sliced(tmp_path):
    """A checkpoint with only pytorch_model.bin: HFError naming the file."""
    from jaxmem.io.hf import HFError
    from jaxmem.peft.slices import HFSlices

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x02")
    with pytest.raises(HFError, match=r"pytorch_model\.bin: PyTorch pickle weights cannot be "
                                      r"read shard by shard"):
        HFSlices(tmp_path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_read_half_and_equal_one_device_bitwise(hf_dir, tmp_path):
    """2 processes x 2 simulated devices: every addressable shard of the base built from slices
    (NF4 + double quant with the run's base rules on fsdp=4 and tensor=2,fsdp=2 and on the
    output axis, NF4 cut inside its
    blocks, int8 on data=2,fsdp=2; the embedding, norms and LM head in each) equals the
    one-device quantization bitwise; with every leaf split on its output axis over the 4 devices
    each process reads exactly half of the bytes but the (replicated) final norm's, counted by
    HFSlices."""
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "slices_worker.py"),
                               str(hf_dir), str(tmp_path), str(port), str(i)], cwd=ROOT,
                              env=subprocess_env(cpu=True), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    for pid in range(2):
        r = json.loads((tmp_path / f"{pid}.json").read_text())
        for case in ("nf4_dq_rules", "nf4_dq_tensor_fsdp", "nf4_dq_out", "nf4_cut",
                     "int8_data_fsdp"):
            assert r[case]["mismatch"] == [], (pid, case, r[case]["mismatch"][:5])
        half = (r["total"] - r["rank1"]) // 2 + r["rank1"]
        assert r["nf4_dq_out"]["bytes_read"] == half, (r["nf4_dq_out"], r["total"])
        assert r["int8_data_fsdp"]["bytes_read"] == half
        assert r["nf4_dq_rules"]["bytes_read"] < 0.6 * r["total"]
        assert r["sha256_equal"]


@pytest.fixture(scope="module")
def qlora_run(tmp_path_factory):
    """A 2-step QLoRA run (NF4, double quant, r 4) on an 8-layer tiny fp32 HF checkpoint."""
    from hf_files import write_tokenizer
    from jaxmem.families.config import ModelConfig
    from jaxmem.io.hf_export import save_hf
    from jaxmem.train.cli import main

    d = tmp_path_factory.mktemp("merge")
    write_tokenizer(d / "tok", "def return import class self None for in if else " * 100)
    cfg = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=8,
                      num_heads=4, num_kv_heads=2, max_position_embeddings=64)
    save_hf(d / "hf", cfg, random_params(cfg, seed=5),
            tokenizer=str(d / "tok" / "tokenizer.json"), bos_token_id=0, eos_token_id=1)
    out = d / "run"
    assert main(["--batch-size", "2", "--seq-len", "16", "--steps", "2", "--lr", "1e-2",
                 "--sample-tokens", "0", "--no-progress", "--eval-batches", "1",
                 "--lora-rank", "4", "--quantize-base", "nf4", "--double-quant",
                 "--init-from", str(d / "hf"), "--out", str(out)]) == 0
    return d / "hf", out


@pytest.mark.slow  # the fixture's training run: 17 s of CPU on 2 cores
def test_merged_export_streams_one_tensor_at_a_time(qlora_run, tmp_path):
    """The merged export of a QLoRA run equals merged_params (the whole-model merge) bitwise,
    and the host memory it allocates (tracemalloc's peak: numpy buffers included) is the
    gathered adapters plus at most four of its largest tensor in fp32 (safetensors' reader
    copies a tensor once; the merge makes two temporaries), under a third of the merged model's
    fp32 bytes (8 layers)."""
    import argparse
    import math
    import tracemalloc

    import jax

    from jaxmem.export.merged import export_merged
    from jaxmem.io.hf import load_hf_params
    from jaxmem.io.hf_names import tensor_specs
    from jaxmem.train.rundir import load_run
    from jaxmem.peft.export import merged_params

    hf, out = qlora_run
    run = load_run(out)
    expected = merged_params(run, verbose=False)
    assert np.abs(np.asarray(run.state.params["layers"]["self_attn"]["q_proj"]["lora_b"])).max() > 0
    whole = sum(np.asarray(a).size * 4 for a in jax.tree.leaves(expected))
    largest = max(math.prod(s.hf_shape) * 4 for s in tensor_specs(run.model_config))
    adapters = sum(np.asarray(a).nbytes for a in jax.tree.leaves(run.state.params))
    tracemalloc.start()
    try:
        export_merged(run, tmp_path / "merged",
                      argparse.Namespace(dtype="float32", max_shard_mb=2048))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    written = load_hf_params(tmp_path / "merged", run.model_config)
    for (path, e), w in zip(jax.tree_util.tree_leaves_with_path(expected),
                            jax.tree.leaves(written)):
        np.testing.assert_array_equal(w, np.asarray(e, np.float32), err_msg=str(path))
    # measured here: peak / largest tensor and peak / whole model (fp32) below
    # measured (CPU, 8 layers): peak 0.35 MB = adapters 0.13 + 2.9 x the 77 KB embedding,
    # of a 1.34 MB merged model
    print(f"peak {peak} B, adapters {adapters} B, largest tensor {largest} B, model {whole} B")
    assert peak < adapters + 4 * largest and peak < whole / 3, (peak, adapters, largest, whole)


def test_mesh_qlora_on_a_pickle_checkpoint_stops_with_one_line(tmp_path, corpus):
    """`--quantize-base nf4 --mesh fsdp=2` on a checkpoint with only pytorch_model.bin: exit 2,
    one error line naming the file, nothing written into --out."""
    from hf_files import write_tokenizer
    from jaxmem.io.hf import config_to_hf
    from runs import error_line

    hf = tmp_path / "bin_ckpt"
    write_tokenizer(hf, "def return import class self None for in if else " * 50)
    config = _config().replace(vocab_size=300)  # the tokenizer's ids fit
    (hf / "config.json").write_text(json.dumps(config_to_hf(config, bos_token_id=0,
                                                            eos_token_id=1)))
    (hf / "pytorch_model.bin").write_bytes(b"\x80\x02}q\x00.")
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "jaxmem.train", "--init-from", str(hf),
                           "--lora-rank", "4", "--quantize-base", "nf4", "--mesh", "fsdp=2",
                           "--batch-size", "2", "--seq-len", "16", "--steps", "1",
                           "--data", corpus, "--out", str(out)], cwd=ROOT,
                          env=subprocess_env(cpu_devices=2), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert error_line(proc.stderr) == (
        f"python -m jaxmem.train: error: {hf / 'pytorch_model.bin'}: PyTorch pickle weights "
        f"cannot be read shard by shard (a mesh run slices each tensor in place); convert the "
        f"checkpoint to safetensors (transformers: save_pretrained(..., safe_serialization=True))")
    assert "Traceback" not in proc.stderr
    assert not (out / "checkpoints").exists()
