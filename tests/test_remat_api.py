"""jaxmem.remat.policy: remat policies by name on a function that is not jaxmem's model: each
name keeps exactly the residuals it says, and every policy gives the same gradients."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name
from numerics import assert_reordered_fp32

import jaxmem.remat as jr
from jaxmem.model.remat import RematPolicy


def saved_residuals():
    for mod in ("jax.ad_checkpoint", "jax._src.ad_checkpoint"):
        fn = getattr(importlib.import_module(mod), "saved_residuals", None)
        if fn is not None:
            return fn
    pytest.skip("this jax has no saved_residuals")


def mlp(x, w1, w2):
    """A user's own block: x [B, D], w1 [D, F], w2 [F, D]."""
    h = checkpoint_name(x @ w1, "up")  # [B, F]
    a = checkpoint_name(jnp.sin(h), "act")  # [B, F]
    return jnp.sum(jnp.tanh(a @ w2))  # [B, D] -> []


def args():
    k = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(k[0], (4, 8)), jax.random.normal(k[1], (8, 16)),
            jax.random.normal(k[2], (16, 8)))


def kept(name):
    """What the backward reads besides the inputs: sorted descriptions' first words + shapes."""
    res = saved_residuals()(jax.checkpoint(mlp, policy=jr.policy(name)), *args())
    out = []
    for aval, desc in res:
        if desc.startswith("from the argument"):
            continue
        out.append((desc.split(" from ")[0], tuple(aval.shape)))
    return sorted(out)


def test_each_name_keeps_what_it_says():
    assert kept("full") == []
    assert kept("names:act") == [("named 'act'", (4, 16))]
    assert kept(" names: up , act ") == [("named 'act'", (4, 16)), ("named 'up'", (4, 16))]
    # dots keeps both matmul outputs [B, F] and [B, D]; sin, cos and tanh are recomputed
    dots = kept(jr.Remat.DOTS)
    assert dots == [("output of dot_general", (4, 8)), ("output of dot_general", (4, 16))]
    everything = kept("none")
    assert len(everything) > len(dots) > len(kept("names:act")) > len(kept("full")) == 0


@pytest.mark.parametrize("name", ["none", "full", "dots", "dots_no_batch", "names:up,act"])
def test_every_policy_gives_the_same_gradients(name):
    with jax.default_matmul_precision("highest"):
        want = jax.grad(mlp, (0, 1, 2))(*args())
        got = jax.jit(jax.grad(jax.checkpoint(mlp, policy=jr.policy(name)), (0, 1, 2)))(*args())
    # jitted vs eager: a different summation order (tests/numerics.py)
    assert_reordered_fp32(got, want)


def test_names_match_the_trainers_parser():
    """The names jaxmem.train --remat takes pick the same jax policies here."""
    for name in ("dots", "dots_no_batch"):
        assert jr.policy(name) is RematPolicy.parse(name).jax_policy()
    assert jr.policy("full") is jax.checkpoint_policies.nothing_saveable
    assert jr.policy("none") is jax.checkpoint_policies.everything_saveable
    assert {m.value for m in jr.Remat} <= set(jr.POLICIES)
    # offload policies are built anywhere (only compiling them needs a pinned_host memory)
    assert callable(jr.policy("offload:up,act")) and callable(jr.policy(jr.Remat.OFFLOAD))


@pytest.mark.parametrize("name, message", [
    ("dot", "unknown remat policy 'dot'"), ("names:", "gives no tags after 'names:'"),
    ("everything", "unknown remat policy 'everything'")])
def test_unknown_names_are_refused(name, message):
    with pytest.raises(ValueError, match=message):
        jr.policy(name)
