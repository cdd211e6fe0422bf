"""fp8 on the H100's own compiler without a GPU (jaxmem.target): every projection GEMM of an fp8
train step is an fp8 GEMM, with jaxmem's compiler options (jaxmem.model.fp8_compile.COMPILER_OPTIONS_FP8).

The step (preset small, 2 layers, remat full, 1 x 256) is compiled for a deviceless H100 and its
optimized HLO is read: each GEMM whose op_name is one of a decoder layer's projections
(self_attn / mlp Projection_i) must be a `__cublas$lt$matmul$f8` call or a Triton GEMM fusion
fed by f8 arrays. One layer's body holds 27 of them: the 7 projections forward, 6 again in the
remat recompute (down_proj's output only feeds the residual add, which the backward does not
need) and 2 x 7 in the backward (dx and dw). XLA's defaults break the claim (checked below):
Triton GEMMs leave no f8 array in the program, and without Triton the dot merger concatenates
q/k/v and gate/up into bf16 GEMMs.
"""

from __future__ import annotations

import re

import pytest

from experiments.fp8_diag.hlo import F8_TARGET, GEMM_TARGETS, parse_hlo
from experiments.fp8_diag.table import step_table
from jaxmem import target
from jaxmem.config.run import RunConfig
from jaxmem.memory.spec import StepSpec
from jaxmem.model.fp8_compile import COMPILER_OPTIONS_FP8

pytestmark = pytest.mark.gpu_target

LAYERS, PROJECTIONS = 2, 7
# forward, remat recompute (without down_proj), dx and dw: 27 GEMMs in a layer's loop bodies
PER_LAYER = PROJECTIONS + (PROJECTIONS - 1) + 2 * PROJECTIONS
_PROJECTION = re.compile(r"/layers/(self_attn|mlp)/Projection_\d+/")


def compile_fp8_step(options: dict | None = None, mode: str = "fp8") -> str:
    """The optimized HLO text of the fp8 step (`mode`: fp8 or fp8-sr) compiled for a deviceless
    H100: `jit_train_step` as a library user calls it (options None), or the bare jitted step
    with `options`."""
    import jax
    from jaxmem.train.run import abstract_step_args
    from jaxmem.train.step import jit_train_step, make_train_step
    target.prepare()  # a no-op here (JAX started on the CPU): per-compile options carry the flags
    cfg = RunConfig().replace({
        "model.preset": "small", "model.num_layers": LAYERS, "precision.mode": mode,
        "remat.policy": "full", "data.batch_size": 1, "data.seq_len": 256})
    sp = StepSpec.from_run_config(cfg)
    with target.compiling_for("h100"):
        step_cfg, loss_scale = sp.step_config()
        args = abstract_step_args(step_cfg, loss_scale, 1, 256, 1)
        if options is None:
            return jit_train_step(step_cfg).lower(*args).compile().as_text()
        return jax.jit(make_train_step(step_cfg), donate_argnums=0).lower(*args).compile(
            compiler_options=dict(options)).as_text()


def projection_gemms(text: str) -> list[tuple[str, bool]]:
    """(op_name, is fp8) for each GEMM of a layer projection in the module text (one layer's
    forward and backward loop bodies: the text holds a loop body once)."""
    comps = parse_hlo(text)
    found = []
    for c in comps.values():
        for instr in c["instrs"].values():
            name = re.search(r'op_name="([^"]+)"', instr["attrs"])
            if name is None or not _PROJECTION.search(name.group(1)):
                continue
            target_ = re.search(r'custom_call_target="([^"]+)"', instr["attrs"])
            if target_ and target_.group(1) in (F8_TARGET, *GEMM_TARGETS):
                found.append((name.group(1), target_.group(1) == F8_TARGET))
            elif instr["op"] == "fusion" and "gemm" in instr["attrs"]:
                called = re.search(r"calls=%?([\w.\-]+)", instr["attrs"]).group(1)
                f8 = any(i["op"] == "parameter" and i["type"].startswith("f8")
                         for i in comps[called]["instrs"].values())
                found.append((name.group(1), f8))
    return found


@pytest.fixture(scope="module")
def fp8_step():
    return compile_fp8_step(COMPILER_OPTIONS_FP8)


def test_jit_train_step_alone_compiles_fp8_gemms():
    # a library user's jit_train_step, with no XLA_FLAGS and no options of its own, in fp8-sr
    # (bf16 weights, no fp32 master): the options come from the mode's `fp8` flag
    # (fp8_compile.compiler_options), which fp8 shares; fp8 itself is compiled with them below
    gemms = projection_gemms(compile_fp8_step(mode="fp8-sr"))
    assert len(gemms) == PER_LAYER and all(f8 for _, f8 in gemms)


def test_every_projection_gemm_is_fp8_with_jaxmems_options(fp8_step):
    gemms = projection_gemms(fp8_step)
    assert len(gemms) == PER_LAYER and all(f8 for _, f8 in gemms), \
        [n.split("/layers/")[-1] for n, f8 in gemms if not f8]
    t = step_table(fp8_step)
    # per step: each layer's body runs once per layer; the LM head's GEMMs are the only wider ones
    assert t["gemms"]["cublasLt f8"]["count"] == LAYERS * PER_LAYER
    assert not any(k.startswith("triton") for k in t["gemms"])
    # The passes scaling adds, stated (per layer; none outside the layers): 27 fusions that end
    # in an amax reduction (the inputs x, shared by q/k/v and by gate/up, the 7 weights and the
    # 7 incoming gradients, forward and remat recompute) and 49 that write f8 arrays (the
    # quantize converts, and the fp8 transposes that give the backward's GEMMs their TN layout).
    # Each is a pass over its tensor that amp-bf16 does not make.
    scaling = {k: v["count"] for k, v in t["scaling"].items()}
    assert scaling == {"amax": 27 * LAYERS, "quantize": 49 * LAYERS}, scaling


@pytest.mark.slow  # two more compiles (~40 s): the evidence that the options are needed
@pytest.mark.parametrize("options, why", [
    ({}, "Triton GEMMs (XLA's default): bf16 GEMM fusions, no f8 array left"),
    ({"xla_gpu_enable_triton_gemm": False}, "the dot merger: q/k/v (and gate/up) in bf16"),
])
def test_xla_defaults_break_the_claim(options, why):
    gemms = projection_gemms(compile_fp8_step(options))
    assert sum(f8 for _, f8 in gemms) < PER_LAYER, why
