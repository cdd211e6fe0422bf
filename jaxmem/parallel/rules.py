"""Sharding rules: where every leaf of the train state, the batch and the activations live.

Parameters (and every optimizer leaf shaped like one: Adam's mu and nu), by role and shape:

    1. scalars, norm scales and leaves under MIN_SHARDED elements are replicated: splitting
       them saves nothing and costs a collective each;
    2. the layer axis L of the scanned block params is never split (scan slices it per layer);
    3. tensor: the head / width axis of the role's Megatron split (below), when it divides;
    4. fsdp: the largest remaining axis divisible by the fsdp size (none divides: not split).

    role        stored shape (after L)   tensor splits   Megatron
    q_proj      [D, N, H]                N               column parallel (heads)
    k/v_proj    [D, K, H]                K               column parallel (kv heads)
    o_proj      [N, H, D]                N               row parallel
    gate/up     [D, F]                   F               column parallel
    down_proj   [F, D]                   F               row parallel
    lm_head     [D, V]                   V               vocab parallel logits
    embedding   [V, D]                   -               (fsdp only)

Column-then-row parallel pairs keep the activations between them split by heads / width, so
each block needs one reduction of its output per pair. `data` never splits a parameter.

The batch [K, B, T] is split over (data, fsdp) on B. The activations are constrained the same
way at the model's hook (jaxmem.model.sharding): without it XLA all-gathers the global batch on
every device (docs/architecture.md). Logits are also split over `tensor` on V.

Leaves whose path names no parameter (optimizer counts, the loss scale) fall back to rule 1 and
the fsdp rule 4, so a new optimizer's state is split sensibly without a table entry.
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxmem.model.roles import param_role, path_text
from jaxmem.parallel.mesh import BATCH_AXES

MIN_SHARDED = 4096  # elements; smaller leaves are replicated

# role -> index of the axis `tensor` splits, counted after the layer axis
TENSOR_AXIS = {"q_proj": 1, "k_proj": 1, "v_proj": 1, "o_proj": 0,
               "gate_proj": 1, "up_proj": 1, "down_proj": 0, "lm_head": 1}


def _role(path):
    try:
        return param_role(path)
    except ValueError:
        return None


def _has_layer_axis(path) -> bool:
    return "layers" in path_text(path).split("/")


def leaf_spec(path, shape: tuple[int, ...], axis_sizes: dict[str, int]) -> P:
    """The PartitionSpec of one state leaf (see the module docstring for the rules)."""
    size = 1
    for s in shape:
        size *= s
    role = _role(path)
    if len(shape) == 0 or size < MIN_SHARDED or role == "norm":
        return P()
    first = 1 if _has_layer_axis(path) and len(shape) > 1 else 0
    spec: list = [None] * len(shape)
    tensor, fsdp = axis_sizes.get("tensor", 1), axis_sizes.get("fsdp", 1)
    if tensor > 1 and role in TENSOR_AXIS:
        dim = first + TENSOR_AXIS[role]
        if dim < len(shape) and shape[dim] % tensor == 0:
            spec[dim] = "tensor"
    if fsdp > 1:
        free = [d for d in range(first, len(shape)) if spec[d] is None and shape[d] % fsdp == 0]
        if free:
            spec[max(free, key=lambda d: (shape[d], -d))] = "fsdp"
    return P(*spec)


def state_specs(abstract_state, mesh):
    """PartitionSpecs for every leaf of a (abstract) train state."""
    sizes = dict(mesh.shape)
    return jax.tree_util.tree_map_with_path(lambda p, x: leaf_spec(p, tuple(x.shape), sizes),
                                            abstract_state)


def state_shardings(abstract_state, mesh):
    """NamedShardings for every leaf of a train state on `mesh`."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), state_specs(abstract_state, mesh),
                        is_leaf=lambda x: isinstance(x, P))


def with_shardings(abstract_state, mesh):
    """The abstract state with each ShapeDtypeStruct given its sharding on `mesh` (the target
    Orbax restores onto: a checkpoint saved on any mesh comes back split for this one)."""
    shardings = state_shardings(abstract_state, mesh)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        abstract_state, shardings)


def batch_sharding(mesh) -> NamedSharding:
    """A step batch [K, B, T]: B split over (data, fsdp)."""
    return NamedSharding(mesh, P(None, BATCH_AXES, None))


def eval_batch_sharding(mesh) -> NamedSharding:
    """An eval batch [B, T]: B split over (data, fsdp)."""
    return NamedSharding(mesh, P(BATCH_AXES, None))


def activation_rules(mesh, vocab_size: int | None = None) -> dict:
    """Rules for jaxmem.model.sharding.activation_sharding: [B, T, D] split on B; logits
    [B, T, V] on B and also on V over `tensor` when the LM head is split there (V divisible)."""
    t = mesh.shape["tensor"]
    tensor = "tensor" if t > 1 and vocab_size is not None and vocab_size % t == 0 else None
    return {"embed": NamedSharding(mesh, P(BATCH_AXES, None, None)),
            "block": NamedSharding(mesh, P(BATCH_AXES, None, None)),
            "logits": NamedSharding(mesh, P(BATCH_AXES, None, tensor))}


def replicated(mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
