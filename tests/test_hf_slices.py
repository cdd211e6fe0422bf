"""The frozen LoRA base built shard by shard from a checkpoint's safetensors slices
(jaxmem.io.hf_slices): bitwise the one-device quantization, about 1/N of the bytes read per
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
    from jaxmem.config.model import ModelConfig
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

    from jaxmem.io.hf_slices import HFSlices, abstract_base, sharded_base, streamed_sha256
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
    from jaxmem.io.hf_slices import HFSlices

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
    (NF4 + double quant with the parameter rules and on the output axis, NF4 cut inside its
    blocks, int8 on data=2,fsdp=2; the embedding, norms and LM head in each) equals the
    one-device quantization bitwise; with every leaf split on its output axis over the 4 devices
    each process reads exactly half of the bytes but the (replicated) final norm's, counted by
    HFSlices."""
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "hf_slices_worker.py"),
                               str(hf_dir), str(tmp_path), str(port), str(i)], cwd=ROOT,
                              env=subprocess_env(cpu=True), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    for pid in range(2):
        r = json.loads((tmp_path / f"{pid}.json").read_text())
        for case in ("nf4_dq_rules", "nf4_dq_out", "nf4_cut", "int8_data_fsdp"):
            assert r[case]["mismatch"] == [], (pid, case, r[case]["mismatch"][:5])
        half = (r["total"] - r["rank1"]) // 2 + r["rank1"]
        assert r["nf4_dq_out"]["bytes_read"] == half, (r["nf4_dq_out"], r["total"])
        assert r["int8_data_fsdp"]["bytes_read"] == half
        assert r["nf4_dq_rules"]["bytes_read"] < 0.6 * r["total"]
        assert r["sha256_equal"]
