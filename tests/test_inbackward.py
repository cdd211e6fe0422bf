"""--optimizer-in-backward (jaxmem.train.inbackward): the ordinary step's losses, its update to
the bit, exact resume, the refused combinations, and the whole gradient tree gone from memory."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem.optim._stochastic as sr
from jaxmem.families import get_preset
from jaxmem.families.params import init_params
from jaxmem.model.precision import get_precision
from jaxmem.model.remat import RematPolicy
from jaxmem.train.cli import main
from jaxmem.train.loss import synthetic_batch
from jaxmem.train.optim import OptimConfig, build_optimizer, make_optimizer
from jaxmem.train.run import compile_run_step
from jaxmem.train.step import StepConfig, create_train_state, make_train_step

from numerics import assert_after_adam
from runs import SMALL, error_line, losses, params_of


FAMILIES = {"llama": {}, "qwen3": dict(family="qwen3", qk_norm=True),
            "qwen2": dict(family="qwen2", qkv_bias=True),
            # Gemma 3's variation points; a window of 4 < the 16 tokens, three local layers
            # then a global one
            "gemma3": dict(family="gemma3", qk_norm=True, norm_plus_one=True,
                           norm_placement="sandwich", mlp_activation="gelu_tanh",
                           embed_scale=True, query_pre_attn_scalar=24,
                           sliding_window=4, rope_local_theta=500.0, rope_type="linear",
                           rope_factor=2.0, layer_types=("sliding_attention",) * 3
                           + ("full_attention",)),
            "phi3": dict(family="phi3", partial_rotary_factor=0.5),
            # OLMo 2's post-norms and QK-norm over the whole projections
            "olmo2": dict(family="olmo2", norm_placement="post", qk_norm=True,
                          qk_norm_scope="projection")}


def _configs(optimizer, precision="fp32", tie=False, family="llama", **optim):
    model = get_preset("tiny", tie_embeddings=tie, **FAMILIES[family])
    ordinary = StepConfig(model, get_precision(precision), RematPolicy("full"),
                          OptimConfig(optimizer=optimizer, clip=0.0, lr=1e-2, warmup_steps=2,
                                      total_steps=20, **optim))
    return ordinary, dataclasses.replace(
        ordinary, optim=dataclasses.replace(ordinary.optim, in_backward=True))


def _both(ordinary, oib, steps: int, vocab: int):
    """`steps` steps of the ordinary and the in-backward step from one seed on the same batches:
    their fp32 losses (1e-6), grad norms (1e-5) and learning rates (equal) agree, and it
    trained; -> (ordinary state, in-backward state)."""
    s1, s2 = create_train_state(ordinary, seed=1), create_train_state(oib, seed=1)
    f1, f2 = jax.jit(make_train_step(ordinary)), jax.jit(make_train_step(oib))
    l1, l2 = [], []
    for k in range(steps):
        batch = jax.tree.map(lambda x: x[None],
                             synthetic_batch(jax.random.PRNGKey(k), 2, 16, vocab))
        s1, m1 = f1(s1, batch)
        s2, m2 = f2(s2, batch)
        l1.append(float(m1["loss"]))
        l2.append(float(m2["loss"]))
        np.testing.assert_allclose(float(m2["grad_norm"]), float(m1["grad_norm"]), rtol=1e-5)
        np.testing.assert_allclose(float(m2["lr"]), float(m1["lr"]), rtol=0)
    np.testing.assert_allclose(l2, l1, rtol=1e-6)
    assert l1[-1] != l1[0]  # it trained
    return s1, s2


@pytest.mark.slow  # two tiny steps compiled per case, 10 steps each
@pytest.mark.parametrize("optimizer,tie,family", [
    ("adamw", False, "llama"), ("adamw8bit", False, "llama"), ("lion", True, "llama"),
    # qwen3, qwen2 and olmo2 nightly: the in-backward update is the same per-layer code for every
    # family; gemma3 and phi3, the layouts furthest from Llama's, run in CI
    pytest.param("adamw", True, "qwen3", marks=pytest.mark.nightly),
    pytest.param("adamw8bit", False, "qwen2", marks=pytest.mark.nightly),
    ("adamw", True, "gemma3"), ("adamw", True, "phi3"),
    pytest.param("adamw8bit", False, "olmo2", marks=pytest.mark.nightly)])
def test_fp32_losses_equal_the_ordinary_step_for_10_steps(optimizer, tie, family):
    """Each family's block through the in-backward step, built on the model's parts (Qwen3's
    QK-norm, Qwen2's biases, Gemma 3's scaled embedding, sandwich norms and local and global
    layers, Phi-3's partial rotary, OLMo 2's post-norms and whole-projection QK-norm), gives the
    ordinary step's losses."""
    ordinary, oib = _configs(optimizer, tie=tie, family=family)
    s1, s2 = _both(ordinary, oib, 10, 259)
    assert int(s2.step) == int(s2.applied) == 10 and int(s2.skips_in_a_row) == 0
    for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s2.params)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # two tiny steps compiled
def test_the_head_updated_a_vocabulary_slice_at_a_time_gives_the_ordinary_losses(monkeypatch):
    """The untied head's gradient made and applied in several vocabulary slices (a small CHUNK
    bounds a slice's update as 8B's 2^24 does): the ordinary step's fp32 losses and weights.
    AdamW: adamw8bit's stochastic moments hash each new moment's fp32 bits, so the
    rounding-level differences of d(x) summed over the slices in another order pick other 8-bit
    codes (seen: weights 2.5e-3 apart after the first update), a divergence of the rounding,
    not of the function; its slices are checked against its whole-leaf update bitwise instead
    (tests/test_partwise.py) and host against device with sliced heads
    (tests/test_offload_optimizer.py)."""
    optimizer, steps = "adamw", 5
    from jaxmem.train.inbackward_rules import head_slice
    monkeypatch.setattr(sr, "CHUNK", 2**15)  # D x Vc <= 2^15: slices of 256 of the 512
    ordinary, oib = _configs(optimizer)
    model = dataclasses.replace(ordinary.model, vocab_size=512)
    ordinary, oib = (dataclasses.replace(c, model=model) for c in (ordinary, oib))
    vc = head_slice((model.hidden_size, 512), 1, 32)
    assert 0 < vc < 512, vc  # several slices
    s1, s2 = _both(ordinary, oib, steps, 512)
    # d(x) is summed over the slices in another order: Adam's m / (sqrt(v) + eps) moves an
    # element whose gradient is at rounding level by up to lr (1e-2) a step either way; seen:
    # 2 of 65,536 head elements 9e-5 apart after 5 steps, and, since the fused loss's d(x)
    # leaves its GEMM in fp32 (jaxmem.loss.chunked._head_grads), 1 of them 1.4e-4 apart
    assert_after_adam(s2.params, s1.params, steps, lr=1e-2)
    assert not np.allclose(np.asarray(s2.params["lm_head"]),
                           np.asarray(create_train_state(oib, seed=1).params["lm_head"]))


def _whole_and_layerwise(cfg, model, rounds):
    """The ordinary update of the whole tree, and the layer-by-layer one, as jitted functions
    (params, opt_state, grads, key) -> (params, opt_state). XLA may keep bf16 arithmetic in
    more precision where it fuses (xla_allow_excess_precision), which depends on the program's
    shape, so both compile without it: the comparison is then of the update's own numbers."""
    options = {"xla_allow_excess_precision": False}

    def whole(params, st, g, key):
        return build_optimizer(cfg, rounds).apply.update_and_apply(g, st, params, key=key)

    def layerwise(params, st, g, key):
        parts = build_optimizer(cfg, rounds).split(params, st, key)
        paths, treedef = jax.tree_util.tree_flatten_with_path(params)
        stacked = [i for i, (path, _) in enumerate(paths) if path[0].key == "layers"]
        leaves, grads = [x for _, x in paths], jax.tree.leaves(g)
        new_l, new_s = list(leaves), list(parts.states)
        yes = jnp.asarray(True)
        for i in range(len(leaves)):
            if i not in stacked:
                new_l[i], new_s[i] = parts.leaf(i, grads[i], leaves[i], new_s[i], yes)
        for l in reversed(range(model.num_layers)):  # as the backward pass does
            for i in stacked:
                new_l[i], new_s[i] = parts.layer(i, jnp.int32(l), grads[i][l], new_l[i],
                                                 new_s[i], yes)
        return treedef.unflatten(new_l), parts.finish(new_s)

    return (jax.jit(whole, compiler_options=options),
            jax.jit(layerwise, compiler_options=options))


@pytest.mark.slow  # 6 x 2 optimizer programs
@pytest.mark.parametrize("optimizer", ["adamw8bit", "adamw", "lion"])
@pytest.mark.parametrize("chunk", [2**24, 2**11, 2**8])
def test_bf16_sr_update_layer_by_layer_is_the_whole_tree_update(optimizer, chunk,
                                                                         monkeypatch):
    # small CHUNKs cut the stacked leaves into row pieces as 8B-sized leaves are: several
    # pieces per layer (their own keys), and several layers per piece (bits cut out of it)
    monkeypatch.setattr(sr, "CHUNK", chunk)
    model = get_preset("tiny")
    cfg = OptimConfig(optimizer=optimizer, clip=0.0, lr=1e-2, warmup_steps=0, total_steps=20)
    params = init_params(model, jax.random.PRNGKey(0), dtype=jnp.bfloat16)
    state = make_optimizer(cfg).init(jax.tree.map(lambda p: jnp.zeros(p.shape), params))
    whole, layerwise = _whole_and_layerwise(cfg, model, rounds=True)
    a, b = (params, state), (params, state)
    leaves, treedef = jax.tree.flatten(params)
    for k in range(3):
        grads = treedef.unflatten([jax.random.normal(jax.random.PRNGKey(100 * k + i), x.shape,
                                                     x.dtype) for i, x in enumerate(leaves)])
        key = jax.random.PRNGKey(7 + k)
        a, b = whole(*a, grads, key), layerwise(*b, grads, key)
        for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
            where = f"step {k}: {jax.tree_util.keystr(path)}"
            if optimizer == "adamw8bit":  # the fused piece, shared: bitwise
                np.testing.assert_array_equal(np.asarray(y), np.asarray(x), err_msg=where)
            else:  # optax's bf16 update: now and then 1 ulp (~6e-5 at lr 1e-2) apart
                np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(x, np.float32),
                                           rtol=2**-7, atol=1e-4, err_msg=where)
    assert not all(np.array_equal(x, y) for x, y in zip(leaves, jax.tree.leaves(a[0])))


OIB = ["--optimizer-in-backward", "--remat", "full", "--clip", "0"]


@pytest.mark.slow  # three CLI runs
def test_resume_is_bitwise_exact(tmp_path, corpus):
    args = [*SMALL, "--data", corpus, "--steps", "6", "--precision", "bf16-sr",
            "--optimizer", "adamw8bit", *OIB]
    assert main([*args, "--out", str(tmp_path / "straight")]) == 0
    assert main([*args, "--out", str(tmp_path / "split"), "--stop-at", "3"]) == 0
    assert main([*args, "--out", str(tmp_path / "split"), "--resume"]) == 0
    straight, split = losses(tmp_path / "straight"), losses(tmp_path / "split")
    assert straight == split and len(straight) == 6
    assert straight[-1][1] < straight[0][1]
    s1, p1 = params_of(tmp_path / "straight")
    s2, p2 = params_of(tmp_path / "split")
    assert s1 == s2 == 6
    for a, b in zip(p1, p2):
        np.testing.assert_array_equal(a, b)
    # as if killed after step 6 before saving it: steps 4..6 redone from the step-3 checkpoint
    assert main(["--out", str(tmp_path / "split"), "--resume", "--resume-step", "3"]) == 0
    s3, p3 = params_of(tmp_path / "split")
    assert s3 == 6
    for a, b in zip(p1, p3):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("extra,needle", [
    (["--optimizer-in-backward", "--remat", "full"], "--optimizer-in-backward cannot clip by "
     "the global gradient norm (--clip 1): each layer is updated before the next one's "
     "gradients exist; pass --clip 0"),
    ([*OIB, "--grad-accum", "2"], "--optimizer-in-backward cannot accumulate gradients"),
    ([*OIB, "--precision", "amp-fp16"], "--optimizer-in-backward cannot scale the loss"),
    ([*OIB, "--loss-scale", "static:128"], "--optimizer-in-backward cannot scale the loss"),
    (["--optimizer-in-backward", "--clip", "0"], "pass --remat full, or --remat "
     "offload:block_input to keep the inputs in host memory, not --remat none"),
    ([*OIB, "--lora-rank", "4"], "--optimizer-in-backward is for full fine-tunes"),
    ([*OIB, "--optimizer", "adafactor"], "--optimizer-in-backward updates each layer on its "
     "own, which --optimizer adafactor cannot: optax state FactoredState does not split part "
     "by part"),
])
def test_combinations_it_cannot_run_exit_2_with_one_line(tmp_path, extra, needle, capsys):
    with pytest.raises(SystemExit) as e:
        main([*SMALL, "--out", str(tmp_path / "run"), *extra])
    assert e.value.code == 2
    assert needle in error_line(capsys.readouterr().err)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # two compiles of the small preset
def test_the_gradient_tree_is_gone_from_the_compiled_step():
    # CPU compile (a test of the program, not a GPU figure): the ordinary step's temporaries
    # hold every gradient; here one layer's, with the stacked params and moments updated in
    # the donated buffers (no second params-sized buffer)
    def compiled(in_backward):
        cfg = StepConfig(get_preset("small"), get_precision("bf16-sr"), RematPolicy("full"),
                         OptimConfig(optimizer="adamw8bit", clip=0.0, in_backward=in_backward))
        return compile_run_step(cfg, None, 1, 256).memory_analysis()

    ordinary, oib = compiled(False), compiled(True)
    params_bytes = sum(x.size * 2 for x in jax.tree.leaves(
        jax.eval_shape(lambda: init_params(get_preset("small"), jax.random.PRNGKey(0)))))
    assert oib.argument_size_in_bytes == ordinary.argument_size_in_bytes
    batch = 3 * 256 * 4  # inputs, targets, mask: the one argument not donated
    assert oib.argument_size_in_bytes - oib.alias_size_in_bytes == batch  # state in place
    assert ordinary.temp_size_in_bytes - oib.temp_size_in_bytes > 0.9 * params_bytes
