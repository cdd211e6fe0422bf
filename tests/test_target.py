"""`--target` where XLA's GPU compiler is or is not installed (jaxmem.target)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxmem import target
from jaxmem.memory.cli import main


def test_target_without_the_extra_exits_2_with_what_to_install(monkeypatch, capsys):
    monkeypatch.setattr(target, "_plugin_version", lambda: None)
    with pytest.raises(SystemExit) as e:
        main(["--preset", "tiny", "--target", "h100"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "--target needs XLA's GPU compiler" in err[-1]
    assert "pip install 'jaxmem[gpu-plan]'" in err[-1] and "jax-cuda12-plugin==" in err[-1]


def test_a_plugin_of_another_jaxlib_is_refused(monkeypatch):
    monkeypatch.setattr(target, "_plugin_version", lambda: "0.0.1")
    with pytest.raises(target.TargetError, match="the CUDA plugin is 0.0.1 but jaxlib is"):
        target.check_installed()


def test_unknown_card_and_measure_are_refused(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--preset", "tiny", "--target", "h100", "--measure"])
    assert e.value.code == 2 and "--measure" in capsys.readouterr().err
    with pytest.raises(target.TargetError, match="unknown --target 'v100'"):
        target.card("v100")


def test_outside_a_target_jaxmem_follows_the_backend():
    assert target.active() is None
    assert target.platform() == jax.default_backend()
    assert target.devices() == jax.devices()


def test_the_cards_users_own_and_every_host_link():
    """The cards of issue 39 beside the H100 and H200, each with the PCIe link assumed between it
    and its host (generation, one-direction bytes/s), said where a card is described."""
    assert {"h100", "h200", "rtx4090", "a6000", "l40s"} <= set(target.CARDS)
    links = {n: (c.host_link.gen, c.host_link.lanes, c.host_link.bandwidth)
             for n, c in target.CARDS.items()}
    assert links == {**{n: (5, 16, 50e9) for n in ("h100", "h100-pcie", "h200")},
                     **{n: (4, 16, 25e9) for n in ("a100", "a100-pcie", "a6000", "rtx4090",
                                                   "l40s")}}
    l40s = target.CARDS["l40s"]
    assert (l40s.device_name, l40s.major, l40s.minor, l40s.sms) == ("NVIDIA L40S", 8, 9, 142)
    assert (l40s.memory_bytes, l40s.bandwidth, l40s.l2_bytes) == (47_576_711_168, 8.64e11,
                                                                 96 * 2**20)
    assert l40s.peak_tflops == (362.0, 733.0)
    assert target.CARDS["rtx4090"].describe() == (
        "NVIDIA GeForce RTX 4090 (23.6 GiB; host link PCIe 4.0 x16, ~25 GB/s each way)")
    assert "host link PCIe 5.0 x16, ~50 GB/s each way" in target.CARDS["h200"].describe()


def test_the_verdict_names_the_card_and_its_host_link(monkeypatch):
    from jaxmem.xla.verdict import verdict_lines
    assert not any("card:" in ln for ln in verdict_lines(2**30, "compiled", "cpu", "fp32"))
    monkeypatch.setattr(target, "active", lambda: target.Target(target.CARDS["l40s"], ()))
    lines = verdict_lines(2**30, "compiled", "gpu", "amp-bf16")
    assert ("  card: NVIDIA L40S (44.3 GiB; host link PCIe 4.0 x16, ~25 GB/s each way)"
            in lines), lines


@pytest.mark.gpu_target
@pytest.mark.parametrize("name", sorted(target.CARDS))
def test_every_card_compiles_a_program(name):
    """Each card's description parses in this jax's CUDA plugin and compiles a bf16 GEMM for
    the card's compute capability."""
    with target.compiling_for(name) as t:
        assert t.devices[0].device_kind == target.CARDS[name].device_name
        x = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16)
        compiled = jax.jit(lambda a, b: a @ b).lower(x, x).compile()
    assert "cublas" in compiled.as_text() or "gemm" in compiled.as_text()
    assert compiled.memory_analysis().argument_size_in_bytes == 2 * 256 * 256 * 2


def test_hosts_needs_target_and_must_divide_the_devices(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--preset", "tiny", "--devices", "2", "--hosts", "2"])
    assert e.value.code == 2 and "--hosts needs --target" in capsys.readouterr().err
    with pytest.raises(target.TargetError, match="--hosts 3 must divide --devices 8"):
        with target.compiling_for("h100", devices=8, hosts=3):
            pass


@pytest.mark.gpu_target
def test_two_hosts_of_four_gpus_compile_one_sharded_program():
    """`--hosts 2 --devices 8`: the devices of two processes, one program over all 8 whose
    per-device argument is 1/8 and whose collectives span both hosts."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import numpy as np
    with target.compiling_for("h100", devices=8, hosts=2) as t:
        assert [d.process_index for d in t.devices] == [0] * 4 + [1] * 4
        assert "on 2 hosts of 4" in t.describe()
        mesh = Mesh(np.array(t.devices), ("fsdp",))
        x = jax.ShapeDtypeStruct((1024, 1024), jnp.float32,
                                 sharding=NamedSharding(mesh, P("fsdp")))
        compiled = jax.jit(lambda a: (a @ a.T).sum()).lower(x).compile()
    assert compiled.memory_analysis().argument_size_in_bytes == 1024 * 1024 * 4 // 8
    assert "all-gather" in compiled.as_text()
