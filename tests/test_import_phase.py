"""A QLoRA run's import of its frozen base (jaxmem.peft.base.quantize_on_device) and the planner's
"import" phase (jaxmem.memory.phases): the layer-by-layer quantization into a donated stacked
result is bitwise the old per-layer quantization, and the phase's compiled figure is what the
import's own jitted functions compile to, read from a tiny random Hugging Face checkpoint."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hf_files import random_params
from jaxmem.families.config import ModelConfig
from jaxmem.memory import StepSpec
from jaxmem.memory.compiled import abstract_frozen, compile_phase, compiled_stats, tree_bytes
from jaxmem.memory.phases import SampleShape, run_phases
from jaxmem.model.precision import get_precision
from jaxmem.model.remat import RematPolicy
from jaxmem.peft import base as peft_base
from jaxmem.peft.lora import LoraSpec
from jaxmem.quant import QuantizedWeight, quantize_layers

# q, k/v, o (two input axes), gate/up and down: five distinct programs
CFG = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=128)


@pytest.mark.parametrize("kind, double_quant", [("nf4", True), ("nf4", False), ("int8", False)])
def test_quantize_on_device_is_bitwise_quantize_layers(kind, double_quant):
    w = np.asarray(jax.random.normal(jax.random.PRNGKey(0), (3, 64, 128)), np.float32)
    new = peft_base.quantize_on_device(w, kind, 1, 64, double_quant)
    old = quantize_layers(w, kind, 1, 64, double_quant)
    assert new.tree_flatten()[1] == old.tree_flatten()[1]
    for a, b in zip(new.tree_flatten()[0], old.tree_flatten()[0]):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))


def test_import_phase_compiles_the_imports_own_programs(tmp_path, monkeypatch):
    """Import a tiny fp32 HF checkpoint as `jaxmem.train --init-from DIR --lora-rank 8
    --quantize-base nf4 --double-quant` does (base_on_host, base_on_device), recording every
    jitted function it calls with its arguments' shapes; those compiled give, per projection,
    exactly the programs compile_phase("import", ...) compiles from the preset's shapes, and the import
    phase is the largest (program peak - its stacked result) + the whole device base."""
    from jaxmem.io.hf_export import save_hf
    hf = tmp_path / "hf"
    save_hf(hf, CFG, random_params(CFG))  # float32 safetensors + config.json
    lora = LoraSpec(8, quantize="nf4", double_quant=True)
    spec = StepSpec.of(CFG, get_precision("amp-bf16"), RematPolicy.parse("full"), 1, 32, trainable=lora)

    calls = []
    real = peft_base.layer_quantizer

    def recording(*key):
        fn = real(*key)

        def call(stacked, w, i):
            calls.append((fn, jax.tree_util.tree_map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (stacked, w, i))))
            return fn(stacked, w, i)
        return call
    monkeypatch.setattr(peft_base, "layer_quantizer", recording)
    _, host = peft_base.base_on_host(CFG, 0, str(hf))
    assert all(x.dtype == np.float32 for x in jax.tree_util.tree_leaves(host))
    frozen = peft_base.base_on_device(host, lora, spec.precision.compute_dtype)
    monkeypatch.undo()

    assert len(calls) == 7 * CFG.num_layers  # every projection, one layer per call
    shapes = lambda args: str(jax.tree_util.tree_map(  # noqa: E731
        lambda x: (x.shape, jnp.dtype(x.dtype).name), args))
    ran = {}
    for fn, args in calls:
        ran.setdefault(shapes(args), compiled_stats(fn.lower(*args).compile())[0])
    assert len(ran) == 5  # q, k/v, o, gate/up, down
    assert {id(fn) for fn, _ in calls} == {id(p["fn"]) for p in peft_base.import_programs(
        CFG, lora)}
    planned = compile_phase("import", spec)
    programs = {p["role"]: p for p in peft_base.import_programs(CFG, lora)}
    assert sorted(planned["roles"]) == sorted(programs) and len(programs) == 7
    for role, p in programs.items():  # the same function, the same shapes, the same figures
        assert p["fn"] is peft_base.layer_quantizer("nf4", 2 if role == "o_proj" else 1, 64, True)
        stats = {k: v for k, v in planned["roles"][role].items() if k != "stacked_bytes"}
        assert stats == ran[shapes(p["args"])], role
    # the stacked results the planner subtracts are the frozen base's quantized weights
    quantized = [x for x in jax.tree_util.tree_leaves(
        frozen, is_leaf=lambda x: isinstance(x, QuantizedWeight)) if isinstance(x, QuantizedWeight)]
    assert sum(p["stacked_bytes"] for p in programs.values()) == tree_bytes(quantized)
    assert tree_bytes(frozen) == tree_bytes(abstract_frozen(spec))
    assert planned["peak_bytes"] == max(s["peak_bytes"] - s["stacked_bytes"]
                                        for s in planned["roles"].values()) > 0

    r = run_phases(spec, SampleShape(max_new_tokens=0), compile=True,
                   step_compiled={"peak_bytes": 0})
    row = {x["name"]: x for x in r["phases"]}["import"]
    assert [x["name"] for x in r["phases"]][0] == "import"
    assert row["outside_bytes"] == tree_bytes(frozen)
    assert row["compiled_bytes"] == planned["peak_bytes"] + tree_bytes(frozen)
    assert row["analytic_bytes"] >= tree_bytes(frozen)


def test_import_phase_of_an_unquantized_base_is_the_base():
    spec = StepSpec.of(CFG, get_precision("amp-bf16"), RematPolicy.parse("full"), 1, 32,
                       trainable=LoraSpec(8))
    assert compile_phase("import", spec) == {"peak_bytes": 0, "roles": {}}
    r = run_phases(spec, SampleShape(max_new_tokens=0), compile=True,
                   step_compiled={"peak_bytes": 0})
    row = {x["name"]: x for x in r["phases"]}["import"]
    assert row["compiled_bytes"] == row["outside_bytes"] == tree_bytes(abstract_frozen(spec))
    full = StepSpec.of(CFG, get_precision("fp32"), RematPolicy.parse("full"), 1, 32)
    assert "import" not in {x["name"] for x in run_phases(full, SampleShape(max_new_tokens=0))[
        "phases"]}
