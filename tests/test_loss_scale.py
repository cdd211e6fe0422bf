"""Loss scaling: exact trajectories, torch.amp.GradScaler parity, pytree round trips."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.optim import DynamicLossScale, NoOpLossScale, StaticLossScale, all_finite, select_tree
from jaxmem.train.optim import parse_loss_scale


def run(ls, pattern):
    """Scales *used* at each step for a pattern of finite (1) / non-finite (0) steps."""
    adjust = jax.jit(lambda s, f: s.adjust(f))
    seen = []
    for finite in pattern:
        seen.append(float(ls.loss_scale))
        ls = adjust(ls, jnp.asarray(bool(finite)))
    return seen, ls


def test_torch_defaults():
    ls = DynamicLossScale.create()
    assert float(ls.loss_scale) == 2.0**16
    assert (ls.growth_interval, ls.growth_factor, ls.backoff_factor, ls.hysteresis) == (2000, 2.0, 0.5, 1)


def test_full_growth_period_default_interval():
    """2000 finite steps: the scale doubles on the step that completes the interval, not before."""
    ls = DynamicLossScale.create()
    adjust = jax.jit(lambda s: s.adjust(jnp.asarray(True)))
    for i in range(1999):
        ls = adjust(ls)
    assert float(ls.loss_scale) == 2.0**16 and int(ls.good_steps) == 1999
    ls = adjust(ls)
    assert float(ls.loss_scale) == 2.0**17 and int(ls.good_steps) == 0


def test_exact_trajectory_with_backoffs():
    ls = DynamicLossScale.create(8.0, growth_interval=3)
    pattern = [1, 1, 1, 1, 0, 1, 1, 0, 0, 1, 1, 1, 1]
    seen, end = run(ls, pattern)
    assert seen == [8, 8, 8, 16, 16, 8, 8, 8, 4, 2, 2, 2, 4]
    assert float(end.loss_scale) == 4.0 and int(end.good_steps) == 1


def test_backoff_resets_counter():
    ls = DynamicLossScale.create(1024.0, growth_interval=2)
    seen, _ = run(ls, [1, 0, 1, 1, 1])
    # 1 good step, then inf resets the count: growth needs 2 fresh finite steps
    assert seen == [1024, 1024, 512, 512, 1024]


def test_hysteresis_needs_consecutive_non_finite_steps():
    ls = DynamicLossScale.create(64.0, growth_interval=100, hysteresis=2)
    seen, end = run(ls, [0, 1, 0, 0, 0, 0, 0])
    # an isolated inf does not back off; two in a row do; the run counter restarts after a backoff
    assert seen == [64, 64, 64, 64, 32, 32, 16]
    assert float(end.loss_scale) == 16.0 and int(end.inf_run) == 1


def test_min_and_max_scale_clamp():
    ls = DynamicLossScale.create(4.0, growth_interval=1, min_scale=1.0, max_scale=16.0)
    seen, _ = run(ls, [0, 0, 0, 0, 1, 1, 1, 1, 1])
    assert seen == [4, 2, 1, 1, 1, 2, 4, 8, 16]
    _, end = run(ls, [1] * 10)
    assert float(end.loss_scale) == 16.0


def test_never_reaches_inf():
    ls = DynamicLossScale.create(2.0**126, growth_interval=1)
    _, end = run(ls, [1] * 5)
    assert np.isfinite(float(end.loss_scale)) and float(end.loss_scale) == 2.0**127


def test_every_field_survives_jit_tree_map_and_flatten():
    ls = DynamicLossScale.create(32.0, growth_interval=7, growth_factor=4.0, backoff_factor=0.25,
                                 min_scale=2.0, max_scale=1024.0, hysteresis=3)
    out = jax.jit(lambda s: s)(ls)
    mapped = jax.tree_util.tree_map(lambda x: x, ls)
    leaves, treedef = jax.tree_util.tree_flatten(ls)
    rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
    for other in (out, mapped, rebuilt):
        assert other.min_scale == 2.0 and other.max_scale == 1024.0 and other.hysteresis == 3
        assert other.growth_interval == 7 and other.growth_factor == 4.0
        assert other.backoff_factor == 0.25 and float(other.loss_scale) == 32.0
    assert len(leaves) == 3  # loss_scale, good_steps, inf_run: the dynamic state only


def test_scale_unscale_and_all_finite():
    ls = DynamicLossScale.create(1024.0)
    g = {"a": jnp.ones(3, jnp.float32) * 1024.0, "b": jnp.full((2,), 2048.0, jnp.float16)}
    un = ls.unscale(g)
    np.testing.assert_array_equal(un["a"], np.ones(3))
    assert un["b"].dtype == jnp.float16 and float(un["b"][0]) == 2.0
    assert float(ls.scale(jnp.float32(0.5))) == 512.0
    assert bool(all_finite(g))
    assert not bool(all_finite({**g, "c": jnp.array([1.0, jnp.inf])}))
    assert not bool(all_finite({**g, "c": jnp.array([jnp.nan])}))
    t = select_tree(jnp.asarray(False), {"x": jnp.ones(2)}, {"x": jnp.zeros(2)})
    np.testing.assert_array_equal(t["x"], np.zeros(2))


def test_static_and_noop():
    s = StaticLossScale(jnp.float32(128.0))
    assert float(s.adjust(jnp.asarray(False)).loss_scale) == 128.0
    n = NoOpLossScale()
    assert float(n.loss_scale) == 1.0 and n.scale(3.0) == 3.0


@pytest.mark.parametrize("spec, kind", [("dynamic", DynamicLossScale), ("none", NoOpLossScale),
                                        ("static:1024", StaticLossScale)])
def test_parse(spec, kind):
    assert isinstance(parse_loss_scale(spec), kind)


@pytest.mark.parametrize("spec, needle", [("static:-1", "static:VALUE"), ("static:x", "static:VALUE"),
                                          ("auto", "unknown --loss-scale 'auto'")])
def test_parse_errors(spec, needle):
    with pytest.raises(ValueError, match=needle):
        parse_loss_scale(spec)


def test_invalid_settings_name_the_field():
    with pytest.raises(ValueError, match="growth_interval"):
        DynamicLossScale.create(growth_interval=0)
    with pytest.raises(ValueError, match="backoff_factor"):
        DynamicLossScale.create(backoff_factor=1.5)
    with pytest.raises(ValueError, match="hysteresis"):
        DynamicLossScale.create(hysteresis=0)


@pytest.mark.torch
def test_same_scales_as_torch_grad_scaler():
    """Feed torch.amp.GradScaler and DynamicLossScale the same finite/non-finite sequence."""
    torch = pytest.importorskip("torch")
    pattern = [1, 1, 1, 0, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1]
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=3)
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.0)
    torch_scales = []
    for finite in pattern:
        torch_scales.append(scaler.get_scale())
        opt.zero_grad()
        loss = (w * (1.0 if finite else float("inf"))).sum()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    ours, _ = run(DynamicLossScale.create(256.0, growth_interval=3), pattern)
    assert ours == torch_scales
