"""jaxmem.optim's step part by part (`split`, `Parts`) and the one source of stochastic-rounding
keys (`pieces`): the keys of the scheme, a whole update's bits as before, the refusals."""

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmem.optim._stochastic as sr
from jaxmem.optim import AdamW8bitInPlace, NotSplittable, apply_updates_sr, pieces, split


def _data(k):
    return np.asarray(jax.random.key_data(k))


def test_pieces_are_the_scheme_of_the_whole_tree_update(monkeypatch):
    # leaf i draws from fold_in(key, i); a leaf over CHUNK elements, piece j from
    # fold_in(fold_in(key, i), j); fp32 leaves are not rounded
    monkeypatch.setattr(sr, "CHUNK", 2**8)
    key = jax.random.PRNGKey(5)
    small, large = jnp.zeros((4, 8), jnp.bfloat16), jnp.zeros((8, 64), jnp.bfloat16)
    one = pieces(key, small, leaf=2)
    assert one.n == 1
    np.testing.assert_array_equal(_data(one(0)), _data(jax.random.fold_in(key, 2)))
    many = pieces(key, large, leaf=3)
    assert many.n == sr.row_chunks(large.shape) == 2
    for j in range(2):
        ref = jax.random.fold_in(jax.random.fold_in(key, 3), j)
        np.testing.assert_array_equal(_data(many(j)), _data(ref))
        np.testing.assert_array_equal(_data(pieces(jax.random.fold_in(key, 3), large)(j)),
                                      _data(ref))
    np.testing.assert_array_equal(
        np.asarray(many.leaf_bits(large.shape)),
        np.concatenate([np.asarray(jax.random.bits(jax.random.fold_in(
            jax.random.fold_in(key, 3), j), (4 * 64,), jnp.uint32)) for j in range(2)])
        .reshape(large.shape))
    assert pieces(key, jnp.zeros((4, 8)), leaf=0)(0) is None
    assert pieces(None, small, leaf=0)(0) is None


def test_a_whole_sr_update_gives_the_bits_it_gave_before(monkeypatch):
    # golden: the same update at a91cbaf (before `pieces`), on values whose fp32 sums are exact
    # on any machine (only the keys and the rounding decide the bits)
    monkeypatch.setattr(sr, "CHUNK", 2**11)

    def tree(scale):
        def n(shape, dt):
            return (((jnp.arange(np.prod(shape)) % 97) - 48) * scale).reshape(shape).astype(dt)
        return {"a": n((4, 64, 96), jnp.bfloat16), "b": n((96,), jnp.bfloat16),
                "c": n((8, 8), jnp.float32)}

    params, updates = jax.tree.map(lambda x: x + 1, tree(2.0**-6)), tree(2.0**-13)
    new = jax.jit(lambda p, u, k: apply_updates_sr(p, u, k))(params, updates,
                                                             jax.random.PRNGKey(3))
    assert sr.row_chunks((4, 64, 96)) == 16
    h = hashlib.sha256()
    for x in jax.tree.leaves(new):
        h.update(np.asarray(x).tobytes())
    assert h.hexdigest() == "2808cea91c4cb5c62fbfb8aee8c46662067c85bb822192dcf31f9ca9badd496e"


@pytest.mark.parametrize("tx,name", [
    (optax.adafactor(1e-2), "FactoredState"),
    (optax.sgd(1e-2, momentum=0.9), "TraceState"),
    (optax.masked(optax.adam(1e-2), lambda p: {"b": False, "w": True}), "MaskedState(tuple)"),
])
def test_split_refuses_a_state_it_does_not_know_naming_its_type(tx, name):
    params = {"b": jnp.zeros(3), "w": jnp.ones((2, 3))}
    with pytest.raises(NotSplittable) as e:
        split(tx, tx.init(params), params)
    assert str(e.value).startswith(f"optax state {name} does not split part by part")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("tx", [optax.adamw(1e-2, mask=lambda p: {"b": False, "w": True}),
                                optax.lion(1e-3), optax.chain(optax.adam(1e-2))])
def test_optax_parts_are_the_whole_update(tx):
    # element-wise chains: every leaf whole, and the stacked "w" layer by layer
    params = {"b": jnp.linspace(-1, 1, 3), "w": jnp.linspace(-1, 1, 24).reshape(4, 2, 3)}
    grads = jax.tree.map(lambda x: jnp.cos(3 * x), params)
    state = tx.init(params)
    for _ in range(2):
        updates, ref_state = tx.update(grads, state, params)
        ref = optax.apply_updates(params, updates)
        parts = split(tx, state, params)
        yes = jnp.asarray(True)
        b, sb = parts.leaf(0, grads["b"], params["b"], parts.states[0], yes)
        w, sw = params["w"], parts.states[1]
        for l in (3, 1, 0, 2):
            w, sw = parts.layer(1, jnp.int32(l), grads["w"][l], w, sw, yes)
        new_state = parts.finish([sb, sw])
        np.testing.assert_allclose(np.asarray(b), np.asarray(ref["b"]), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(w), np.asarray(ref["w"]), rtol=1e-6)
        for x, y in zip(jax.tree.leaves(new_state), jax.tree.leaves(ref_state)):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6)
        assert jax.tree.structure(new_state) == jax.tree.structure(ref_state)
        params, state = ref, ref_state


def test_a_part_with_nonfinite_gradients_is_left_as_it_was():
    tx = optax.adamw(1e-2)
    params = {"w": jnp.ones((2, 3, 4))}
    parts = split(tx, tx.init(params), params)
    g = jnp.full((3, 4), jnp.nan)
    w, s = parts.layer(0, jnp.int32(1), g, params["w"], parts.states[0], jnp.asarray(False))
    np.testing.assert_array_equal(np.asarray(w), np.asarray(params["w"]))
    for x, y in zip(s, parts.states[0]):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_the_8bit_split_refuses_clipping():
    opt = AdamW8bitInPlace(1e-3, clip_norm=1.0)
    params = {"w": jnp.ones((64, 128))}
    with pytest.raises(ValueError, match="cannot clip by the global norm"):
        opt.split(opt.init(params), params)


def _columns(parts, i, g, p, s, width, finite=True):
    """Leaf i updated through Parts.columns, slice by slice (as the in-backward head is)."""
    for start in range(0, p.shape[-1], width):
        p, s = parts.columns(i, jnp.int32(start), g[:, start:start + width], p, s,
                             jnp.asarray(finite))
    return p, s


@pytest.mark.parametrize("kind", ["adamw8bit", "adamw"])
def test_columns_are_the_whole_leaf_update(kind):
    # an LM-head-shaped leaf [D, V] updated a vocabulary slice at a time: the same numbers as
    # the leaf updated whole (8-bit: bitwise, its blocks run along V and each slice holds whole
    # ones; optax's element-wise chain: within an fp32 ulp, XLA fusing its arithmetic apart)
    params = {"head": jnp.linspace(-1, 1, 8 * 1024).reshape(8, 1024)}
    grads = {"head": jnp.cos(3 * params["head"]) * 1e-2}
    if kind == "adamw8bit":
        opt = AdamW8bitInPlace(1e-2)
        state = opt.init(params)
        make = lambda st, p: opt.split(st, p)  # noqa: E731
    else:
        tx = optax.adamw(1e-2)
        state = tx.init(params)
        make = lambda st, p: split(tx, st, p)  # noqa: E731
    yes = jnp.asarray(True)
    for _ in range(2):
        parts = make(state, params)
        block = parts.column_block(0)
        assert block == (256 if kind == "adamw8bit" else 1)
        whole = parts.leaf(0, grads["head"], params["head"], parts.states[0], yes)
        sliced = jax.jit(lambda g, p, s: _columns(parts, 0, g, p, s, 512))(
            grads["head"], params["head"], parts.states[0])
        for x, y in zip(jax.tree.leaves(sliced), jax.tree.leaves(whole)):
            if kind == "adamw8bit":
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
            else:
                np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)
        params = {"head": whole[0]}
        state = parts.finish([whole[1]])
    # a slice of width 512 is not the whole leaf: the two slices really were updated apart
    assert not np.array_equal(np.asarray(params["head"][:, :512]),
                              np.asarray(jnp.linspace(-1, 1, 8 * 1024).reshape(8, 1024)[:, :512]))


def test_columns_round_bf16_with_their_own_keys_and_skip_nonfinite_slices():
    # bf16 under stochastic rounding: each slice draws from fold_in(leaf key, slice): within a
    # bf16 ulp of the whole update, not its bits; a slice whose `finite` is False stays as it was
    opt = AdamW8bitInPlace(1e-2, stochastic_rounding=True)
    p = (jnp.linspace(-1, 1, 8 * 1024).reshape(8, 1024) + 2).astype(jnp.bfloat16)
    params = {"head": p}
    state = opt.init(params)
    parts = opt.split(state, params, key=jax.random.PRNGKey(1))
    g = jnp.cos(3 * p.astype(jnp.float32)) * 1e-2
    yes = jnp.asarray(True)
    whole = parts.leaf(0, g, p, parts.states[0], yes)
    sliced = _columns(parts, 0, g, p, parts.states[0], 512)
    a, b = np.asarray(sliced[0], np.float32), np.asarray(whole[0], np.float32)
    np.testing.assert_allclose(a, b, rtol=2**-7)
    assert not np.array_equal(a, b)  # other bits
    for x, y in zip(jax.tree.leaves(sliced[1]), jax.tree.leaves(whole[1])):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))  # moments: value-hashed
    same = parts.columns(0, jnp.int32(512), g[:, 512:], p, parts.states[0], jnp.asarray(False))
    np.testing.assert_array_equal(np.asarray(same[0], np.float32), np.asarray(p, np.float32))
    for x, y in zip(jax.tree.leaves(same[1]), jax.tree.leaves(parts.states[0])):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
