"""--optimizer-in-backward with each layer's MLP in slabs of F (jaxmem.train.inbackward_slabs):
the rule that picks the width, the family block's two halves, a slab's update against the
layer's, the ordinary step's losses, and the host-resident state bitwise the device run. The
tiny preset's MLP is below the rule's SLAB, so the tests lower SLAB (as 8B's 4096 x 14336
weights are cut: 14 slabs of 1,024)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem.train.inbackward as inbackward
import jaxmem.train.inbackward_rules as rules
from jaxmem.families import get_preset
from jaxmem.families.decoder import DecoderBlock, layer_context
from jaxmem.families.params import init_params
from jaxmem.model.precision import get_precision
from jaxmem.model.remat import RematPolicy
from jaxmem.train.loss import synthetic_batch
from jaxmem.train.optim import OptimConfig, make_optimizer, build_optimizer
from jaxmem.train.placement import Placement
from jaxmem.train.step import StepConfig

from numerics import assert_after_adam
from test_inbackward import _both, _configs


def _step_config(optimizer="adamw8bit", precision="bf16-sr", **model):
    return StepConfig(get_preset("llama-3-8b", **model), get_precision(precision),
                      RematPolicy("full"), OptimConfig(optimizer=optimizer, clip=0.0,
                                                       in_backward=True))


def test_the_slab_width_rule():
    """8B's MLP (4096 x 14336, the 8-bit state's blocks of 256): the widest slab of at most
    SLAB = 2^22 elements, 1,024; none where it is not worth it, cannot be cut, or is not
    asked for."""
    c = get_preset("llama-3-8b")
    assert rules.mlp_slab_width(c, 256) == 1024 and 14336 % 1024 == 0
    assert rules.mlp_slab_width(c, 1) == 1024  # 14336 = 2^11 x 7: 2048 is over SLAB
    assert rules.mlp_slab_width(c, None) == 0  # a state that cannot be cut
    assert rules.mlp_slab_width(get_preset("tiny"), 1) == 0  # D x F within one slab
    for placement in ("sandwich", "post"):  # Gemma 3's and OLMo 2's post-MLP norm
        assert rules.mlp_slab_width(c.replace(norm_placement=placement), 256) == 0
    cfg = _step_config()
    assert rules.mlp_slabs(cfg, 2048) == 1024
    assert rules.mlp_slabs(cfg, 2048, params_on_host=True) == 0  # whole layers streamed
    assert rules.mlp_slabs(cfg, 3 * 4096 + 1) == 0  # the MLP in sequence tiles instead
    assert rules.mlp_slabs(_step_config(precision="fp8"), 2048) == 0  # fp8's own einsum


@pytest.mark.parametrize("family", [{}, dict(family="qwen3", qk_norm=True)])
def test_the_attention_half_and_the_mlp_half_compose_the_block(family):
    c = get_preset("tiny", **family)
    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (2, 16, c.hidden_size))
    ctx = layer_context(c, (2, 16))
    block = DecoderBlock(c)
    params = block.init(key, x, ctx)["params"]
    whole = block.apply({"params": params}, x, ctx)[0]
    mid = DecoderBlock(c, part="attention").apply({"params": params}, x, ctx)[0]
    m = DecoderBlock(c, part="mlp").apply({"params": params}, mid, ctx)[0]
    np.testing.assert_array_equal(np.asarray(mid + m), np.asarray(whole))
    # and the MLP's output is the sum of its slabs' (gate and up columns, down rows)
    mlp = params["mlp"]
    w = c.intermediate_size // 3
    half = DecoderBlock(c.replace(intermediate_size=w), part="mlp")
    parts = [half.apply({"params": {**params, "mlp": {
        "gate_proj": mlp["gate_proj"][:, s:s + w], "up_proj": mlp["up_proj"][:, s:s + w],
        "down_proj": mlp["down_proj"][s:s + w]}}}, mid, ctx)[0] for s in range(0, 3 * w, w)]
    np.testing.assert_allclose(np.asarray(sum(parts)), np.asarray(m), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("optimizer", ["adamw8bit", "adamw"])
def test_slab_updates_are_the_layer_update(optimizer):
    """Every slab of layer l of an MLP weight (columns of gate, rows of down) updated with
    Parts.slab gives Parts.layer's update of the layer: the same arithmetic on each element
    (fp32 weights: no rounding bits). adamw8bit's blocks run along the last axis: the column
    slabs hold whole blocks."""
    model = get_preset("tiny", intermediate_size=512)
    cfg = OptimConfig(optimizer=optimizer, clip=0.0, lr=1e-2, warmup_steps=0, total_steps=20)
    params = init_params(model, jax.random.PRNGKey(0))
    state = make_optimizer(cfg).init(params)
    leaves, treedef = jax.tree.flatten(params)
    grads = [jax.random.normal(jax.random.PRNGKey(9 + i), x.shape) for i, x in enumerate(leaves)]
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    l, w, yes = 1, 256, jnp.asarray(True)
    for name, axis in (("['gate_proj']", 2), ("['down_proj']", 1)):
        i = next(k for k, p in enumerate(paths) if p.endswith(name))

        def layer(p, s, g):
            parts = build_optimizer(cfg, False).split(treedef.unflatten(leaves), state)
            return parts.layer(i, jnp.int32(l), g[l], p, s, yes)

        def slabs(p, s, g):
            parts = build_optimizer(cfg, False).split(treedef.unflatten(leaves), state)
            assert parts.slab_block(i, axis) == (256 if axis == 2 and optimizer == "adamw8bit"
                                                 else 1)
            for start in range(0, 512, w):
                gs = jax.lax.slice_in_dim(g[l][None], start, start + w, axis=axis)
                p, s = parts.slab(i, jnp.int32(l), axis, jnp.int32(start), gs, p, s, yes)
            return p, s

        parts0 = build_optimizer(cfg, False).split(params, state)
        args = (leaves[i], parts0.states[i], grads[i])
        a, b = jax.jit(layer)(*args), jax.jit(slabs)(*args)
        assert not np.array_equal(np.asarray(a[0]), np.asarray(leaves[i]))  # it moved
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            if optimizer == "adamw8bit":  # the fused piece, shared: bitwise
                np.testing.assert_array_equal(np.asarray(y), np.asarray(x), err_msg=name)
            else:  # optax's arithmetic, fused per shape: fp32 rounding apart at most
                np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-6,
                                           atol=1e-7, err_msg=name)


def _counting(monkeypatch):
    """Lower SLAB so the tiny MLP (D = 128, F = 512) runs in 2 slabs, and count the layers
    traced so."""
    monkeypatch.setattr(rules, "SLAB", 128 * 256)
    calls = []
    real = inbackward.layer_in_slabs
    monkeypatch.setattr(inbackward, "layer_in_slabs",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.slow  # two tiny steps compiled, 5 steps each
def test_in_slabs_the_step_gives_the_ordinary_steps_fp32_losses(monkeypatch):
    """fp32 AdamW: the losses equal the ordinary step's to 1e-6, the weights to 1e-4 but the
    few at rounding level that Adam moves by up to lr a step (numerics.assert_after_adam; seen:
    1 of the 33,152 head elements 1.4e-4 apart). (8-bit AdamW's stochastic moments hash the
    moments' fp32 bits, so d(x) summed over the slabs in another order picks other codes: its
    slabs are checked against the layer update above.)"""
    calls = _counting(monkeypatch)
    ordinary, oib = _configs("adamw")
    model = dataclasses.replace(ordinary.model, intermediate_size=512)
    ordinary, oib = (dataclasses.replace(c, model=model) for c in (ordinary, oib))
    assert rules.mlp_slabs(oib, 32) == 256  # 2 slabs
    s1, s2 = _both(ordinary, oib, 5, 259)
    assert calls  # the layers ran in slabs
    assert_after_adam(s2.params, s1.params, 5, lr=1e-2)


@pytest.mark.slow  # two tiny steps compiled, 6 steps each
def test_in_slabs_the_host_state_is_bitwise_the_device_run(monkeypatch):
    """bf16-sr + adamw8bit with the optimizer state in pinned host memory: each slab's state
    comes in and goes back; the losses and the state are the device-resident run's, bitwise."""
    calls = _counting(monkeypatch)
    cfg = StepConfig(get_preset("tiny", intermediate_size=512), get_precision("bf16-sr"),
                     RematPolicy("full"), OptimConfig(optimizer="adamw8bit", clip=0.0, lr=1e-2,
                                                      warmup_steps=2, total_steps=20,
                                                      in_backward=True))
    runs = {}
    for name, par in (("device", Placement.single()), ("host", Placement.single("host"))):
        s = par.init_state(cfg, None, 1)
        step, ls = par.train_step(cfg, s), []
        for k in range(6):
            s, m = step(s, jax.tree.map(lambda x: x[None],
                                        synthetic_batch(jax.random.PRNGKey(k), 2, 16, 259)))
            ls.append(float(m["loss"]))
        runs[name] = ls, s
    (l1, s1), (l2, s2) = runs["device"], runs["host"]
    assert calls and l1 == l2 and l1[-1] != l1[0]
    for a, b in zip(jax.tree.leaves(s1), jax.tree.leaves(s2)):
        np.testing.assert_array_equal(np.asarray(a).reshape(-1).view(np.uint8),
                                      np.asarray(b).reshape(-1).view(np.uint8))
