"""`--update-kernel pallas` (jaxmem.optim._kernel): the 8-bit AdamW update of a large bf16 leaf
as one Pallas kernel. On CPU it runs in Pallas' interpreter, so these tests hold it to the XLA
loop it replaces: bitwise (weights, codes, scales, counts) where both programs round bf16 at
every operation, to a stated bound under XLA's default excess precision; and its random bits to
jax's own `jax.random.bits`. On a GPU (Triton) the last test states its bound; experiments.
gpu_check runs it in its `gpu-tests` row and times the kernel in its `8b-1x2048-pallas` row."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmem.optim._stochastic as sr
from jaxmem.bits import key_data
from jaxmem.optim import AdamW8bitInPlace, keep_small_fp32
from jaxmem.optim._kernel import eligible, threefry_bits
from jaxmem.xla import alu
from jaxmem.xla.hlo import parse_hlo


@pytest.mark.parametrize("shape", [(64, 300), (5000,)])
def test_threefry_bits_are_jax_random_bits(shape):
    key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(3), 7), 2)
    k = key_data(key)
    index = jnp.arange(int(np.prod(shape)), dtype=jnp.uint32).reshape(shape)
    assert bool((threefry_bits(k[0], k[1], index) == jax.random.bits(key, shape, jnp.uint32))
                .all())


def _params(rng):
    return {"mlp": jnp.asarray(rng.standard_normal((4, 64, 512)) * 0.02, jnp.bfloat16),
            "heads": jnp.asarray(rng.standard_normal((2, 64, 4, 128)) * 0.02, jnp.bfloat16),
            "head": jnp.asarray(rng.standard_normal((1024, 256)) * 0.02, jnp.bfloat16),
            "norm": jnp.ones((512,), jnp.bfloat16),
            "embed": jnp.asarray(rng.standard_normal((512, 192)) * 0.02, jnp.bfloat16),
            "fp32": jnp.asarray(rng.standard_normal((128, 256)), jnp.float32)}


def _layers(path, x):
    return 1 if x.ndim >= 3 else 0


def _keeps_fp32(path, x):
    """The trainer's rule (jaxmem.train.optim.keeps_fp32): small leaves, and the embedding."""
    return keep_small_fp32(path, x) or "embed" in jax.tree_util.keystr(path)


# bf16 arithmetic rounded at every operation, in both programs: XLA's default lets each program
# keep some bf16 intermediates in fp32 (`xla_allow_excess_precision`), differently in the loop
# and in the kernel's interpreted program (test_with_xlas_excess_precision... below)
EXACT = {"xla_allow_excess_precision": False}


def _run(opt, grads, state, params, key, where=True, options=None):
    return jax.jit(lambda g, s, p: opt.update_and_apply(g, s, p, key=key, where=where)).lower(
        grads, state, params).compile(compiler_options=options)(grads, state, params)


def _steps(opt, params, n, where=True, seed=0, options=EXACT):
    """n steps of `opt` and of the same optimizer with update_kernel="pallas", from the same
    state and gradients: the list of (xla, pallas) results, and the last inputs."""
    rng = np.random.default_rng(seed)
    kopt = dataclasses.replace(opt, update_kernel="pallas")
    state, out = opt.init(params), []
    for step in range(n):
        grads = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape) * 3, p.dtype),
                             params)
        key = jax.random.fold_in(jax.random.PRNGKey(1), step)
        a = _run(opt, grads, state, params, key, where, options)
        b = _run(kopt, grads, state, params, key, where, options)
        out.append((a, b))
        params, state = a
    return out, kopt, grads, state, params


@pytest.mark.parametrize("moments, clip, chunk", [("stochastic", 1.0, 2**14),
                                                  ("nearest", 0.0, 2**14),
                                                  ("stochastic", 1.0, None)])
def test_the_kernel_gives_the_xla_loops_numbers_bitwise(monkeypatch, moments, clip, chunk):
    if chunk:  # several row pieces per leaf, and several tiles each; None: one piece per leaf
        monkeypatch.setattr(sr, "CHUNK", chunk)
    rng = np.random.default_rng(0)
    schedule = optax.linear_schedule(1e-2, 1e-3, 10)  # a traced learning rate
    opt = AdamW8bitInPlace(schedule, weight_decay=0.1, clip_norm=clip, layer_axes=_layers,
                           keep_fp32=_keeps_fp32, stochastic_rounding=True,
                           stochastic_moments=moments == "stochastic")
    results, kopt, grads, state, params = _steps(opt, _params(rng), 3)
    for a, b in results:
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            assert x.dtype == y.dtype and bool((x == y).all())
    # the kernel ran: one per 8-bit bf16 leaf ("mlp", "heads" with its 128-wide blocks, "head")
    # and for "embed", fp32 moments on a 192-wide last axis (tiles 64 wide); "norm" is 2 tile
    # rows of 256, fewer than a tile's 16, and "fp32" has fp32 weights
    jaxpr = str(jax.make_jaxpr(lambda g, s, p: kopt.update_and_apply(
        g, s, p, key=jax.random.PRNGKey(0)))(grads, state, params))
    assert jaxpr.count("pallas_call") == 4
    assert not hasattr(kopt.moments(state).mu["embed"], "codes")


def test_with_xlas_excess_precision_the_two_programs_differ_by_rounding_only():
    """XLA's default options: the loop and the kernel's program may each keep some bf16
    intermediates (the clipped gradient, the update) in fp32. The weights then differ by at
    most one bf16 ulp, the block scales by bf16's rounding, and a block whose scale moved draws
    its stochastic codes again (the hash of each value's bits): neighbouring codes."""
    opt = AdamW8bitInPlace(1e-3, clip_norm=1.0, layer_axes=_layers, keep_fp32=_keeps_fp32,
                           stochastic_rounding=True)
    results, *_ = _steps(opt, _params(np.random.default_rng(3)), 1, options=None)
    (new_a, state_a), (new_b, state_b) = results[0]
    for x, y in zip(jax.tree.leaves(new_a), jax.tree.leaves(new_b)):
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        ulp = np.abs(x) * 2.0**-7 + 1e-30  # a bf16 ulp is at most |x| 2^-7
        assert np.all(np.abs(x - y) <= ulp) and np.mean(x != y) < 0.01
    for qa, qb in zip(*(jax.tree.leaves(s, is_leaf=lambda q: hasattr(q, "codes"))
                        for s in (state_a, state_b))):
        if not hasattr(qa, "codes"):
            continue
        scale_a, scale_b = np.asarray(qa.scale), np.asarray(qb.scale)
        assert np.all(np.abs(scale_a - scale_b) <= 2.0**-6 * np.abs(scale_a))
        codes = np.abs(np.asarray(qa.codes, np.int32) - np.asarray(qb.codes, np.int32))
        assert codes.max() <= 3, codes.max()


def test_a_skipped_step_leaves_every_buffer_as_it_was(monkeypatch):
    monkeypatch.setattr(sr, "CHUNK", 2**14)
    params = _params(np.random.default_rng(1))
    opt = AdamW8bitInPlace(1e-2, clip_norm=1.0, layer_axes=_layers, keep_fp32=_keeps_fp32,
                           stochastic_rounding=True)
    results, *_ = _steps(opt, params, 1, where=False)
    new, state = results[0][1]
    for x, y in zip(jax.tree.leaves((new, state)), jax.tree.leaves((params, opt.init(params)))):
        assert bool((x == y).all())


def test_what_the_kernel_does_not_take_goes_through_the_loop():
    rng = np.random.default_rng(2)
    p = jnp.asarray(rng.standard_normal((64, 512)), jnp.bfloat16)
    opt = AdamW8bitInPlace(1e-2, stochastic_rounding=True)
    m, v = opt.moments(opt.init({"w": p})).mu["w"], opt.moments(opt.init({"w": p})).nu["w"]
    key = jax.random.PRNGKey(0)
    assert eligible(p, m, v, p, key)
    assert not eligible(p, m, v, p, None)                       # no stochastic rounding
    assert not eligible(p.astype(jnp.float32), m, v, p, key)    # an fp32 gradient
    assert not eligible(p, m, v, p.astype(jnp.float32), key)    # fp32 weights
    odd = jnp.zeros((64, 200), jnp.bfloat16)                    # blocks across rows
    mo = opt.moments(opt.init({"w": odd})).mu["w"]
    assert not eligible(odd, mo, mo, odd, key)
    m32 = jnp.zeros(p.shape, jnp.float32)                       # fp32 moments: taken
    assert eligible(p, m32, m32, p, key)
    assert not eligible(p, m32, m, p, key)                      # one fp32, one 8-bit
    assert not eligible(p, m32.astype(jnp.bfloat16), m32, p, key)   # bf16 moments
    narrow = jnp.zeros((4096, 8), jnp.bfloat16)                 # tiles under 16 wide
    assert not eligible(narrow, *(jnp.zeros(narrow.shape, jnp.float32),) * 2, narrow, key)
    with pytest.raises(ValueError, match="update_kernel 'cuda'"):
        dataclasses.replace(opt, update_kernel="cuda").update_and_apply(
            {"w": p}, opt.init({"w": p}), {"w": p}, key=key)


def test_lane_cycles_count_threefry_as_integer_work():
    """jaxmem.xla.alu on XLA's optimized program of the kernel's threefry-2x32: 20 rounds of an
    add, a rotate (one funnel shift) and an xor, and the key injections: ~75 integer operations
    per element at 2 lane cycles each; a float add is one."""
    u32 = jax.ShapeDtypeStruct((), jnp.uint32)
    bits = jax.jit(lambda k0, k1: threefry_bits(k0, k1, jnp.arange(4096, dtype=jnp.uint32))
                   ).lower(u32, u32).compile().as_text()
    per = alu.cycles_per_element(bits, 4096)
    assert 120 <= per <= 200, per
    add = jax.jit(lambda x: x + 1.0).lower(jnp.zeros(4096)).compile().as_text()
    assert alu.cycles_per_element(add, 4096) == 1
    assert alu.tagged(alu.tag("adamw8bit_update", 613)) == 613 and alu.tagged("kernel") is None
    comps = parse_hlo(add)
    assert sum(alu.fused_cycles(c) for c in comps.values()) == 4096


@pytest.mark.gpu
def test_on_a_gpu_the_triton_kernel_gives_the_xla_loops_numbers():
    """On a GPU: one llama-3-8b MLP leaf's update, the Triton kernel against XLA's loop, two
    steps (clipping on, stochastic moments and rounding), both programs rounding bf16 at every
    operation. What may still differ: the contraction of multiply-adds into FMAs and the
    lowering of fp32 division and square root (Triton's through libdevice / LLVM, XLA's its
    own), an fp32 ulp here and there; the assertion message counts every difference, so a miss
    says how far."""
    shape = (32, 14336, 4096)
    rng = jax.random.PRNGKey(0)
    p = (jax.random.normal(rng, shape, jnp.float32) * 0.02).astype(jnp.bfloat16)
    opt = AdamW8bitInPlace(3e-4, weight_decay=0.1, clip_norm=1.0, layer_axes=_layers,
                           stochastic_rounding=True)
    kopt = dataclasses.replace(opt, update_kernel="pallas")
    state, params, differ = opt.init({"w": p}), {"w": p}, []
    for step in range(2):
        g = {"w": (jax.random.normal(jax.random.fold_in(rng, step + 1), shape, jnp.float32)
                   * 1e-3).astype(jnp.bfloat16)}
        key = jax.random.fold_in(rng, 100 + step)
        a = _run(opt, g, state, params, key, options=EXACT)
        b = _run(kopt, g, state, params, key, options=EXACT)
        (wa, sa), (wb, sb) = a, b
        x, y = (np.asarray(w["w"], np.float32) for w in (wa, wb))
        ma, mb = (opt.moments(t).mu["w"] for t in (sa, sb))
        va, vb = (opt.moments(t).nu["w"] for t in (sa, sb))
        differ.append({
            "weights": int(np.sum(x != y)),
            "weights over 1 ulp": int(np.sum(np.abs(x - y) > np.abs(x) * 2.0**-7)),
            "codes": [int(np.sum(np.asarray(q.codes) != np.asarray(r.codes)))
                      for q, r in ((ma, mb), (va, vb))],
            "codes over 1 apart": [int(np.sum(np.abs(np.asarray(q.codes, np.int32)
                                                     - np.asarray(r.codes, np.int32)) > 1))
                                   for q, r in ((ma, mb), (va, vb))],
            "scale rel": [float(np.max(np.abs(np.asarray(q.scale) - np.asarray(r.scale))
                                       / np.maximum(np.asarray(q.scale), 1e-30)))
                          for q, r in ((ma, mb), (va, vb))]})
        params, state = a
    ok = all(d["weights over 1 ulp"] == 0 and d["weights"] < 0.001 * p.size
             and max(d["codes over 1 apart"]) == 0 and max(d["scale rel"]) <= 2.0**-20
             for d in differ)
    assert ok, differ
