"""jaxmem.train.host_state: a fresh state with parts in pinned host memory, made by several
programs (optimizer leaves in row pieces, stacked params a layer at a time into host memory,
then the device leaves), is bitwise the one-program state, on host where the placement says."""

import jax
import numpy as np
import pytest

from jaxmem.families import get_preset
from jaxmem.model.precision import get_precision
from jaxmem.model.remat import RematPolicy
from jaxmem.train import host_state
from jaxmem.train.optim import OptimConfig
from jaxmem.train.placement import Placement
from jaxmem.train.step import StepConfig, create_train_state, state_creation_fn


def _bits(x):
    return np.asarray(x).reshape(-1).view(np.uint8)


def _cfg(optimizer):
    return StepConfig(get_preset("tiny"), get_precision("bf16-sr"), RematPolicy("full"),
                      OptimConfig(optimizer=optimizer, clip=0.0, in_backward=True))


# adamw8bit with both on the host is nightly: its pieces are the first case's, its stacks the
# third's, and both on the host at once is the adamw case's
@pytest.mark.parametrize("optimizer,parts", [
    ("adamw8bit", ("host", "none")),
    pytest.param("adamw8bit", ("host", "host"), marks=pytest.mark.nightly),
    ("adamw8bit", ("none", "host")),
    ("adamw", ("host", "host"))])
def test_state_made_in_pieces_is_bitwise_one_program(monkeypatch, optimizer, parts):
    # pieces of 3 rows of the tiny model's 2-layer stacks and 512-row embedding moments: several
    # per leaf, the last one clamped to the leaf's end (512 = 3 * 170 + 2)
    monkeypatch.setattr(host_state, "PIECE_BYTES", 1)
    cfg, par = _cfg(optimizer), Placement.single(*parts)
    kinds = [p.kind for p in host_state.programs(
        state_creation_fn(cfg, None, 3), par._placed_shardings(
            jax.eval_shape(state_creation_fn(cfg, None, 3))))[0]]
    assert kinds[-1] == "device"
    assert ("piece" in kinds) == (parts[0] == "host")
    assert ("stack" in kinds) == (parts[1] == "host")
    made, want = par.init_state(cfg, None, 3), create_train_state(cfg, None, 3)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(made),
                            jax.tree_util.tree_leaves(want)):
        assert x.shape == y.shape and x.dtype == y.dtype, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(_bits(x), _bits(y), err_msg=jax.tree_util.keystr(path))
    shardings = par._placed_shardings(jax.eval_shape(state_creation_fn(cfg, None, 3)))
    for x, s in zip(jax.tree_util.tree_leaves(made), jax.tree_util.tree_leaves(shardings)):
        assert x.sharding.memory_kind == s.memory_kind


def test_given_params_pass_through(monkeypatch):
    monkeypatch.setattr(host_state, "PIECE_BYTES", 1)
    cfg, par = _cfg("adamw8bit"), Placement.single("host", "host")
    params = jax.device_get(create_train_state(cfg, None, 5).params)
    made = par.init_state(cfg, None, 3, params=params)
    want = create_train_state(cfg, None, 3, params=params)
    for x, y in zip(jax.tree_util.tree_leaves(made), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(_bits(x), _bits(y))
    assert {x.sharding.memory_kind for x in jax.tree_util.tree_leaves(made.params["layers"])} \
        == {"pinned_host"}


def test_progress_bar_counts_the_host_bytes(capsys):
    cfg = _cfg("adamw8bit")
    fn = state_creation_fn(cfg, None, 3)
    shardings = Placement.single("host", "host")._placed_shardings(jax.eval_shape(fn))
    host_state.create_on_host(fn, shardings, progress=False)
    assert "state to host memory" not in capsys.readouterr().err
    host_state.create_on_host(fn, shardings, progress=True)
    err = capsys.readouterr().err
    total = sum(x.size * x.dtype.itemsize for x, s in zip(
        jax.tree_util.tree_leaves(jax.eval_shape(fn)), jax.tree_util.tree_leaves(shardings))
        if s.memory_kind == "pinned_host" and x.ndim)
    assert "state to host memory:   0%" in err and f"/{total / 2**20:.2f}M" in err


def test_each_program_is_reported_with_its_compiled_memory(capsys):
    # experiments.offload_peak --programs prints through create_on_host's report: one line per
    # program, in the order they ran, each with XLA's compiled memory
    cfg = _cfg("adamw8bit")
    fn = state_creation_fn(cfg, None, 3)
    shardings = Placement.single("host", "host")._placed_shardings(jax.eval_shape(fn))
    seen = []
    host_state.create_on_host(fn, shardings, report=lambda p, c, s: seen.append(
        (p.kind, c.memory_analysis().output_size_in_bytes, s)))
    kinds = [p.kind for p in host_state.programs(fn, shardings)[0]]
    assert [k for k, _, _ in seen] == kinds and kinds[-1] == "device"
    assert seen[-1][1] > 0 and all(s >= 0 for _, _, s in seen)  # the device leaves are output

    from experiments.offload_peak.programs import create_printing
    create_printing(fn, shardings)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("program") and len(lines) == 1 + len(kinds)
    assert lines[-1].split()[:2] == ["device", "rest"] and "temp" in lines[-1]
