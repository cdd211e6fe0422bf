"""The memory breakdown and planner: formulas against jax's saved residuals and XLA's compiled
numbers, the never-over-budget rule, the JSON report, and bad input."""

import json
import subprocess
import sys

import pytest

from jaxmem.families import PRESETS, get_preset
from jaxmem.families.config import ModelConfig
from jaxmem.families import FAMILIES
from jaxmem.memory import (StepSpec, analytic_breakdown, candidates, compile_step,
                           measure_in_subprocess, plan)
from jaxmem.memory.cli import main
from jaxmem.model.precision import get_precision
from jaxmem.model.remat import TAGS, RematPolicy
from testenv import subprocess_env

try:  # jax 0.10 keeps it private; print_saved_residuals is the public printer of the same list
    from jax._src.ad_checkpoint import saved_residuals
except ImportError:  # pragma: no cover - a future jax that moved it
    saved_residuals = None

# Distinct sizes, so no two axes can be confused: D 40, F 56, N 4, K 2, H 10, B 2, T 24.
CFG = ModelConfig(hidden_size=40, intermediate_size=56, num_layers=3, num_heads=4, num_kv_heads=2,
                  max_position_embeddings=64)


def jax_saved_bytes(spec: StepSpec) -> int:
    """Bytes of the residuals jax keeps for the train step's loss (params passed in excluded)."""
    import jax
    from jaxmem.xla.residuals import saved_residual_bytes
    from jaxmem.train.loss import abstract_batch, token_loss
    from jaxmem.families.params import abstract_params

    model = spec.step_config()[0].build_model()

    def loss(params, batch):  # the train step's: cast inside, causal-only attention
        return token_loss(model, params, batch, compute_dtype=spec.precision.compute_dtype,
                          loss_chunk=spec.step_config()[0].loss_chunk)[0]

    params = jax.tree_util.tree_map(
        lambda s: jax.ShapeDtypeStruct(s.shape, spec.precision.param_dtype),
        abstract_params(spec.model))
    batch = abstract_batch(spec.batch_size, spec.seq_len)
    return saved_residual_bytes(loss, params, batch, exclude_arguments=True).bytes


def tiny_of(family: str) -> ModelConfig:
    """The family's first preset at CFG's tiny shape: every variation point the family sets
    (QK-norm, biases, the norms' placement, (1 + w) norms, GeGLU, the embedding scale) kept;
    a sliding window of 16 < T where the family has one (Gemma 3: local, global, local
    layers: the cond keeps both kinds' residuals)."""
    preset = next(p for p in PRESETS.values() if p.family == family)
    kw = {f: getattr(CFG, f) for f in ("hidden_size", "intermediate_size", "num_layers",
                                        "num_heads", "num_kv_heads", "max_position_embeddings",
                                        "vocab_size")}
    kw.update(head_dim=None, rope_type="default")
    if preset.sliding_window is not None:  # under dots its PV output is kept chunk-padded
        kw.update(sliding_window=16, layer_types=None if preset.layer_types is None else (
            "sliding_attention", "full_attention", "sliding_attention"))
    if preset.partial_rotary_factor != 1:  # Phi-3: 8 of the 10 head dims (0.75 would turn 7.5)
        kw.update(partial_rotary_factor=0.8)
    return preset.replace(**kw)


@pytest.mark.skipif(saved_residuals is None, reason="jax has no saved_residuals")
@pytest.mark.parametrize("precision", ["fp32", pytest.param("amp-bf16", marks=pytest.mark.slow),
                                       pytest.param("bf16", marks=pytest.mark.slow)])
@pytest.mark.parametrize("remat", ["none", "full", "dots", "dots_no_batch",
                                   "names:query,key,value,mlp_gate,mlp_up", "names:" + ",".join(TAGS)])
@pytest.mark.parametrize("family", [f if f == "llama" else pytest.param(f, marks=pytest.mark.slow)
                                    for f in FAMILIES])
def test_saved_activations_match_jax(precision, remat, family):
    """Formula = jax's saved residuals to 0.5% (measured: 0.05-0.35% below, a few [B, T] ints),
    for every registered family (its preset's variation points at a tiny shape): Qwen3's
    QK-norm keeps q and k before it, Qwen2's biases keep nothing more, Gemma 3's sandwich norms
    keep their inputs (none; dots: down_proj's output) and its (1 + w) norms their scales
    (Gemma 3 was 10-13% under before these terms, under none, dots and dots_no_batch); its
    sliding window's PV output chunk-padded (dots), its local layers' RoPE tables, each
    layer's chosen tables under none (+1.1% to 4.5% missing before these)."""
    model = tiny_of(family)
    spec = StepSpec.of(model, get_precision(precision), RematPolicy.parse(remat), 2, 24,
                       attention="xla")
    a = analytic_breakdown(spec)
    compute_copy = {c["name"]: c["bytes"] for c in a["components"]}["params (compute copy)"]
    formula = a["saved_activations"]["total_bytes"] + compute_copy
    np_rel = abs(formula - jax_saved_bytes(spec)) / jax_saved_bytes(spec)
    assert np_rel < 0.005, (formula, jax_saved_bytes(spec))


@pytest.mark.skipif(saved_residuals is None, reason="jax has no saved_residuals")
@pytest.mark.parametrize("remat", ["none", "full", "dots", "dots_no_batch"])
def test_saved_activations_match_jax_every_layer_local(remat):
    """Mistral 7B v0.1's kind of stack, every layer windowed (W 16 < T 24): its PV output
    chunk-padded under dots, and only the local layers' RoPE tables kept (the global ones are
    made and never read): formula = jax's saved residuals to 0.5% (measured: equal)."""
    model = tiny_of("mistral").replace(sliding_window=16)
    assert all(model.local_layers)
    spec = StepSpec.of(model, get_precision("fp32"), RematPolicy.parse(remat), 2, 24,
                       attention="xla")
    a = analytic_breakdown(spec)
    compute_copy = {c["name"]: c["bytes"] for c in a["components"]}["params (compute copy)"]
    formula = a["saved_activations"]["total_bytes"] + compute_copy
    assert abs(formula - jax_saved_bytes(spec)) / jax_saved_bytes(spec) < 0.005


@pytest.mark.cpu_only(reason="the analytic model is held to XLA:CPU's buffer assignment here; "
                             "a GPU compile assigns buffers differently (8B: 49.21 GiB on an "
                             "H100 vs 83.95 on CPU); on a GPU test_measured_peak_near_compiled "
                             "checks the plan")
@pytest.mark.parametrize("remat, batch", [pytest.param("none", 2, marks=pytest.mark.slow),
                                          ("full", 2), pytest.param("full", 8, marks=pytest.mark.slow)])
def test_analytic_within_15_percent_of_compiled(remat, batch):
    """fp32 on CPU (bf16 is emulated there, docs/memory.md): tiny preset, B x 256 tokens.
    Measured 2026-11-23: none 2 x 256 1.083, full 2 x 256 1.101, full 8 x 256 1.066 (0.838
    before the MLP backward's working set was counted)."""
    spec = StepSpec.of(get_preset("tiny"), get_precision("fp32"), RematPolicy.parse(remat), batch,
                       256, attention="xla")
    compiled = compile_step(spec)["peak_bytes"]
    ratio = analytic_breakdown(spec)["total_bytes"] / compiled
    assert 0.85 <= ratio <= 1.15, ratio


def test_candidate_order():
    base = StepSpec.of(CFG, get_precision("fp32"), RematPolicy(), 1, 24)
    c = candidates(base, 4)
    keys = [(s.batch_size, str(s.remat), s.mu_dtype) for s in c]
    assert keys[:3] == [(4, "none", "fp32"), (4, "none", "bf16"), (4, "dots_no_batch", "fp32")]
    assert [s.batch_size for s in c] == sorted((s.batch_size for s in c), reverse=True)
    assert all(s.batch_size * s.grad_accum == 4 for s in c)
    import jax
    if jax.default_backend() == "cpu":  # a GPU has pinned host memory: offload comes last there
        assert "offload" not in {s.remat.kind for s in c}  # CPU cannot offload


@pytest.mark.slow  # two compiles: 9 s of CPU cold
def test_planner_never_recommends_over_budget():
    small = CFG.replace(num_layers=2)
    base = StepSpec.of(small, get_precision("fp32"), RematPolicy(), 2, 64)
    cache = {}

    def compiled(spec):  # real compiles, each configuration once
        key = (spec.batch_size, str(spec.remat), spec.mu_dtype)
        return cache[key] if key in cache else cache.setdefault(key, compile_step(spec))

    first, second = candidates(base, 2, mu_dtypes=("fp32",))[:2]  # none, dots_no_batch
    p_first, p_second = compiled(first)["peak_bytes"], compiled(second)["peak_bytes"]
    assert p_second < p_first
    budget = (p_first + p_second) // 2
    for analytic_first in (False, True):
        result = plan(base, 2, budget, mu_dtypes=("fp32",), compile_fn=compiled,
                      analytic_first=analytic_first)
        tried = result["tried"]
        assert [t["fits"] for t in tried] == [False, True]  # stops at the first that fits
        assert tried[0]["peak_bytes"] in (p_first, None) and p_first > budget  # None: analytic
        assert result["chosen"]["peak_bytes"] == p_second <= budget
        assert result["spec"].remat.kind == "dots_no_batch"


@pytest.mark.cpu_only(reason="the rule-out band (search.ANALYTIC_BAND) holds the toy's analytic "
                             "peak to XLA:CPU's compiled one; a GPU compile of this few-MiB toy "
                             "also holds the cuBLAS workspace (up to 32 MiB on Hopper), which the "
                             "analytic model leaves out, so nothing would be ruled out there")
@pytest.mark.slow  # a dozen compiles
def test_analytic_first_rules_out_only_what_does_not_fit():
    """Same choice as compiling every candidate, fewer compiles, and each candidate ruled out by
    the analytic model really is over the budget when compiled."""
    base = StepSpec.of(CFG, get_precision("fp32"), RematPolicy(), 4, 24)
    cache = {}

    def compiled(spec):
        key = (spec.batch_size, str(spec.remat), spec.mu_dtype)
        return cache[key] if key in cache else cache.setdefault(key, compile_step(spec))

    # half the smallest peak of the micro-batch-4 candidates: all of those are over it
    micro4 = [s for s in candidates(base, 4, mu_dtypes=("fp32",)) if s.batch_size == 4]
    budget = min(compiled(s)["peak_bytes"] for s in micro4) // 2
    slow = plan(base, 4, budget, mu_dtypes=("fp32",), compile_fn=compiled, analytic_first=False)
    fast = plan(base, 4, budget, mu_dtypes=("fp32",), compile_fn=compiled)
    assert slow["spec"] == fast["spec"]
    assert fast["chosen"] is None or fast["chosen"]["peak_bytes"] <= budget
    assert fast["compiles"] < slow["compiles"]
    ruled_out = [t for t in fast["tried"] if t["decided_by"] == "analytic"]
    assert ruled_out
    for t in ruled_out:
        spec = [s for s in candidates(base, 4, mu_dtypes=("fp32",))
                if (s.batch_size, str(s.remat)) == (t["batch_size"], t["remat"])][0]
        assert compiled(spec)["peak_bytes"] > budget


def test_planner_rejects_with_fake_compiler_and_errors():
    """The rule is on the compiled peak, whatever the analytic model says; errors reject."""
    base = StepSpec.of(CFG, get_precision("fp32"), RematPolicy(), 1, 24)
    peaks = iter([None, 10**9, 5 * 10**6])

    def fake(spec):
        p = next(peaks)
        if p is None:
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory while compiling")
        return {"peak_bytes": p}

    result = plan(base, 1, 6 * 10**6, mu_dtypes=("fp32",), compile_fn=fake)
    reasons = [t["reason"] for t in result["tried"]]
    assert reasons[0].startswith("compile error: RESOURCE_EXHAUSTED")
    assert "> budget" in reasons[1] and result["chosen"]["peak_bytes"] == 5 * 10**6


@pytest.mark.parametrize("fraction", [".75", ".95", None])
@pytest.mark.parametrize("device_gib", [40, pytest.param(37.5, marks=pytest.mark.slow),
                                        pytest.param(80, marks=pytest.mark.slow)])  # 3-6 s each
def test_fit_and_verdict_share_one_budget_rule(monkeypatch, device_gib, fraction):
    """A peak `plan` accepts for a GPU of `device_gib` (the budget `--fit` passes:
    verdict.usable_bytes) is one the verdict says fits on that size, and one byte more is
    rejected by both (the 37.59 GiB candidate of `--fit 40` is now refused by both at .75)."""
    from jaxmem.xla.verdict import device_gib_for, fits, usable_bytes, verdict_lines
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    if fraction is None:  # preallocation off: XLA may use all but the CUDA context
        monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    else:
        monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", fraction)
    base = StepSpec.of(CFG, get_precision("fp32"), RematPolicy(), 1, 24)
    usable = usable_bytes(device_gib)
    for peak in (usable - 1, usable, usable + 1, int(37.59 * 2**30)):
        result = plan(base, 1, usable, mu_dtypes=("fp32",), analytic_first=False,
                      compile_fn=lambda spec: {"peak_bytes": peak})
        accepted = result["chosen"] is not None
        line = verdict_lines(peak, "compiled", "gpu", "fp32", sizes=(device_gib,))[0]
        assert accepted == fits(peak, device_gib) == (peak <= usable)
        assert accepted == ("does not fit" not in line), (peak, line)
        assert device_gib_for(peak) <= device_gib or not accepted
    assert usable_bytes(device_gib_for(usable + 1)) >= usable + 1


@pytest.mark.slow  # the planner compiles one candidate (tiny, 2 layers)
def test_cli_fit_searches_the_usable_budget_and_its_verdict_agrees(capsys, monkeypatch):
    """`--fit GIB`: every candidate is judged against usable_bytes(GIB), which the JSON gives,
    and the chosen configuration's verdict names GIB among the sizes it fits."""
    from jaxmem.xla.verdict import usable_bytes
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", ".75")
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    assert main(["--preset", "tiny", "--num-layers", "2", "--seq-len", "32", "--fit", "37",
                 "--global-batch", "1", "--max-new-tokens", "0", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["usable_bytes"] == usable_bytes(37) == int(0.75 * 37 * 2**30)
    assert all(f"budget {usable_bytes(37) / 2**30:.3f} GiB" in t["reason"] for t in r["tried"])
    verdict = r["chosen"]["verdict"][0]
    assert "37 GiB" in verdict and "does not fit" not in verdict.split("37 GiB")[0][-40:]


@pytest.mark.slow  # a JAX subprocess
def test_cli_nothing_fits_exits_1():
    """A budget below the state itself: every candidate is rejected without compiling."""
    p = subprocess.run([sys.executable, "-m", "jaxmem.memory", "--preset", "tiny", "--seq-len", "32",
                        "--fit", "0.001", "--global-batch", "2"], capture_output=True, text=True,
                       env=subprocess_env())
    assert p.returncode == 1, p.stderr
    assert "nothing fits in 0.001 GiB" in p.stderr
    assert p.stdout.count("arguments alone") == len(candidates(
        StepSpec.of(get_preset("tiny"), get_precision("fp32"), RematPolicy(), 1, 32), 2))


@pytest.mark.slow  # a compile here and another in the --measure subprocess
def test_json_fields(capsys):
    assert main(["--preset", "tiny", "--num-layers", "2", "--batch-size", "2", "--seq-len", "32",
                 "--precision", "amp-bf16", "--grad-accum", "2", "--mu-dtype", "bf16",
                 "--measure", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    names = {c["name"]: c for c in r["analytic"]["components"]}
    assert names["params (compute copy)"]["dtype"] == "bfloat16"
    # mu in bf16, nu in fp32: the optimizer's own abstract state (jaxmem.memory.counted)
    assert names["optimizer: moments (bfloat16)"]["bytes"] == 2 * r["params"]
    assert names["optimizer: moments (float32)"]["bytes"] == 4 * r["params"]
    assert {c["kind"] for c in r["analytic"]["components"]} >= {"params", "optimizer state"}
    assert names["grad accumulator"]["bytes"] == 4 * r["params"]
    assert r["analytic"]["total_bytes"] == sum(c["bytes"] for c in r["analytic"]["components"]
                                                   if c["in_peak"])
    c = r["compiled"]
    assert c["peak_bytes"] == c["temp_bytes"] + c["argument_bytes"] + c["output_bytes"] - c["alias_bytes"]
    assert r["grad_accum"] == 2 and r["global_batch"] == 4 and r["precision"] == "amp-bf16"
    assert r["analytic_over_compiled"] == r["analytic"]["total_bytes"] / c["peak_bytes"]
    rule = r["rule_of_thumb"]["mixed-precision Adam (16 B/param)"]
    assert rule["bytes"] == 16 * r["params"]
    import jax
    if jax.default_backend() == "cpu":
        assert r["measured"]["peak_bytes"] is None and "no memory stats" in r["measured"]["note"]
        assert rule["ratio_to_compiled"] == rule["bytes"] / c["peak_bytes"]


@pytest.mark.parametrize("argv, needle", [
    (["--fit", "-1", "--global-batch", "4"], "argument --fit: expected a positive number of GiB"),
    # a JAX process each; slow: the first and the divisibility check run by default
    pytest.param(["--fit", "0"], "--fit", marks=pytest.mark.slow),
    (["--global-batch", "10", "--batch-size", "4"], "--global-batch 10 is not divisible by --batch-size 4"),
    pytest.param(["--fit", "8", "--global-batch", "10", "--batch-size", "4"],
                 "--global-batch 10 is not divisible", marks=pytest.mark.slow),
    pytest.param(["--global-batch", "8", "--batch-size", "4", "--grad-accum", "3"],
                 "--global-batch 8 != ", marks=pytest.mark.slow),
    pytest.param(["--precision", "fp64"], "--precision", marks=pytest.mark.slow),
])
def test_bad_input_exits_2(argv, needle):
    p = subprocess.run([sys.executable, "-m", "jaxmem.memory", *argv], capture_output=True, text=True,
                       env=subprocess_env())
    assert p.returncode == 2
    last = p.stderr.strip().splitlines()[-1]
    assert needle in last, p.stderr


@pytest.mark.gpu
def test_measured_peak_near_compiled():
    """On a GPU: the device's peak after real steps, own process, against XLA's plan."""
    spec = StepSpec.of(get_preset("small"), get_precision("fp32"), RematPolicy(), 2, 512)
    m = measure_in_subprocess(spec)
    compiled = compile_step(spec)["peak_bytes"]
    assert m["peak_bytes"] is not None
    assert 0.8 * compiled <= m["peak_bytes"] <= 1.5 * compiled


@pytest.mark.slow  # four compiles of the toy
@pytest.mark.parametrize("precision", ["fp32", "amp-bf16"])
def test_the_mu_dtype_floor_is_below_the_compiled_peak(precision):
    """search.by_speed rules a bf16 mu out when its fp32 sibling's compiled peak less 3 x the
    moments it saves (counted) is over the budget: that floor must never exceed the bf16
    candidate's own compiled peak (else a fitting candidate could be ruled out)."""
    import dataclasses

    from jaxmem.memory.search import _moment_bytes
    for remat in ("none", "full"):
        fp32 = StepSpec.of(CFG, get_precision(precision), RematPolicy.parse(remat), 2, 24,
                           mu_dtype="fp32")
        bf16 = fp32.replace(mu_dtype="bf16")
        saved = _moment_bytes(fp32) - _moment_bytes(bf16)
        assert saved > 0
        floor = compile_step(fp32)["peak_bytes"] - 3 * saved
        assert floor <= compile_step(bf16)["peak_bytes"], (remat, floor)
