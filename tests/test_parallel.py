"""Data parallel, FSDP and tensor parallel on 8 simulated CPU devices (jaxmem.parallel).

The multi-device checks run in one subprocess (tests/parallel_worker.py): this process's JAX
already initialized with one device, and the device count must be set before JAX starts.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxmem.families import get_preset
from jaxmem.parallel.mesh import MeshError, MeshSpec
from jaxmem.parallel.rules import leaf_spec
from jax.sharding import PartitionSpec as P
from testenv import run_worker, subprocess_env

ROOT = Path(__file__).resolve().parents[1]
MESHES = ("fsdp8", "data2_fsdp4", "tensor2_fsdp4", "data8", "data2_fsdp2_tensor2", "fsdp4_accum2")


def test_mesh_parsing_and_resolution():
    assert MeshSpec.parse(None).resolve(8) == MeshSpec(1, 8, 1)
    assert MeshSpec.parse("data=2,fsdp=-1").resolve(8) == MeshSpec(2, 4, 1)
    assert MeshSpec.parse("tensor=2, fsdp=4").resolve(8) == MeshSpec(1, 4, 2)
    assert MeshSpec.parse("data=8").resolve(8) == MeshSpec(8, 1, 1)
    for text, words in [("pipe=2", "unknown axis 'pipe'"), ("data=2,data=4", "given twice"),
                        ("data=x", "must be an integer"), ("data=-1,fsdp=-1", "only one axis"),
                        ("data=0", "positive or -1")]:
        with pytest.raises(MeshError, match=words):
            MeshSpec.parse(text)
    with pytest.raises(MeshError, match="multiply to 6, but there are 8 devices"):
        MeshSpec.parse("data=2,fsdp=3").resolve(8)
    with pytest.raises(MeshError, match="tensor=4 does not divide the model's num_kv_heads 2"):
        MeshSpec(1, 2, 4).check(get_preset("tiny"), 8)
    with pytest.raises(MeshError, match="--batch-size 6 is not divisible by data x fsdp = 4"):
        MeshSpec(2, 2, 2).check(get_preset("tiny"), 6)


def test_sharding_rules_by_role_and_shape():
    sizes = {"data": 1, "fsdp": 4, "tensor": 2}
    # layer axis never split; q_proj [L, D, N, H]: tensor on N, fsdp on the largest other axis
    assert leaf_spec(("layers", "self_attn", "q_proj"), (4, 128, 4, 32), sizes) == \
        P(None, "fsdp", "tensor", None)
    # o_proj [L, N, H, D] row parallel; down_proj [L, F, D]
    assert leaf_spec(("layers", "self_attn", "o_proj"), (4, 4, 32, 128), sizes) == \
        P(None, "tensor", None, "fsdp")
    assert leaf_spec(("layers", "mlp", "down_proj"), (4, 384, 128), sizes) == P(None, "tensor", "fsdp")
    # issue 28: a projection's first axis after L (gathered per layer along its major axis, and
    # updated on its shard: jaxmem.optim.AdamW8bitInPlace.apply_placed); llama-3-8b on fsdp=8
    f8 = {"data": 1, "fsdp": 8, "tensor": 1}
    assert leaf_spec(("layers", "mlp", "down_proj"), (32, 14336, 4096), f8) == P(None, "fsdp", None)
    assert leaf_spec(("layers", "mlp", "up_proj"), (32, 4096, 14336), f8) == P(None, "fsdp", None)
    assert leaf_spec(("layers", "self_attn", "o_proj"), (32, 32, 128, 4096), f8) == \
        P(None, "fsdp", None, None)
    assert leaf_spec(("lm_head",), (4096, 128256), f8) == P("fsdp", None)
    # the embedding: the last axis, whose shards hold whole 256-blocks (4096 = 2 x 256 x 8)
    assert leaf_spec(("embed_tokens",), (128256, 4096), f8) == P(None, "fsdp")
    # 70B's o_proj on fsdp=16 x tensor=8 would not divide N = 64 / 8 heads: the last axis
    assert leaf_spec(("layers", "self_attn", "o_proj"), (80, 64, 128, 8192),
                     {"fsdp": 16, "tensor": 8}) == P(None, "tensor", None, "fsdp")
    # an 8-bit moment's block scales [..., nblocks] split as its codes
    assert leaf_spec((1, "mu", "layers", "mlp", "up_proj", "scale"), (32, 4096, 56), f8) == \
        P(None, "fsdp", None)
    assert leaf_spec((1, "mu", "embed_tokens", "scale"), (128256, 16), f8) == P(None, "fsdp")
    # Adam's mu of a param has the param's path below the optimizer's own keys: same rule
    assert leaf_spec((0, "mu", "layers", "mlp", "up_proj"), (4, 128, 384), sizes) == \
        P(None, "fsdp", "tensor")
    # norms and tiny leaves replicated; an axis no size divides stays whole
    assert leaf_spec(("layers", "input_layernorm", "scale"), (4, 128), sizes) == P()
    assert leaf_spec(("count",), (), sizes) == P()
    assert leaf_spec(("lm_head",), (128, 259), sizes) == P("fsdp", None)  # V=259: no tensor split
    assert leaf_spec(("embed_tokens",), (259, 128), {"data": 8, "fsdp": 1, "tensor": 1}) == P(None, None)


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    out = tmp_path_factory.mktemp("parallel")
    run_worker("parallel_worker.py", out, "--memory")  # 8 simulated CPU devices
    return out


def _load(out, name):
    return dict(np.load(out / f"{name}.npz"))


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES)
def test_sharded_training_matches_one_device(worker, mesh):
    """5 fp32 steps of the tiny model: per-step losses within 1e-5 relative of one device
    (fsdp4_accum2: the same 8 rows as 2 micro-batches of 4 on fsdp=4, the gradients accumulated
    on their shards, against one device's single batch); params within atol 1e-4 (not tighter: reductions run in another order on a mesh, gradients
    differ by ~1e-8, and Adam's division by sqrt(nu) amplifies that on near-zero gradients)."""
    one, sharded = _load(worker, "fp32_single"), _load(worker, f"fp32_{mesh}")
    assert not one["skipped"].any() and int(one["applied"]) == 5
    np.testing.assert_allclose(sharded["losses"], one["losses"], rtol=1e-5)
    np.testing.assert_array_equal(sharded["skipped"], one["skipped"])
    np.testing.assert_allclose(sharded["params"], one["params"], rtol=0, atol=1e-4)
    assert np.abs(one["params"] - _load(worker, "fp32_single")["params"]).max() == 0


@pytest.mark.slow
def test_bf16_sr_adamw8bit_on_shards_matches_one_device(worker):
    """bf16-sr + adamw8bit, widths 512 / 1024, data=4 x fsdp=2 against one device, 5 steps: the
    optimizer updates each shard where it lives (issue 28). Not bitwise: the forward adds in
    bf16 in another order, each shard draws its own stochastic-rounding bits, and 8-bit moments
    turn small gradient differences into whole-step ones. Measured (jax 0.10.2, CPU): losses
    3.3e-4 relative apart after 5 steps, params mean |diff| 2.2e-4 against mean |param| 0.034,
    no element more than 0.02 apart: tolerances with 2-3x margin."""
    one, sharded = _load(worker, "sr8_single"), _load(worker, "sr8_data4_fsdp2")
    assert int(one["applied"]) == int(sharded["applied"]) == 5
    # fsdp splits the rows of the projections: each device updates its shard in its own row
    # pieces (jaxmem.optim.AdamW8bitInPlace.apply_placed)
    assert leaf_spec(("layers", "mlp", "down_proj"), (2, 1024, 512), {"fsdp": 2}) == \
        P(None, "fsdp", None)
    np.testing.assert_allclose(sharded["losses"], one["losses"], rtol=1e-3)
    diff = np.abs(sharded["params"] - one["params"])
    assert diff.mean() <= 5e-4, diff.mean()
    assert np.mean(diff > 0.02) <= 1e-6, np.mean(diff > 0.02)


@pytest.mark.slow
def test_amp_fp16_skipped_steps_sharded(worker):
    """amp-fp16 with a loss scale that overflows at first: the same steps are skipped on
    fsdp=8 as on one device, and the applied ones agree to fp16's resolution.

    Tolerances: the forward runs in fp16 (eps 1e-3), so a different summation order moves the
    loss by ~1e-5 relative (measured 1.6e-5): rtol 1e-4. After 3 applied AdamW steps 0.16% of
    the params differ by more than 1e-4 (Adam divides by sqrt(nu): an fp16-noisy near-zero
    gradient can flip an element's update); none can differ by more than the updates' bound,
    lr (3e-3) per applied step."""
    one, sharded = _load(worker, "fp16_single"), _load(worker, "fp16_fsdp8")
    np.testing.assert_array_equal(one["skipped"], [True, True, False, False, False])
    np.testing.assert_array_equal(sharded["skipped"], one["skipped"])
    assert int(sharded["applied"]) == int(one["applied"]) == 3
    np.testing.assert_allclose(sharded["losses"], one["losses"], rtol=1e-4)
    diff = np.abs(sharded["params"] - one["params"])
    assert np.mean(diff > 1e-4) < 0.01, np.mean(diff > 1e-4)
    assert diff.max() <= 3 * 3e-3, diff.max()


@pytest.mark.slow
def test_per_device_memory(worker):
    """Per device (memory_analysis): fsdp=8 arguments at most 1/8 of one device's + 10%, temp
    no more than one device's; the analytic per-device total within 16% of the compiled peak
    (XLA:CPU; the skip as a per-leaf select instead of a lax.cond raised the CPU temp a little:
    fsdp=8 peak 15.31 -> 15.66 MB against an analytic 13.30, 13.1% -> 15.1% apart, while the H100
    compile of the 1B step fell from 32.23 to 20.04 GiB)."""
    mem = json.loads((worker / "memory.json").read_text())
    one = mem["single"]
    assert mem["fsdp8"]["argument_bytes"] <= one["argument_bytes"] / 8 * 1.10
    assert mem["fsdp8"]["temp_bytes"] <= one["temp_bytes"]
    assert set(mem) >= {"single", "fsdp8", "data8", "data2_fsdp2_tensor2"}
    for name, m in mem.items():
        np.testing.assert_allclose(m["analytic_total"], m["peak_bytes"], rtol=0.16, err_msg=name)
    # the collectives each mode compiles to: none on one device, all-gathers for fsdp,
    # only all-reduces for pure data parallel
    assert sum(one["collectives"].values()) == 0
    assert mem["fsdp8"]["collectives"]["all-gather"] > 0
    assert mem["data8"]["collectives"]["all-gather"] == 0 and mem["data8"]["collectives"]["all-reduce"] > 0


@pytest.mark.slow  # a JAX subprocess compiling on 2 simulated devices
def test_memory_cli_per_device(tmp_path):
    """`jaxmem.memory --mesh fsdp=2 --devices 2`: per-device numbers from a compile on 2
    simulated devices; without enough devices, exit 2 naming --mesh."""
    small = ["--num-layers", "2", "--batch-size", "4", "--seq-len", "32"]
    env = subprocess_env(cpu=True)
    run = lambda *a: subprocess.run([sys.executable, "-m", "jaxmem.memory", *small, *a], cwd=ROOT,
                                    env=env, capture_output=True, text=True, timeout=300)
    proc = run("--mesh", "fsdp=2", "--devices", "2", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout)
    assert r["mesh"] == "data=1,fsdp=2,tensor=1" and r["devices"] == 2
    assert r["analytic"]["local_batch"] == 2
    # rtol 0.2: since each device updates its own shard (issue 28) the compiled peak fell (7.0 ->
    # 5.8 MB here) and the analytic per-device model, which predates that, is 17% above it
    np.testing.assert_allclose(r["analytic"]["total_bytes"], r["compiled"]["peak_bytes"], rtol=0.2)
    assert r["compiled"]["collectives"]["all-gather"] > 0
    bad = run("--mesh", "fsdp=2")
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1].endswith(
        "error: --mesh fsdp=2: the axis sizes multiply to 2, but there are 1 devices")


def test_process_flags_and_cluster_detection(monkeypatch):
    from jaxmem.errors import ConfigError
    from jaxmem.parallel.distributed import check_process_flags, cluster_name, initialize

    check_process_flags("localhost:1234", 2, 1)
    check_process_flags(None, None, None)
    for args, words in [((None, 2, None), "--num-processes needs --coordinator HOST:PORT"),
                        ((None, None, 0), "--process-id needs --coordinator"),
                        (("localhost", 2, 0), "expected HOST:PORT"),
                        (("localhost:1", 2, None), "needs --num-processes and --process-id"),
                        (("localhost:1", 2, 2), "--process-id 2 must be below --num-processes 2")]:
        with pytest.raises(ConfigError, match=words):
            check_process_flags(*args)
    for var in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "JOB_COMPLETION_INDEX"):
        monkeypatch.delenv(var, raising=False)
    assert cluster_name() is None and initialize() is False  # one process: nothing started
    monkeypatch.setenv("SLURM_NTASKS", "1")
    assert cluster_name() is None  # a one-task Slurm job is a single process
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert cluster_name() == "Slurm"


@pytest.mark.slow  # 3.8 s cold on 2 cores (default run kept under 5 min)
def test_one_device_placement_is_todays_step():
    """No mesh: the single-device step lowers to exactly today's program, the init is bitwise
    today's, and batches pass through untouched."""
    import jax
    from jaxmem.config.run import RunConfig
    from jaxmem.memory.compiled import abstract_state, abstract_step_batch
    from jaxmem.memory.spec import StepSpec
    from jaxmem.parallel.mesh import run_mesh
    from jaxmem.train.placement import Placement
    from jaxmem.train.step import create_train_state, jit_train_step

    spec = StepSpec.from_run_config(RunConfig().replace({"data.batch_size": 2, "data.seq_len": 8}))
    step_cfg, loss_scale = spec.step_config()
    assert run_mesh(None, step_cfg.model, 2) is None  # the test process has one device
    par = Placement.single()
    state, batch = abstract_state(spec), abstract_step_batch(spec)
    assert (par.train_step(step_cfg, state).lower(state, batch).as_text()
            == jit_train_step(step_cfg).lower(state, batch).as_text())
    ours, todays = par.init_state(step_cfg, loss_scale, 3), create_train_state(step_cfg, loss_scale, 3)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(todays)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    numpy_batch = {"inputs": np.zeros((1, 2, 3), np.int32)}
    assert par.batch(numpy_batch) is numpy_batch and par.eval_batch(numpy_batch) is numpy_batch


@pytest.mark.slow  # two JAX subprocesses, 4 meshes compiled in each
def test_memory_fit_searches_meshes():
    """`--fit GIB --devices 4`: meshes from pure data parallel towards all-fsdp, then tensor=2;
    with a budget nothing meets every candidate is compiled and the exit is 1; with a budget just
    above the smallest per-device peak the first candidate under it is chosen."""
    env = subprocess_env(cpu=True)

    def fit(gib):
        proc = subprocess.run([sys.executable, "-m", "jaxmem.memory", "--num-layers", "2",
                               "--devices", "4", "--fit", str(gib), "--json"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)
        return proc.returncode, json.loads(proc.stdout)

    rc, r = fit(0.001)
    assert rc == 1 and r["chosen"] is None
    assert [t["mesh"] for t in r["tried"]] == ["data=4,fsdp=1,tensor=1", "data=2,fsdp=2,tensor=1",
                                              "data=1,fsdp=4,tensor=1", "data=1,fsdp=2,tensor=2"]
    peaks = [t["peak_bytes"] for t in r["tried"]]
    assert min(peaks) < peaks[0]  # splitting the params pays off per device
    # the GPU size whose usable bytes (verdict.usable_bytes, the subprocess's environment:
    # preallocation off) are just above the smallest per-device peak
    from jaxmem.xla.verdict import device_gib_for, usable_bytes
    budget = device_gib_for(min(peaks) + 1024, fraction=1.0)
    rc, r = fit(budget)
    first = next(i for i, p in enumerate(peaks) if p <= usable_bytes(budget, fraction=1.0))
    assert rc == 0 and first > 0
    assert r["chosen"]["mesh"] == r["tried"][-1]["mesh"] and len(r["tried"]) == first + 1
    assert r["chosen"]["peak_bytes"] == peaks[first]
