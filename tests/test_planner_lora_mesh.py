"""The planner per device for LoRA / QLoRA on a mesh (jaxmem.memory.counted and .analytic on a
mesh, jaxmem.parallel.rules): the 70B headline (analytic, no compile), the frozen base split by the rules, host bytes
with --offload-base host, the mesh x micro-batch x remat x loss-chunk search, and the per-device
analytic peak against XLA's compiled one on 2 and 4 simulated devices.

Run as a script (`python tests/test_planner_lora_mesh.py OUT.json`) it is the worker of the
compiled comparison: it compiles the tiny QLoRA step for every mesh of this process's devices.
"""

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from testenv import ROOT, subprocess_env

GiB = 2**30
# the headline (jaxmem's --batch-size is the global micro-batch: 2 = one sequence of 2048
# tokens per device on fsdp=2; --batch-size 1 cannot be split over 2 devices and exits 2)
HEADLINE = {"model.preset": "llama-3.1-70b", "peft.lora_rank": 16, "peft.quantize_base": "nf4",
            "peft.double_quant": True, "peft.offload_base": "host", "precision.mode": "amp-bf16",
            "remat.policy": "full", "data.batch_size": 2, "data.seq_len": 2048}
# tests/test_peft_memory.py's toy (tiny, 2 layers, D 256, F 768, fp32, remat none), QLoRA NF4 + dq
TINY_QLORA = {"model.num_layers": 2, "model.hidden_size": 256, "model.intermediate_size": 768,
              "peft.lora_rank": 8, "peft.quantize_base": "nf4", "peft.double_quant": True,
              "precision.mode": "fp32", "data.batch_size": 4, "data.seq_len": 128}
MESHES = {2: ["fsdp=2"], 4: ["fsdp=4", "tensor=2,fsdp=2"]}  # the base split on fsdp and tensor


def _analytic(spec, mesh, devices):
    from jaxmem.memory.analytic import analytic_breakdown
    from jaxmem.memory.mesh import resolve
    return analytic_breakdown(spec, resolve(spec, mesh, devices) if mesh else None)


def _frozen(spec, sizes):
    """{where: bytes} of the frozen base on one device (jaxmem.memory.counted)."""
    from jaxmem.memory.counted import count_frozen
    out = {}
    for c in count_frozen(spec, sizes):
        out[c.where.value] = out.get(c.where.value, 0) + c.bytes
    return out


def _in_flight(spec, sizes):
    from jaxmem.memory.counted import layer_in_flight
    return {c.label: c.bytes for c in layer_in_flight(spec, sizes)}


def _spec(overrides):
    from jaxmem.config.run import RunConfig
    from jaxmem.memory.spec import StepSpec
    return StepSpec.from_run_config(RunConfig().replace(overrides))


@pytest.fixture(scope="module")
def headline():
    spec = _spec(HEADLINE)
    on_device = spec.replace(offload_base="none")
    return spec, _analytic(spec, "fsdp=2", 2), _analytic(on_device, "fsdp=2", 2)


def test_headline_70b_qlora_offload_fits_22_gib_per_device(headline):
    """Llama-3.1-70B, r 16 on 7 targets, NF4 + double quant, amp-bf16, full remat, 2048 tokens
    per device on fsdp=2, base offloaded: at most 22 GiB of device memory per device (analytic;
    measured here 10.81 GiB, with 16.45 GiB of host memory per device; 27.05 without offload)."""
    import jax
    from jaxmem.families.params import abstract_params
    from jaxmem.paths import in_layers
    spec, off, on = headline
    c = spec.model
    assert off["local_batch"] == 1 and off["mesh"] == "data=1,fsdp=2,tensor=1"
    assert off["total_bytes"] <= 22 * GiB, off["total_bytes"] / GiB
    # the host holds each device's half of the packed block layers: NF4 + double quant is 4.127
    # bits per weight (4 of code, 8 / 64 of absmax code, 32 / (64 x 256) of fp32 absmax scale);
    # the norms stay fp32 beside them
    leaves = jax.tree_util.tree_leaves_with_path(abstract_params(c))
    norms = sum(x.size * 4 for p, x in leaves if in_layers(p) and x.ndim == 2)
    dense = sum(x.size for p, x in leaves if in_layers(p) and x.ndim > 2)
    packed = dense * (4 + 8 / 64 + 32 / (64 * 256)) / 8 + norms
    np.testing.assert_allclose(off["host_bytes"], packed / 2, rtol=1e-3)
    assert 16 * GiB < off["host_bytes"] < 17 * GiB
    # without offload the same device holds those layers instead of one layer's copy
    sizes = {"fsdp": 2}
    layers = _frozen(spec.replace(offload_base="host"), sizes)["host"]
    flight = _in_flight(spec.replace(offload_base="host"), sizes)
    copy = flight["frozen layer copied from the host"]
    assert on["host_bytes"] == 0 and on["total_bytes"] > 22 * GiB
    assert on["total_bytes"] - off["total_bytes"] == layers - copy
    assert copy * c.num_layers == layers
    # one gathered layer is the whole packed layer (fsdp gathers it), twice the device's shard
    np.testing.assert_allclose(flight["frozen layer gathered (fsdp)"], 2 * copy, rtol=1e-3)
    # adapters and their state are split in two: 207M params, fp32 master + grads + mu + nu
    adapters = 207_093_760  # sum over the 7 targets of 80 x 16 x (in + out)
    assert sum(x["bytes"] for x in off["components"] if x["kind"] == "params") == adapters * 4 // 2


def test_base_split_follows_the_rules_on_tiny():
    """On the tiny model: fsdp=N holds at most 1/N of the base + the leaves the rules keep whole;
    offload moves exactly the block layers to the host; one device has nothing gathered."""
    from jaxmem.memory.counted import head_gathered, tree_bytes
    spec = _spec(TINY_QLORA)
    one = _frozen(spec, {})["device"]
    assert _in_flight(spec, {}) == {}
    base = spec.trainable.abstract_frozen(spec.model, spec.precision.compute_dtype)
    assert one == tree_bytes(base)
    gathered = []
    for n in (2, 4):
        local = _frozen(spec, {"fsdp": n})["device"]
        assert one / n <= local < one / n + one / 20  # a few small leaves stay whole
        gathered.append(_in_flight(spec, {"fsdp": n})["frozen layer gathered (fsdp)"])
    assert gathered[0] == gathered[1] > 0  # fsdp gathers the whole layer
    # the LM head, split by fsdp, is gathered whole for the loss
    wide = _spec({**TINY_QLORA, "model.vocab_size": 4096})  # a head larger than a layer
    assert head_gathered(wide, {"fsdp": 2}) == 256 * 4096 * 4 > gathered[0]  # [D, V] fp32, whole
    assert head_gathered(wide, {}) == 0


def test_single_device_offload_moves_the_layers_to_the_host():
    """analytic_breakdown: --offload-base host takes the block layers out of the device peak
    (host_bytes) and adds one layer's copy; nothing else changes."""
    from jaxmem.memory.analytic import analytic_breakdown
    spec = _spec(TINY_QLORA)
    host = spec.replace(offload_base="host")
    on, off = analytic_breakdown(spec), analytic_breakdown(host)
    layers, copy = _frozen(host, {})["host"], _in_flight(host, {})["frozen layer copied from the host"]
    assert on["host_bytes"] == 0 and off["host_bytes"] == layers
    assert copy * spec.model.num_layers == layers
    assert on["total_bytes"] - off["total_bytes"] == layers - copy


def test_host_argument_bytes_from_the_entry_layout():
    """XLA:CPU counts a pinned_host argument in argument_size_in_bytes and reports 0 host bytes;
    the compiled module's entry layout marks it S(5), and host_split takes it out of the peak."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding
    from jaxmem.memory.compiled import compiled_stats
    from jaxmem.memory.compiled import host_split
    d = jax.devices()[0]
    if "pinned_host" not in {m.kind for m in d.addressable_memories()}:
        pytest.skip("this backend has no pinned_host memory")
    host = SingleDeviceSharding(d, memory_kind="pinned_host")
    on_device = SingleDeviceSharding(d, memory_kind="device")
    x = jax.ShapeDtypeStruct((256, 1024), jnp.float32, sharding=host)
    y = jax.ShapeDtypeStruct((1024,), jnp.bfloat16, sharding=on_device)
    compiled = jax.jit(lambda x, y: jax.device_put(x, on_device).sum(0) + y).lower(x, y).compile()
    stats, _ = compiled_stats(compiled)
    split = host_split(compiled, stats, compiled.as_text())
    assert split["host_argument_bytes"] == 256 * 1024 * 4
    assert split["device_peak_bytes"] == stats["peak_bytes"] - (
        256 * 1024 * 4 if split["host_source"].startswith("entry") else 0)


def test_compare_line_compares_the_program_that_was_compiled():
    """With --offload-base host, a compiled step that kept the base on the device is compared
    with the analytic figure without offload; an offloading one by its device peak."""
    from jaxmem.memory.mesh import compare_line
    r = {"analytic": {"total_bytes": 10}, "analytic_without_offload": 30,
         "compiled": {"peak_bytes": 40, "host_argument_bytes": 0, "device_peak_bytes": 40}}
    assert compare_line(r) == "analytic / compiled peak: 0.750 (both without offload)"
    r["compiled"].update(host_argument_bytes=20, device_peak_bytes=20)
    assert compare_line(r) == "analytic / compiled peak: 0.500"


def test_plan_mesh_searches_meshes_micro_batches_remat_and_loss_chunk():
    """plan_mesh on the tiny QLoRA step over 4 devices (analytic only): candidates in order,
    none over the budget chosen, the first under it chosen; micro-batches divisible by the
    batch shards only."""
    from jaxmem.memory.search import mesh_candidates_for, plan_mesh
    from jaxmem.memory.search import mesh_candidates
    spec = _spec(TINY_QLORA)
    meshes = mesh_candidates(spec.replace(batch_size=8), 4)
    cands = mesh_candidates_for(spec, meshes, 8)
    assert [str(m) for m, _ in cands][0] == "data=4,fsdp=1,tensor=1"
    assert all(s.batch_size % (4 if m.tensor == 1 else 2) == 0 for m, s in cands)
    assert {s.loss_chunk for _, s in cands} >= {None}
    from jaxmem.memory.analytic import analytic_breakdown
    fn = analytic_breakdown
    peaks = [fn(s, m)["total_bytes"] for m, s in cands]
    budget = sorted(peaks)[len(peaks) // 2]
    r = plan_mesh(spec, meshes, 8, budget, analytic_fn=fn, compile_fn=None)
    first = next(i for i, p in enumerate(peaks) if p <= budget)
    assert r["chosen"]["peak_bytes"] == peaks[first] and len(r["tried"]) == first + 1
    assert all(not t["fits"] for t in r["tried"][:-1]) and r["compiles"] == 0
    nothing = plan_mesh(spec, meshes, 8, 1024, analytic_fn=fn, compile_fn=None)
    assert nothing["chosen"] is None and len(nothing["tried"]) == len(cands)


def test_headline_cli_prints_device_and_host_bytes():
    """The headline command, analytic only: device and host bytes and the figure without offload;
    --batch-size 1 on fsdp=2 exits 2 with one line naming --batch-size."""
    env = subprocess_env(cpu=True)
    flags = ["--preset", "llama-3.1-70b", "--lora-rank", "16", "--quantize-base", "nf4",
             "--double-quant", "--offload-base", "host", "--precision", "amp-bf16", "--remat",
             "full", "--seq-len", "2048", "--mesh", "fsdp=2", "--devices", "2", "--analytic-only"]
    run = lambda *a: subprocess.run([sys.executable, "-m", "jaxmem.memory", *flags, *a],  # noqa
                                    cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    proc = run("--batch-size", "2", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout)
    assert r["compiled"] is None and r["analytic"]["total_bytes"] <= 22 * GiB
    assert 16 * GiB < r["analytic"]["host_bytes"] < 17 * GiB
    assert r["analytic_without_offload"] > 22 * GiB
    bad = run("--batch-size", "1")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].endswith(
        "--batch-size 1 is not divisible by data x fsdp = 2 (--batch-size counts the sequences "
        "of all devices together: one per device here is --batch-size 2)")


def _worker(out_path: str) -> None:
    """Compile the tiny QLoRA step for each mesh of this process's devices, with the analytic."""
    import jax
    from jaxmem.memory.compiled import compile_step
    n = jax.device_count()
    report = {}
    for mesh in MESHES[n]:
        spec = _spec(TINY_QLORA)
        a = _analytic(spec, mesh, n)
        c = compile_step(spec, mesh)
        report[mesh] = {"analytic": a["total_bytes"], "compiled": c["peak_bytes"],
                        "argument": c["argument_bytes"]}
    one = _spec(TINY_QLORA)
    report["one"] = {"analytic": _analytic(one, None, 1)["total_bytes"]}
    with open(out_path, "w") as f:
        json.dump(report, f)


@pytest.mark.slow  # one JAX subprocess per device count, 2-3 tiny compiles each
@pytest.mark.parametrize("devices", [2, 4])
def test_tiny_per_device_analytic_vs_compiled(tmp_path, devices):
    """The toy QLoRA step of tests/test_peft_memory.py (NF4 + dq, fp32, remat none, batch 4 x 128)
    on every mesh of 2 and 4 simulated devices: the per-device analytic peak within the LoRA
    planner tests' band of XLA's compiled one (0.7-1.15, tests/test_peft_memory.py; XLA:CPU's
    buffer assignment). Measured: fsdp=2 0.971 (one device 0.922)."""
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, __file__, str(out)], cwd=ROOT,
                          env=subprocess_env(cpu_devices=devices), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    for mesh in MESHES[devices]:
        ratio = r[mesh]["analytic"] / r[mesh]["compiled"]
        assert 0.7 <= ratio <= 1.15, (mesh, r[mesh], ratio)


if __name__ == "__main__":
    _worker(sys.argv[1])
