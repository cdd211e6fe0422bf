"""Sharding rules: where every leaf of the train state, the batch and the activations live.

Parameters (and every optimizer leaf shaped like one: Adam's mu and nu), by role and shape:

    1. scalars, norm scales and leaves under MIN_SHARDED elements are replicated: splitting
       them saves nothing and costs a collective each;
    2. the layer axis L of the scanned block params is never split (scan slices it per layer);
    3. tensor: the head / width axis of the role's Megatron split (below), when it divides;
    4. fsdp (times context: context parallelism shards the state over its devices too, as
       ZeRO-3 over fsdp x context; the spec then names ("fsdp", "context")): a projection's
       first axis after L (D, or N for o_proj, F for down_proj) when it divides; else the last
       axis when each shard of it holds whole 8-bit moment blocks (256 x fsdp divides it);
       else the largest remaining divisible axis (none divides: not split). `_fsdp_axis` says
       why.

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

The batch [K, B, T] is split over (data, fsdp) on B and over `context` on T (context
parallelism, jaxmem.model.context: the step permutes T into the load-balanced layout first). The activations are constrained the same
way at the model's hook (jaxmem.sharding): without it XLA all-gathers the global batch on
every device (docs/architecture.md). Logits are also split over `tensor` on V.

Leaves whose path names no parameter (optimizer counts, the loss scale) fall back to rule 1 and
the fsdp rule 4, so a new optimizer's state is split sensibly without a table entry.

LoRA adapters (params/.../q_proj/lora_a [L, in..., R], lora_b [L, R, out...]) and their
optimizer state follow their base weight's rule: `tensor` splits the side of the adapter that
meets the Megatron axis (lora_b's out axis for column-parallel roles, lora_a's in axis for
o_proj / down_proj; the rank axis never), `fsdp` the largest remaining divisible axis, and rule 1
replicates the small ones. They are not replicated wholesale because they are not always small:
Llama-3-70B with r=16 on all seven projections has 207M adapter params, 3.3 GB with fp32 Adam
state, a seventh of a 24 GB card on every device if replicated.

The frozen base of a LoRA run (`base_specs`): plain arrays take the rules above; a quantized
projection (jaxmem.quant.QuantizedWeight, stacked: codes [L, In/b, b', Out], absmax
[L, In/b, Out], absmax_q [L, m, 256], absmax_scale [L, m], absmax_offset [L]) is split on its
packed layout:

    codes         tensor: Out (column parallel) or In/b (row parallel: contiguous blocks of In
                  are contiguous heads / width) when it divides; fsdp: the larger of In/b and Out
                  that divides, else the block axis b'
    absmax        the codes' split on In/b and Out (each block's scale lives with its codes), or
                  its own largest fsdp-divisible axis
    absmax_q      fsdp on m (second-level blocks shard with their blocks), else on the 256 axis
    absmax_scale  with absmax_q's m axis; absmax_offset (one per layer) replicated

A packed leaf that a non-`data` mesh axis cannot split at all is replicated, with one warning
line on stderr naming the leaf, its shape and the axis (once per leaf and process):

    jaxmem: warning: frozen base leaf layers/self_attn/q_proj/codes uint8[4, 2, 32, 128] is
    replicated: mesh axis fsdp=3 divides none of its axes                  (one line)

`lora_base_shardings(step_cfg, mesh)` is what a run places its base with and jits its step
with; `lora_packed_gather` what the step gathers one packed layer with, inside the scan.
"""

from __future__ import annotations

import sys

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxmem.paths import in_layers, path_text
from jaxmem.model.roles import param_role
from jaxmem.optim import BLOCK
from jaxmem.parallel.mesh import BATCH_AXES
from jaxmem.quant import QuantizedWeight

MIN_SHARDED = 4096  # elements; smaller leaves are replicated

# role -> index of the axis `tensor` splits, counted after the layer axis
TENSOR_AXIS = {"q_proj": 1, "k_proj": 1, "v_proj": 1, "o_proj": 0,
               "gate_proj": 1, "up_proj": 1, "down_proj": 0, "lm_head": 1}
ROW_PARALLEL = ("o_proj", "down_proj")  # tensor splits their input axes
ADAPTERS = ("lora_a", "lora_b")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
               "lm_head")


def _role(path):
    try:
        return param_role(path)
    except ValueError:
        return None


def leaf_spec(path, shape: tuple[int, ...], axis_sizes: dict[str, int]) -> P:
    """The PartitionSpec of one state leaf (see the module docstring for the rules)."""
    size = 1
    for s in shape:
        size *= s
    role = _role(path)
    if len(shape) == 0 or size < MIN_SHARDED or role == "norm":
        return P()
    first = 1 if in_layers(path) and len(shape) > 1 else 0
    spec: list = [None] * len(shape)
    tensor, fsdp = axis_sizes.get("tensor", 1), axis_sizes.get("fsdp", 1)
    # context parallelism: `context` shards the state with fsdp (torchtitan's dp_shard x cp):
    # its devices hold different tokens, never different weights, so ZeRO-3 over both
    context = axis_sizes.get("context", 1)
    shard_axes = ("fsdp",) if context == 1 else (("context",) if fsdp == 1 else ("fsdp", "context"))
    fsdp *= context
    names = path_text(path).split("/")
    adapter = next((n for n in ADAPTERS if n in names), None)
    if adapter is not None:  # lora_a [in..., R]: in axis 0; lora_b [R, out...]: out axis 1
        row = role in ROW_PARALLEL
        tensor_dim = (0 if row else None) if adapter == "lora_a" else (None if row else 1)
    else:
        tensor_dim = TENSOR_AXIS.get(role)
    if tensor > 1 and tensor_dim is not None:
        dim = first + tensor_dim
        if dim < len(shape) and shape[dim] % tensor == 0:
            spec[dim] = "tensor"
    if fsdp > 1:
        leading = role in PROJECTIONS and adapter is None
        axis = _fsdp_axis(shape, first, spec, fsdp, names[-1] == "scale", leading)
        if axis is not None:
            spec[axis] = shard_axes[0] if len(shard_axes) == 1 else shard_axes
    return P(*spec)


def _fsdp_axis(shape, first, spec, fsdp, block_scale, leading=False):
    """The axis fsdp splits (module docstring, rule 4), or None.

    `leading` (a projection's weight, or a moment shaped like one): the first axis after L when
    fsdp divides it and tensor left it free. One layer's slice is then gathered along its
    major axis, which the GPU's all-gather takes as it is laid out (a split minor axis made XLA
    copy whole stacks of weights into a layout with that axis first). Otherwise, and for the
    embedding: the last axis when each shard of it holds whole 8-bit moment blocks
    (jaxmem.optim.BLOCK): 8-bit blocks run along it and never straddle a shard. Otherwise the
    largest divisible axis. The optimizer updates each shard where it lives whatever the axis
    (jaxmem.optim.AdamW8bitInPlace.apply_placed). `block_scale`: an 8-bit moment's block scales
    [..., nblocks], whose last axis is the codes' divided by BLOCK: split as the codes are, so
    each block's scale lives with its codes."""
    last = len(shape) - 1
    if leading and first < last and spec[first] is None and shape[first] % fsdp == 0:
        return first
    if last > first and spec[last] is None and \
            shape[last] % (fsdp if block_scale else BLOCK * fsdp) == 0:
        return last
    free = [d for d in range(first, len(shape)) if spec[d] is None and shape[d] % fsdp == 0]
    return max(free, key=lambda d: (shape[d], -d)) if free else None


_WARNED: set = set()


def _warn_replicated(path, leaf, axis_sizes) -> None:
    axes = ",".join(f"{a}={n}" for a, n in axis_sizes.items() if a != "data" and n > 1)
    key = (path_text(path), tuple(leaf.shape), axes)
    if axes and key not in _WARNED:
        _WARNED.add(key)
        print(f"jaxmem: warning: frozen base leaf {key[0]} {leaf.dtype}{list(leaf.shape)} is "
              f"replicated: mesh axis {axes} divides none of its axes", file=sys.stderr, flush=True)


def _largest(shape, dims, n, taken=()):
    """The largest of `dims` (not in `taken`) that `n` divides, or None."""
    ok = [d for d in dims if d not in taken and shape[d] % n == 0]
    return max(ok, key=lambda d: (shape[d], -d)) if ok else None


def _packed_specs(path, q: QuantizedWeight, axis_sizes) -> QuantizedWeight:
    """The PartitionSpecs of a stacked QuantizedWeight's leaves (module docstring), as a
    QuantizedWeight holding PartitionSpecs in place of arrays."""
    tensor, fsdp = axis_sizes.get("tensor", 1), axis_sizes.get("fsdp", 1)
    shape = tuple(q.codes.shape)  # [L, In/b, b', Out]
    codes: list = [None] * 4
    if q.codes.size >= MIN_SHARDED:
        if tensor > 1:
            dim = 1 if _role(path) in ROW_PARALLEL else 3
            if shape[dim] % tensor == 0:
                codes[dim] = "tensor"
        if fsdp > 1:
            taken = [d for d in range(4) if codes[d]]
            dim = _largest(shape, (1, 3), fsdp, taken)
            dim = _largest(shape, (2,), fsdp) if dim is None else dim
            if dim is not None:
                codes[dim] = "fsdp"
    out = {"codes": P(*codes), "absmax": None, "absmax_q": None, "absmax_scale": None,
           "absmax_offset": None}
    if q.absmax is not None:  # [L, In/b, Out]
        absmax = [None, codes[1], codes[3]]
        if fsdp > 1 and "fsdp" not in absmax and q.codes.size >= MIN_SHARDED:
            dim = _largest(q.absmax.shape, (1, 2), fsdp, [d for d in (1, 2) if absmax[d]])
            if dim is not None:
                absmax[dim] = "fsdp"
        out["absmax"] = P(*absmax)
    else:  # double quantization: [L, m, 256], [L, m], [L]
        m_split = fsdp > 1 and q.codes.size >= MIN_SHARDED and q.absmax_q.shape[1] % fsdp == 0
        in_block = (fsdp > 1 and q.codes.size >= MIN_SHARDED and not m_split
                    and q.absmax_q.shape[2] % fsdp == 0)
        out["absmax_q"] = P(None, "fsdp" if m_split else None, "fsdp" if in_block else None)
        out["absmax_scale"] = P(None, "fsdp") if m_split else P()
        out["absmax_offset"] = P()
    if q.codes.size >= MIN_SHARDED:
        for name in ("codes", "absmax", "absmax_q"):
            leaf = getattr(q, name)
            if leaf is not None and all(a is None for a in out[name]):
                _warn_replicated((*path, jax.tree_util.GetAttrKey(name)), leaf, axis_sizes)
    _, aux = q.tree_flatten()
    return QuantizedWeight(*(out[n] for n in ("codes", "absmax", "absmax_q", "absmax_scale",
                                              "absmax_offset")), *aux)


def base_specs(abstract_base, axis_sizes: dict[str, int]):
    """PartitionSpecs for a LoRA run's frozen base (jaxmem.peft.base.abstract_base or the
    device tree itself): plain arrays by `leaf_spec`, quantized projections by their packed
    layout (module docstring). Each QuantizedWeight comes back holding PartitionSpecs."""
    def one(path, x):
        if isinstance(x, QuantizedWeight):
            return _packed_specs(path, x, axis_sizes)
        return leaf_spec(path, tuple(x.shape), axis_sizes)
    return jax.tree_util.tree_map_with_path(one, abstract_base,
                                            is_leaf=lambda x: isinstance(x, QuantizedWeight))


def base_shardings(abstract_base, mesh):
    """NamedShardings for every leaf of a frozen base on `mesh` (see `base_specs`)."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec),
                        base_specs(abstract_base, dict(mesh.shape)),
                        is_leaf=lambda x: isinstance(x, P))


def packed_layer_shardings(abstract_base, mesh) -> dict:
    """{QuantizedWeight static data: per-leaf NamedShardings of one layer slice as stored} for
    jaxmem.quant.gather_packed: each stacked leaf's split without its layer axis, so inside
    the layer scan the packed layer is all-gathered over `fsdp` and stays split over `tensor`.
    Weights whose static data (kind, shape, n_in, block) coincide but whose splits differ get no
    entry (not gathered explicitly: XLA gathers them as it sees fit)."""
    specs = base_specs(abstract_base, dict(mesh.shape))
    table: dict = {}
    for q in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, (QuantizedWeight, P))):
        if not isinstance(q, QuantizedWeight):
            continue
        leaves, aux = q.tree_flatten()
        layer = tuple(None if s is None else NamedSharding(mesh, P(*tuple(s)[1:]))
                      for s in leaves)
        table[aux] = layer if table.get(aux, layer) == layer else None
    return {aux: layer for aux, layer in table.items() if layer is not None}


def _abstract_frozen(step_cfg):
    """The frozen base's shapes (allocating nothing); None when nothing is frozen."""
    return step_cfg.trainable.abstract_frozen(step_cfg.model, step_cfg.precision.compute_dtype)


def lora_base_shardings(step_cfg, mesh):
    """The frozen base's NamedShardings on `mesh` for a StepConfig with LoRA (None without)."""
    return base_shardings(_abstract_frozen(step_cfg), mesh)


def lora_packed_gather(step_cfg, mesh):
    """`packed_layer_shardings` of a quantized LoRA base (for jaxmem.quant.gather_packed);
    None for a full fine-tune or an unquantized base."""
    return packed_layer_shardings(_abstract_frozen(step_cfg), mesh)


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
    return with_given_shardings(abstract_state, state_shardings(abstract_state, mesh))


def with_given_shardings(abstract_state, shardings):
    """The abstract state with each ShapeDtypeStruct given its sharding of `shardings`."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        abstract_state, shardings)


def _seq(mesh):
    """The mesh axis the sequence is split over: `context` when it is larger than 1."""
    return "context" if dict(mesh.shape).get("context", 1) > 1 else None


def batch_sharding(mesh) -> NamedSharding:
    """A step batch [K, B, T]: B split over (data, fsdp), T over context."""
    return NamedSharding(mesh, P(None, BATCH_AXES, _seq(mesh)))


def eval_batch_sharding(mesh) -> NamedSharding:
    """An eval batch [B, T]: B split over (data, fsdp), T over context."""
    return NamedSharding(mesh, P(BATCH_AXES, _seq(mesh)))


def activation_rules(mesh, vocab_size: int | None = None) -> dict:
    """Rules for jaxmem.sharding.activation_sharding: [B, T, D] split on B (and on T over
    `context`, context parallelism); logits [B, T, V] likewise and also on V over `tensor` when
    the LM head is split there (V divisible)."""
    t = mesh.shape["tensor"]
    tensor = "tensor" if t > 1 and vocab_size is not None and vocab_size % t == 0 else None
    seq = _seq(mesh)
    return {"embed": NamedSharding(mesh, P(BATCH_AXES, seq, None)),
            "block": NamedSharding(mesh, P(BATCH_AXES, seq, None)),
            "logits": NamedSharding(mesh, P(BATCH_AXES, seq, tensor))}


def replicated(mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def weight_rule(mesh, num_layers: int):
    """The rule for jaxmem.sharding.weight_sharding: a weight's gradient gets the weight's
    own sharding (`leaf_spec`), one layer's slice inside the scan that of its stacked leaf
    without the layer axis; None (left alone) where nothing is split."""
    sizes = dict(mesh.shape)

    def rule(path: str, shape: tuple, stacked: bool):
        keys = tuple(path.split("/"))
        full = shape if stacked or "layers" not in keys else (num_layers, *shape)
        spec = leaf_spec(keys, full, sizes)
        if not stacked and "layers" in keys:
            spec = P(*tuple(spec)[1:]) if len(tuple(spec)) > 1 else P()
        if all(a is None for a in tuple(spec)):
            return None
        return NamedSharding(mesh, spec)
    return rule
