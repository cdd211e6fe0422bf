"""What a train step holds that is an argument or output of a program, counted, not derived.

Every figure is read off the program's own abstract values (the state program's `eval_shape`,
the frozen base's packed codes and scales, the batch), each leaf split as the placement splits
it (jaxmem.parallel.rules): one device's bytes are exactly the compiled program's argument bytes
per device (tests/test_counted.py). What no argument holds (gradients, the accumulator, the
compute copy, one gathered layer) is counted on the tree it is shaped like. Code never matches
a component's label: `kind` and `where` say what it is.
"""

from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jaxmem.parallel.rules as rules
from jaxmem.memory.spec import StepSpec
from jaxmem.model.roles import param_role
from jaxmem.peft.offload import HOST_KIND
from jaxmem.paths import in_layers, key_name
from jaxmem.train import abstract_train_state, objective_batch


class Kind(enum.Enum):
    """What a component of a step's memory is."""

    PARAMS = "params"                  # the state's trained params (master copy)
    OPTIMIZER = "optimizer state"
    LOSS_SCALE = "loss scale"
    COUNTERS = "counters"              # step, applied, skips, data position, rng
    FROZEN = "frozen base"             # LoRA / QLoRA: never differentiated
    BATCH = "batch"
    GRADIENTS = "gradients"
    ACCUMULATOR = "grad accumulator"
    COMPUTE_COPY = "compute copy"      # amp: the params cast to the compute dtype
    ACTIVATIONS = "saved activations"
    TRANSIENT = "transient"            # the largest working set of the backward
    UPDATE = "optimizer update"        # what the update holds beyond state and gradients
    LAYER = "one layer in flight"      # gathered over fsdp, or copied in from the host


class Where(enum.Enum):
    DEVICE = "device"
    HOST = "host"  # pinned host memory: never part of a device peak


class Phase(enum.Enum):
    """When a component is live: the whole step, or only the backward / the update."""

    BOTH = "both"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


@dataclass(frozen=True)
class Component:
    kind: Kind
    label: str  # for people: printed, never compared
    bytes: int
    dtype: str
    phase: Phase = Phase.BOTH
    where: Where = Where.DEVICE

    def live_in(self, phase: Phase) -> bool:
        return self.where is Where.DEVICE and self.phase in (Phase.BOTH, phase)

    def row(self, peak: Phase) -> dict:
        """The JSON / table row (phase "host" for host memory)."""
        return {"name": self.label, "kind": self.kind.value, "bytes": int(self.bytes),
                "dtype": self.dtype, "where": self.where.value,
                "phase": "host" if self.where is Where.HOST else self.phase.value,
                "in_peak": self.live_in(peak)}


def nbytes(x) -> int:
    """Bytes of one array or ShapeDtypeStruct (4-bit types packed two to a byte)."""
    if x.dtype in (jnp.uint4, jnp.int4):
        return int(x.size) // 2
    return int(x.size) * jnp.dtype(x.dtype).itemsize


def tree_bytes(tree) -> int:
    """Bytes of every leaf of a pytree of arrays or ShapeDtypeStructs (None: 0)."""
    return sum(nbytes(x) for x in jax.tree_util.tree_leaves(tree))


def shards(spec: P, sizes: dict[str, int]) -> int:
    """Devices a leaf with PartitionSpec `spec` is split over, on a mesh of axis `sizes`."""
    axes = [n for a in spec if a for n in ((a,) if isinstance(a, str) else a)]
    return math.prod(sizes.get(a, 1) for a in axes)


def local_bytes(tree, sizes: dict[str, int], specs=None) -> int:
    """One device's bytes of `tree` (abstract) split by `specs` (default: rules.leaf_spec)."""
    return sum(b for _, _, b in _leaves(tree, sizes, specs))


def _leaves(tree, sizes, specs=None):
    """(path, leaf, bytes on one device) of every leaf of `tree`."""
    flat = jax.tree_util.tree_leaves_with_path(tree)
    if specs is None:
        many = math.prod(sizes.values()) > 1
        return [(p, x, nbytes(x) // (shards(rules.leaf_spec(p, tuple(x.shape), sizes), sizes)
                                     if many else 1)) for p, x in flat]
    spec_leaves = jax.tree_util.tree_leaves(specs, is_leaf=lambda s: isinstance(s, P))
    return [(p, x, nbytes(x) // shards(s, sizes)) for (p, x), s in zip(flat, spec_leaves)]


def _dtypes(leaves) -> str:
    return "+".join(sorted({jnp.dtype(x.dtype).name for _, x, b in leaves if b})) or "-"


def _group(kind: Kind, label: str, leaves, **kw) -> list[Component]:
    total = sum(b for _, _, b in leaves)
    return [Component(kind, label, total, _dtypes(leaves), **kw)] if leaves else []


def abstract_state(spec: StepSpec):
    """The train state as ShapeDtypeStructs: `jax.eval_shape` of the program that makes it, on
    the spec's StepConfig and loss scale (once per StepConfig: the batch does not change it)."""
    step, loss_scale = spec.step_config()
    if step not in _STATES:
        _STATES.clear() if len(_STATES) >= 32 else None  # bounded: a search tries many
        _STATES[step] = abstract_train_state(step, loss_scale)
    return _STATES[step]


_STATES: dict = {}  # StepConfig -> its abstract train state


def abstract_frozen(spec: StepSpec):
    """A LoRA step's frozen base (int8 / NF4 codes and scales) as ShapeDtypeStructs, else None."""
    return _abstract_frozen(spec.trainable, spec.model, spec.precision.compute_dtype)


@functools.lru_cache(maxsize=32)
def _abstract_frozen(trainable, model, dtype):
    return trainable.abstract_frozen(model, dtype)


def abstract_step_batch(spec: StepSpec):
    """The step's batch [K, B, T] as ShapeDtypeStructs."""
    return {k: jax.ShapeDtypeStruct((spec.grad_accum,) + v.shape, v.dtype)
            for k, v in objective_batch(spec.step, spec.batch_size, spec.seq_len).items()}


def _optimizer_label(path, leaf) -> str:
    """What an optimizer-state leaf is: a field of a Quantized node, a counter or a moment."""
    last = path[-1] if path else None
    if isinstance(last, jax.tree_util.GetAttrKey) and last.name in ("codes", "scale"):
        return "optimizer: 8-bit moment " + ("codes" if last.name == "codes" else "block scales")
    if leaf.ndim == 0:
        return "optimizer: counters"
    return f"optimizer: moments ({jnp.dtype(leaf.dtype).name})"


def count_state(spec: StepSpec, sizes: dict[str, int] | None = None) -> list[Component]:
    """The step's arguments on one device of a mesh of axis `sizes` ({} or None: one device):
    the train state by field (the optimizer's leaves by what they are), the frozen base and the
    batch."""
    sizes = sizes or {}
    fields = {}  # TrainState attribute -> its leaves
    for x in _leaves(abstract_state(spec), sizes):
        fields.setdefault(key_name(x[0][0]), []).append(x)
    on_host = state_on_host(spec)  # the same leaves on every device of a mesh
    opt = fields.pop("opt_state", [])
    out = []
    for where in (Where.DEVICE, Where.HOST):
        here = where is Where.HOST
        mine = lambda leaves: [y for y in leaves if (y[0] in on_host) == here]  # noqa: E731
        host = " (host)" if where is Where.HOST else ""
        out += _group(Kind.PARAMS, f"{spec.trainable.params_name} (master){host}",
                      mine(fields.get("params", [])), where=where)
        for label in sorted({_optimizer_label(p, x) for p, x, _ in opt}):
            out += _group(Kind.OPTIMIZER, label + host,
                          mine([y for y in opt if _optimizer_label(*y[:2]) == label]), where=where)
    fields.pop("params", None)
    out += _group(Kind.LOSS_SCALE, "loss scale", fields.pop("loss_scale", []))
    out += _group(Kind.COUNTERS, "counters and rng", [y for v in fields.values() for y in v])
    out += count_frozen(spec, sizes)
    batch = abstract_step_batch(spec)
    bspec = P(None, ("data", "fsdp"), "context")
    out += _group(Kind.BATCH, "batch (inputs, targets, mask)",
                  _leaves(batch, sizes, {k: bspec for k in batch}))
    return out


@functools.lru_cache(maxsize=32)
def _frozen(spec: StepSpec, sizes: tuple):
    """A LoRA step's frozen base on one device of a mesh of axis sizes `dict(sizes)`: its stacked
    layers' (path, leaf, bytes), the rest's, whether the layers live on the host (cached: an
    analytic breakdown asks three times)."""
    base, sizes = abstract_frozen(spec), dict(sizes)
    leaves = [] if base is None else _leaves(base, sizes, (
        rules.base_specs(base, sizes) if math.prod(sizes.values()) > 1
        else jax.tree.map(lambda _: P(), base)))
    return (tuple(x for x in leaves if in_layers(x[0])),
            tuple(x for x in leaves if not in_layers(x[0])),
            spec.placement.base_on_host)


def count_frozen(spec: StepSpec, sizes: dict[str, int]) -> list[Component]:
    """A LoRA step's frozen base on one device: its stacked layers (on the host with
    --offload-base host) and the rest (embedding, head, final norm: always on the device)."""
    layers, rest, host = _frozen(spec, tuple(sizes.items()))
    q = spec.trainable
    kind = getattr(q, "quantize", "none") + ("+dq" if getattr(q, "double_quant", False) else "")
    return (_group(Kind.FROZEN, f"frozen layers {kind}" + (" (host)" if host else ""), layers,
                   where=Where.HOST if host else Where.DEVICE)
            + _group(Kind.FROZEN, "frozen embed, head, final norm", rest))


def state_on_host(spec: StepSpec) -> set:
    """Paths (from the train state's root) of the state's leaves the placement keeps in pinned
    host memory (--offload-optimizer / --offload-params host): the one-device placement's own
    shardings say which (on a mesh each device keeps its shard of the same leaves there)."""
    if not spec.placement.host_parts:
        return set()
    placed = spec.placement.abstract(abstract_state(spec))
    return {p for p, x in jax.tree_util.tree_leaves_with_path(placed)
            if getattr(x.sharding, "memory_kind", None) == HOST_KIND}


def _host_layer(spec: StepSpec) -> list[Component]:
    """Two layers of each host-resident stacked state leaf, as the in-backward loop holds them
    on the device where the weights live on the host: the layer being updated (the params'
    layer also recomputed) and the one it prefetches (jaxmem.train.inbackward). The state
    alone on the host streams by sub-piece: nothing here."""
    host = state_on_host(spec)
    if not host or not spec.in_backward:  # without it: the 8-bit update's row pieces (its
        return []                           # working set) stream, no layer
    # the state alone on the host comes a sub-piece at a time (the update's working set holds
    # it); the loop prefetches layers only where the weights are on the host
    prefetch = spec.step.optim.params_on_host
    L, out = spec.model.num_layers, []
    leaves = [(p, x, nbytes(x)) for p, x in jax.tree_util.tree_leaves_with_path(
        abstract_state(spec)) if p in host]
    for kind, label in ((Kind.PARAMS, "two layers' weights copied from the host"),
                        (Kind.OPTIMIZER, "two layers' optimizer state copied from the host")):
        if kind is Kind.OPTIMIZER and not prefetch:
            continue
        mine = [y for y in leaves if (key_name(y[0][0]) == "params") == (kind is Kind.PARAMS)]
        layers = [y for y in mine if in_layers(y[0])]
        # another leaf's state comes whole, but for the 8-bit optimizer's, which comes a row
        # piece at a time (the update's working set holds that piece)
        piecewise = kind is Kind.OPTIMIZER and spec.step.optimizer.in_place is not None
        rest = 0 if piecewise else max((b for p, _, b in mine if not in_layers(p)), default=0)
        part = max(2 * sum(b for _, _, b in layers) // L, rest)
        if part:
            out.append(Component(Kind.LAYER, label, part, _dtypes(mine), Phase.BACKWARD))
    return out


def layer_in_flight(spec: StepSpec, sizes: dict[str, int]) -> list[Component]:
    """One layer of the weights as the backward holds it beyond the state: a full fine-tune
    under fsdp gathers each layer in the compute dtype; a LoRA base under fsdp gathers its
    packed layer (split over tensor still), and with --offload-base host the device's shard of
    the layer is copied in from the host first (both live together: the copy feeds the gather).
    """
    fsdp = sizes.get("fsdp", 1) * sizes.get("context", 1)
    L, t = spec.model.num_layers, sizes.get("tensor", 1)
    out = _host_layer(spec) if math.prod(sizes.values()) == 1 else []
    frozen, _, host = _frozen(spec, tuple(sizes.items()))
    if frozen and host:
        out.append(Component(Kind.LAYER, "frozen layer copied from the host",
                             sum(b for _, _, b in frozen) // L, _dtypes(frozen), Phase.BACKWARD))
    if fsdp > 1 and frozen:
        whole = sum(nbytes(x) for _, x, _ in frozen)
        out.append(Component(Kind.LAYER, "frozen layer gathered (fsdp)", whole // L // t,
                             _dtypes(frozen), Phase.BACKWARD))
    if fsdp > 1 and abstract_frozen(spec) is None:
        cd = jnp.dtype(spec.precision.compute_dtype)
        stacked = sum(int(x.size) for p, x, _ in trained_leaves(spec, {}) if in_layers(p))
        out.append(Component(Kind.LAYER, "one layer's gathered weights (fsdp)",
                             stacked // L * cd.itemsize // t, cd.name, Phase.BACKWARD))
    return out


def head_gathered(spec: StepSpec, sizes: dict[str, int]) -> int:
    """Bytes of a frozen LM head (or tied embedding) gathered whole over fsdp for the loss (0
    where the rules keep it whole or nothing is frozen)."""
    if math.prod(sizes.values()) == 1:
        return 0
    for p, x, b in _frozen(spec, tuple(sizes.items()))[1]:
        role = param_role(p)
        head = role == "lm_head" or (role == "embedding" and spec.model.tie_embeddings)
        if head and b < nbytes(x):
            return nbytes(x) // sizes.get("tensor", 1)
    return 0


def trained_leaves(spec: StepSpec, sizes: dict[str, int]):
    """(path, leaf, bytes on one device) of the state's trained params."""
    return _leaves(abstract_state(spec).params, sizes)


def _part(spec: StepSpec, leaves, part: bool) -> int:
    """Bytes of `leaves`: all of them, or (part) the largest in-backward part: one layer of the
    stacked leaves (its MLP weights' by one slab of F where the step cuts them,
    jaxmem.train.inbackward_slabs) or one other leaf whose gradient the step holds whole (not
    the embedding's nor a head's made in pieces: the step's footprint, jaxmem.train.footprint)."""
    if not part:
        return sum(b for _, _, b in leaves)
    pieces = spec.footprint.streamed
    layer = sum(b for p, _, b in leaves if in_layers(p)) // spec.model.num_layers
    w, F = spec.footprint.mlp_slab, spec.model.intermediate_size
    if w:  # the MLP's weight gradients made and applied a slab of F at a time
        mlp = sum(b for p, _, b in leaves if in_layers(p) and "mlp" in map(key_name, p))
        layer -= mlp // spec.model.num_layers * (F - w) // F
    return max([layer] + [b for p, _, b in leaves
                          if not in_layers(p) and key_name(p[0]) not in pieces])


def gradient_part(spec: StepSpec, sizes: dict[str, int]) -> int:
    """Bytes of the gradients live at once, in the params' dtype: all of them, or with
    --optimizer-in-backward (jaxmem.train.inbackward) one part, the largest."""
    return _part(spec, trained_leaves(spec, sizes), spec.in_backward)


def compute_copy(spec: StepSpec, sizes: dict[str, int], part: bool = False) -> int:
    """amp (compute dtype != params' dtype): bytes of the trained params the backward holds cast
    to the compute dtype: every matrix it multiplies by (not the norms, nor an untied
    embedding, which is only gathered). 0 where nothing is cast. part: one in-backward part."""
    p = spec.precision
    cd, pd = jnp.dtype(p.compute_dtype), jnp.dtype(p.param_dtype)
    if cd == pd:
        return 0
    tied = spec.model.tie_embeddings
    return _part(spec, [(q, x, b // pd.itemsize * cd.itemsize)
                        for q, x, b in trained_leaves(spec, sizes)
                        if param_role(q) != "norm" and (tied or param_role(q) != "embedding")],
                 part)


def params_fraction(spec: StepSpec, sizes: dict[str, int]) -> float:
    """Elements of the trained params one device holds, over all of them."""
    leaves = trained_leaves(spec, sizes)
    return sum(b for _, _, b in leaves) / max(1, sum(nbytes(x) for _, x, _ in leaves))


def largest_param_leaf(spec: StepSpec) -> int:
    """Elements of the largest leaf of the state's trained params (the state program makes a
    stacked one a layer's fp32 slice at a time: jaxmem.model.typed_init)."""
    return max(int(x.size) for x in jax.tree_util.tree_leaves(abstract_state(spec).params))
