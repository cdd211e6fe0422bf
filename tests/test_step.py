"""The train step: skip-on-overflow, clipping after unscale, accumulation, precision dtypes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem.train.step as step_mod
from jaxmem.families.config import ModelConfig
from jaxmem.train.loss import synthetic_batch
from jaxmem.optim import DynamicLossScale, StaticLossScale
from jaxmem.train.optim import OptimConfig, decay_mask, parse_loss_scale
from jaxmem.model.precision import get_precision
from jaxmem.train.step import StepConfig, create_train_state, jit_train_step

CFG = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  max_position_embeddings=64)
OPT = OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=2, total_steps=20, clip=1.0)


def batch(k=1, b=2, t=16, seed=1):
    x = synthetic_batch(jax.random.PRNGKey(seed), k * b, t, CFG.vocab_size)
    return jax.tree_util.tree_map(lambda a: a.reshape(k, b, t), x)


def state_for(precision, loss_scale=None, optim=OPT, **kw):
    cfg = StepConfig(CFG, get_precision(precision), optim=optim, **kw)
    ls = loss_scale if loss_scale is not None else parse_loss_scale(cfg.precision.loss_scale)
    return cfg, create_train_state(cfg, ls, seed=0)


def host(tree):
    return jax.tree_util.tree_map(np.asarray, tree)


def assert_trees_equal(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("poison", [jnp.inf, pytest.param(jnp.nan, marks=pytest.mark.slow)])
def test_non_finite_step_changes_nothing_and_halves_scale(poison, monkeypatch):
    cfg, state = state_for("amp-fp16")
    step = jit_train_step(cfg)
    state, m = step(state, batch())  # one real update first, so Adam's state is non-trivial
    assert not bool(m["skipped"])
    before = host(state)

    import jaxmem.objective.base as objective_base  # the causal-LM objective's loss
    real = objective_base.token_loss
    monkeypatch.setattr(objective_base, "token_loss",
                        lambda *a: (real(*a)[0] * poison, real(*a)[1]))
    poisoned = jit_train_step(cfg)
    after, m = poisoned(state, batch(seed=2))
    assert bool(m["skipped"])
    assert_trees_equal(after.params, before.params)
    assert_trees_equal(after.opt_state, before.opt_state)  # Adam's mu, nu and count included
    assert int(after.applied) == int(before.applied)  # schedule position did not advance
    assert int(after.step) == int(before.step) + 1 and int(after.skips_in_a_row) == 1
    assert float(after.loss_scale.loss_scale) == float(before.loss_scale.loss_scale) / 2
    assert float(m["lr"]) == float(OPT and step_mod.schedule(OPT)(before.applied))


def test_overflow_from_a_too_large_scale_is_skipped():
    """fp16 really overflows with scale 2**30: the step is skipped, the scale backs off."""
    cfg, state = state_for("amp-fp16", DynamicLossScale.create(2.0**30))
    before = host(state.params)
    state, m = jit_train_step(cfg)(state, batch())
    assert bool(m["skipped"]) and float(state.loss_scale.loss_scale) == 2.0**29
    assert_trees_equal(state.params, before)


@pytest.mark.parametrize("precision, optimizer", [
    ("amp-fp16", "adamw"), pytest.param("bf16-sr", "adamw8bit", marks=pytest.mark.slow),
    pytest.param("bf16-sr", "adamw", marks=pytest.mark.slow)])
def test_the_step_has_no_conditional(precision, optimizer, monkeypatch):
    """The train step built for a GPU skips a non-finite step without a conditional
    (jaxmem.optim's `where` contract): a lax.cond whose branches return params and optimizer
    state gets its own copies of them in the GPU program's buffers (12 fp32 copies of the 1B
    model's MLP stacks). The GPU's form is forced here (jaxmem.optim._apply._guard_form; the
    CPU's own is a cond, tests/test_optim_api.py), the program compiled by XLA:CPU."""
    from jaxmem.optim import _apply
    monkeypatch.setattr(_apply, "_guard_form", lambda: "select")
    cfg, state = state_for(precision, optim=OptimConfig(lr=1e-2, total_steps=20,
                                                        optimizer=optimizer))
    hlo = jit_train_step(cfg).lower(state, batch()).compile().as_text()
    assert " conditional(" not in hlo


@pytest.mark.slow  # two train-step compiles: 11 s of CPU cold
def test_clipping_sees_unscaled_gradients():
    """A static scale of 1024 with clip 0.05 must give the update of no scale with clip 0.05."""
    opt = OptimConfig(lr=1e-2, warmup_steps=0, total_steps=10, clip=0.05)
    cfg_a, a = state_for("fp32", StaticLossScale(jnp.float32(1024.0)), optim=opt)
    cfg_b, b = state_for("fp32", optim=opt)
    a, ma = jit_train_step(cfg_a)(a, batch())
    b, mb = jit_train_step(cfg_b)(b, batch())
    assert float(ma["grad_norm"]) > 0.05  # clipping is active
    np.testing.assert_allclose(float(ma["grad_norm"]), float(mb["grad_norm"]), rtol=1e-6)
    # atol 2e-7 (was 1e-7): with the fused loss (jaxmem.loss.chunked) the two programs
    # fuse the loss's scans differently; measured: 1 of 8288 entries 1.3e-7 apart after Adam.
    for x, y in zip(jax.tree_util.tree_leaves(a.params), jax.tree_util.tree_leaves(b.params)):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=2e-7)


@pytest.mark.slow  # two more train-step compiles
def test_amp_fp16_update_close_to_fp32():
    cfg_a, a = state_for("amp-fp16")
    cfg_b, b = state_for("fp32")
    a, ma = jit_train_step(cfg_a)(a, batch())
    b, mb = jit_train_step(cfg_b)(b, batch())
    np.testing.assert_allclose(float(ma["loss"]), float(mb["loss"]), rtol=2e-3)
    np.testing.assert_allclose(float(ma["grad_norm"]), float(mb["grad_norm"]), rtol=2e-2)
    assert a.params["embed_tokens"].dtype == jnp.float32  # fp32 master weights


@pytest.mark.slow  # two train-step compiles: 11 s of CPU cold
def test_grad_accumulation_equals_one_large_batch():
    big = batch(k=1, b=8)
    micro = jax.tree_util.tree_map(lambda a: a.reshape(4, 2, 16), big)
    cfg1, s1 = state_for("fp32")
    cfg4, s4 = state_for("fp32", grad_accum=4)
    s1, m1 = jit_train_step(cfg1)(s1, big)
    s4, m4 = jit_train_step(cfg4)(s4, micro)
    np.testing.assert_allclose(float(m4["loss"]), float(m1["loss"]), rtol=1e-6)
    np.testing.assert_allclose(float(m4["grad_norm"]), float(m1["grad_norm"]), rtol=1e-5)
    for x, y in zip(jax.tree_util.tree_leaves(s4.params), jax.tree_util.tree_leaves(s1.params)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)
    assert int(s4.data_position) == 4 and int(s1.data_position) == 1


def test_state_dtypes_per_mode():
    _, bf16 = state_for("bf16")
    assert {x.dtype for x in jax.tree_util.tree_leaves(bf16.params)} == {jnp.dtype(jnp.bfloat16)}
    mu = bf16.opt_state[1][0].mu
    assert {x.dtype for x in jax.tree_util.tree_leaves(mu)} == {jnp.dtype(jnp.bfloat16)}
    _, amp = state_for("amp-bf16", optim=OptimConfig(mu_dtype="bf16"))
    assert {x.dtype for x in jax.tree_util.tree_leaves(amp.params)} == {jnp.dtype(jnp.float32)}
    mu = amp.opt_state[1][0].mu
    nu = amp.opt_state[1][0].nu
    assert {x.dtype for x in jax.tree_util.tree_leaves(mu)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree_util.tree_leaves(nu)} == {jnp.dtype(jnp.float32)}
    # docs/precision.md: in the master-weight modes the loss casts the matrices to the compute
    # dtype and leaves the norm weights fp32; pure bf16 stores the norm weights in bf16 too.
    from jaxmem.model.precision import cast_params
    computed = cast_params(amp.params, jnp.bfloat16)
    assert computed["norm"]["scale"].dtype == jnp.float32
    assert computed["layers"]["post_attention_layernorm"]["scale"].dtype == jnp.float32
    assert computed["layers"]["mlp"]["up_proj"].dtype == jnp.bfloat16
    assert bf16.params["norm"]["scale"].dtype == jnp.bfloat16


def test_no_weight_decay_on_norms_and_embeddings():
    _, s = state_for("fp32")
    mask = decay_mask(s.params)
    assert not mask["embed_tokens"] and not mask["norm"]["scale"]
    assert not mask["layers"]["input_layernorm"]["scale"]  # [L, D]: 2-D but a norm
    assert mask["layers"]["mlp"]["up_proj"] and mask["lm_head"]
    assert decay_mask(s.params, decay_embeddings=True)["embed_tokens"]


@pytest.mark.parametrize("precision", ["fp32", pytest.param("bf16", marks=pytest.mark.slow),
                                       pytest.param("amp-bf16", marks=pytest.mark.slow),
                                       pytest.param("amp-fp16", marks=pytest.mark.slow),
                                       pytest.param("fp8", marks=pytest.mark.slow),
                                       pytest.param("fp8-sr", marks=pytest.mark.slow)])
@pytest.mark.slow  # 3.2 s cold on 2 cores (default run kept under 5 min)
def test_every_mode_lowers_the_loss(precision):
    cfg, state = state_for(precision)
    step = jit_train_step(cfg)
    b = batch(b=4)
    losses = []
    for _ in range(8):
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    assert np.isfinite(losses).all() and losses[-1] < losses[0] - 0.3


def test_schedule_warmup_then_cosine_to_floor():
    sched = step_mod.schedule(OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=4, total_steps=12))
    np.testing.assert_allclose([float(sched(i)) for i in (0, 2, 4, 12, 20)],
                               [0.0, 0.5, 1.0, 0.1, 0.1], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("field, value", [("lr", float("nan")), ("lr", -1.0), ("total_steps", 0),
                                          ("mu_dtype", "fp8")])
def test_optim_config_errors(field, value):
    with pytest.raises(ValueError, match=field.replace("_", "[-_]")):
        OptimConfig(**{field: value})
