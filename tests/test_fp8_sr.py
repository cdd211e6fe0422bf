"""`--precision fp8-sr`: fp8's GEMMs (jaxmem.model.fp8) on bf16-sr's weights (bf16, no fp32
master, updates rounded stochastically). Each half is checked against the mode it is taken
from: the gradients against fp8's on the same weights, the state against bf16-sr's."""

import jax
import jax.numpy as jnp
import numpy as np

import jaxmem.train.step as step_mod
from experiments.fp8_diag.driver import lower_step
from experiments.fp8_diag.hlo import fp8_dots, parse_hlo
from jaxmem.families.config import ModelConfig
from jaxmem.model.precision import get_precision
from jaxmem.train.loss import synthetic_batch
from jaxmem.train.optim import OptimConfig
from jaxmem.train.step import StepConfig, create_train_state

CFG = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  max_position_embeddings=64)
OPT = OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=2, total_steps=20, clip=1.0)


def _gradients(mode: str, params):
    """The step's gradients for `params` under `mode` (one micro-batch of 2 x 16 tokens)."""
    cfg = StepConfig(CFG, get_precision(mode), optim=OPT)
    state = create_train_state(cfg, seed=0).replace(params=params)
    x = synthetic_batch(jax.random.PRNGKey(1), 2, 16, CFG.vocab_size)
    batch = jax.tree.map(lambda a: a[None], x)
    fn = jax.jit(lambda s, b: step_mod._scaled_gradients(cfg, cfg.build_model(), s, b, None,
                                                           cfg.objective.counts(b))[0])
    return fn(state, batch)


def test_fp8_sr_gradients_are_fp8s_on_the_same_weights_rounded_to_bf16():
    # fp8 holds fp32 masters and casts them to bf16 inside the gradient; fp8-sr holds the bf16
    # weights themselves. On the same (bf16-valued) weights both run the same fp8 GEMMs, so
    # every gradient fp8-sr returns is fp8's fp32 gradient rounded to bf16.
    bf16 = create_train_state(StepConfig(CFG, get_precision("fp8-sr"), optim=OPT), seed=0).params
    assert {x.dtype for x in jax.tree.leaves(bf16)} == {jnp.dtype(jnp.bfloat16)}
    sr = _gradients("fp8-sr", bf16)
    amp = _gradients("fp8", jax.tree.map(lambda p: p.astype(jnp.float32), bf16))
    paths = jax.tree_util.tree_flatten_with_path(sr)[0]
    for (path, g), ref in zip(paths, jax.tree.leaves(amp)):
        name = jax.tree_util.keystr(path)
        assert g.dtype == jnp.bfloat16 and ref.dtype == jnp.float32, name
        rounded = np.asarray(ref.astype(jnp.bfloat16), np.float32)
        got = np.asarray(g, np.float32)
        if "norm" in name:
            # a norm's fp32 gradient is a sum over tokens, which the two programs may add in
            # another order (XLA fuses the fp32 and the bf16 parameter apart): one bf16 ulp
            np.testing.assert_allclose(got, rounded, rtol=2**-7, atol=0, err_msg=name)
        else:
            np.testing.assert_array_equal(got, rounded, err_msg=name)
    # and not bf16-sr's: the projections' gradients come from fp8 GEMMs
    plain = _gradients("bf16-sr", bf16)
    w = lambda t: np.asarray(t["layers"]["mlp"]["up_proj"], np.float32)  # noqa: E731
    assert not np.array_equal(w(sr), w(plain))
    # near it as fp8 goes (e5m2 gradients, 2 mantissa bits; 0.21 of the norm here, unrelated
    # gradients would be ~1.4)
    assert np.linalg.norm(w(sr) - w(plain)) < 0.35 * np.linalg.norm(w(plain))


def test_fp8_sr_keeps_bf16_srs_state_and_runs_fp8s_gemms():
    fp8_sr = create_train_state(StepConfig(CFG, get_precision("fp8-sr"), optim=OPT), seed=0)
    bf16_sr = create_train_state(StepConfig(CFG, get_precision("bf16-sr"), optim=OPT), seed=0)
    dtypes = lambda s: [(jax.tree_util.keystr(p), x.dtype)  # noqa: E731
                        for p, x in jax.tree_util.tree_flatten_with_path(s)[0]]
    assert dtypes(fp8_sr.params) == dtypes(bf16_sr.params)
    assert dtypes(fp8_sr.opt_state) == dtypes(bf16_sr.opt_state)  # fp32 moments, bf16 weights
    for p, q in zip(jax.tree.leaves(fp8_sr.params), jax.tree.leaves(bf16_sr.params)):
        np.testing.assert_array_equal(np.asarray(p), np.asarray(q))  # the same init
    # every projection GEMM of the step is a 2-D fp8 dot: the counts tests/test_fp8_diag.py
    # checks for fp8's step
    _, _, lowered, traced = lower_step("tiny", "fp8-sr", "full", 1, 32)
    assert sum(traced.values()) == 14
    assert fp8_dots(parse_hlo(lowered.as_text(dialect="hlo"))) == {"fp8_dots": 27,
                                                                  "fp8_dots_2d": 27}
