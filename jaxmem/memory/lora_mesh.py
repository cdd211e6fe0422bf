"""A LoRA / QLoRA step's frozen base and adapters as one device of a mesh holds them, and with
`--offload-base host` the base's bytes in host memory, apart from the device's.

    split = base_split(spec, {"fsdp": 2})        BaseSplit: per-device bytes of each part
    comps = base_components(spec, {"fsdp": 2})   the analytic components (name, bytes, dtype, phase)
    f = adapter_fraction(spec, {"fsdp": 2})      adapter elements one device holds / all of them

The base is counted leaf by leaf on its abstract form (jaxmem.peft.base.abstract_base: packed
NF4 nibbles or int8 codes, absmax or the double-quantization scales, embedding and LM head in the
compute dtype, norms fp32; nothing allocated), each leaf split as the sharding rules split it
(jaxmem.parallel.rules.leaf_spec: `fsdp` on a divisible axis, `tensor` on the Megatron axis where
the layout allows, small leaves and norms whole). So the numbers follow the rules exactly, and a
leaf the rules leave whole is counted whole on every device.

What one device holds for the base during a step:

    stacked block layers [L, ...]   its shard of every layer (on the host with offload)
    embedding, LM head, final norm  its shard (always on the device: they are not in the scan)
    one layer, gathered             inside the layer scan, the layer being computed: each leaf's
                                    layer slice, whole over `fsdp` (still split over `tensor`);
                                    counted once the mesh has fsdp > 1
    one layer, copied in            with offload: the device's shard of that layer, moved from
                                    pinned host memory to the device inside the scan (MaxText's
                                    parameter_memory_host_offload); counted next to the gathered
                                    one, since the copy feeds the gather

The two layer buffers are counted in the step's backward phase, which is where the peak is (the
forward and the backward each gather a layer at a time; with remat the backward gathers it
again). XLA may prefetch the next layer's copy or gather while the current one computes; that
would add one more layer buffer, and is not counted (not observable in a CPU compile).

With offload the host bytes are per device: a process holds those of its local devices.
Adapters and their optimizer state are split like the adapters' leaves under the same rules
(`adapter_fraction`), so gradients, moments and the update buffer follow them.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxmem.memory.spec import StepSpec
from jaxmem.model.roles import path_text
from jaxmem.parallel.rules import leaf_spec

OFFLOAD_KINDS = ("none", "host")


@dataclass(frozen=True)
class BaseSplit:
    """Bytes of the frozen base on one device of a mesh (see the module docstring).

    layers: the device's shard of the stacked block layers (all L of them).
    other: its shard of the embedding, the LM head and the final norm.
    layer_copy: one layer's shard (layers / L): what is copied in from the host per layer.
    layer_gathered: one layer gathered over fsdp (each leaf's layer slice / its tensor split).
    replicated: bytes of the leaves the rules leave whole although the mesh has > 1 device.
    dtypes: the dtypes of the block layers' leaves, joined with "+".
    """

    layers: int
    other: int
    layer_copy: int
    layer_gathered: int
    replicated: int
    dtypes: str


@functools.lru_cache(maxsize=16)
def _abstract_base(model, peft, dtype_name: str):
    from jaxmem.peft.base import abstract_base
    return abstract_base(model, peft, jnp.dtype(dtype_name))


def _split(shape, path, sizes: dict[str, int]) -> tuple[int, int]:
    """(devices the leaf is split over, of which over tensor) under the rules."""
    spec = leaf_spec(path, tuple(shape), sizes)
    axes = [a for a in spec if a]
    return math.prod(sizes.get(a, 1) for a in axes), sizes.get("tensor", 1) if "tensor" in axes else 1


def base_split(spec: StepSpec, sizes: dict[str, int]) -> BaseSplit:
    """The frozen base of a LoRA step on one device of a mesh of axis `sizes` ({} : one device)."""
    model = spec.model
    base = _abstract_base(model, spec.peft, jnp.dtype(spec.precision.compute_dtype).name)
    L = model.num_layers
    layers = other = gathered = replicated = 0
    dtypes = set()
    devices = math.prod(sizes.values()) if sizes else 1
    for path, leaf in jax.tree_util.tree_leaves_with_path(base):
        nbytes = int(leaf.size) * leaf.dtype.itemsize
        split, tensor = _split(leaf.shape, path, sizes)
        if split == 1 and devices > 1:
            replicated += nbytes
        if "layers" in path_text(path).split("/"):
            layers += nbytes // split
            gathered += nbytes // L // tensor
            dtypes.add(leaf.dtype.name)
        else:
            other += nbytes // split
    return BaseSplit(layers, other, layers // L, gathered, replicated, "+".join(sorted(dtypes)))


def base_components(spec: StepSpec, sizes: dict[str, int]) -> list[tuple[str, int, str, str]]:
    """(name, bytes, dtype, phase) of the frozen base on one device; phase "host" for what lives
    in host memory with --offload-base host (never part of a device peak)."""
    s = base_split(spec, sizes)
    cd = jnp.dtype(spec.precision.compute_dtype).name
    kind = spec.peft.quantize + ("+dq" if spec.peft.double_quant else "")
    host = spec.offload_base == "host"
    out = [(f"frozen base: block layers ({kind})" + (" on the host (pinned)" if host else ""),
            s.layers, s.dtypes, "host" if host else "both"),
           ("frozen base: embed + head + final norm", s.other, cd, "both")]
    if host:
        out.append(("frozen base: one layer copied from the host", s.layer_copy, s.dtypes,
                    "backward"))
    if sizes.get("fsdp", 1) > 1:
        out.append(("frozen base: one layer gathered (fsdp)", s.layer_gathered, s.dtypes,
                    "backward"))
    return out


def _abstract_adapters(spec: StepSpec):
    return jax.eval_shape(lambda k: spec.peft.init_adapters(spec.model, k), jax.random.PRNGKey(0))


def adapter_fraction(spec: StepSpec, sizes: dict[str, int]) -> float:
    """Elements of the adapters one device holds under the rules, over all their elements."""
    total = local = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(_abstract_adapters(spec)):
        total += leaf.size
        local += leaf.size // _split(leaf.shape, path, sizes)[0]
    return local / total
