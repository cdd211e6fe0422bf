"""A LoRA / QLoRA step's frozen base and adapters as one device of a mesh holds them, and with
`--offload-base host` the base's bytes in host memory, apart from the device's.

    split = base_split(spec, {"fsdp": 2})        BaseSplit: per-device bytes of each part
    comps = base_components(spec, {"fsdp": 2})   the analytic components (name, bytes, dtype, phase)
    f = adapter_fraction(spec, {"fsdp": 2})      adapter elements one device holds / all of them
    host_split(compiled, stats, hlo_text)        a compiled step's host arguments and device peak

Example (Llama-3.1-70B, r 16, NF4 + double quant, amp-bf16, full remat, 2 x 2048 tokens):

    python -m jaxmem.memory --preset llama-3.1-70b --lora-rank 16 --quantize-base nf4 \
        --double-quant --offload-base host --precision amp-bf16 --remat full \
        --batch-size 2 --seq-len 2048 --mesh fsdp=2 --devices 2 --analytic-only
    -> analytic peak 10.81 GiB per device, 16.45 GiB of host memory per device, 27.05 GiB per
       device without --offload-base host

The base is counted leaf by leaf on its abstract form (jaxmem.peft.base.abstract_base: packed
NF4 nibbles or int8 codes, absmax or the double-quantization scales, embedding and LM head in the
compute dtype, norms fp32; nothing allocated), each leaf split as the sharding rules split it
(jaxmem.parallel.rules: `base_specs` for the packed projections, `fsdp` on a divisible axis of
the codes and with them their scales, `tensor` on the Megatron axis where the block layout
allows; `leaf_spec` for the rest: small leaves and norms whole). So the numbers follow the
rules exactly, and a leaf the rules leave whole is counted whole on every device.

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
    LM head, gathered               whole over fsdp for the loss (an all-gather in the compiled
                                    step); counted where the loss's logits group with it is
                                    larger than a layer's backward with its gathered layer

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
from jax.sharding import PartitionSpec as P

from jaxmem.memory.spec import StepSpec
from jaxmem.paths import in_layers, path_text
import jaxmem.parallel.rules as rules
from jaxmem.xla.hlo import entry_argument_bytes

OFFLOAD_KINDS = ("none", "host")
LAYER_COPY = "frozen layer copied from the host"
LAYER_GATHERED = "frozen layer gathered (fsdp)"


@dataclass(frozen=True)
class BaseSplit:
    """Bytes of the frozen base on one device of a mesh (see the module docstring).

    layers: the device's shard of the stacked block layers (all L of them).
    other: its shard of the embedding, the LM head and the final norm.
    layer_copy: one layer's shard (layers / L): what is copied in from the host per layer.
    layer_gathered: one layer gathered over fsdp (each leaf's layer slice / its tensor split).
    replicated: bytes of the leaves the rules leave whole although the mesh has > 1 device.
    dtypes: the dtypes of the block layers' leaves, joined with "+".
    head_gathered: the LM head (the embedding when tied) gathered whole over fsdp for the loss
        (seen in the compiled 70B step: an all-gather of the [8192, 128256] head), 0 when fsdp
        does not split it.
    """

    layers: int
    other: int
    layer_copy: int
    layer_gathered: int
    replicated: int
    dtypes: str
    head_gathered: int = 0


@functools.lru_cache(maxsize=16)
def _abstract_base(model, peft, dtype_name: str):
    from jaxmem.peft.base import abstract_base
    return abstract_base(model, peft, jnp.dtype(dtype_name))


def _split(spec, sizes: dict[str, int]) -> tuple[int, int]:
    """(devices a leaf with PartitionSpec `spec` is split over, of which over tensor)."""
    axes = [n for a in spec if a for n in ((a,) if isinstance(a, str) else a)]
    tensor = sizes.get("tensor", 1) if "tensor" in axes else 1
    return math.prod(sizes.get(a, 1) for a in axes), tensor


def _base_leaves(base, sizes: dict[str, int]):
    """(path, leaf, PartitionSpec) of every leaf of the abstract base under the rules: packed
    projections by rules.base_specs (their packed layout), the rest by rules.leaf_spec."""
    if not sizes or math.prod(sizes.values()) == 1:
        specs = jax.tree.map(lambda _: P(), base)
    else:
        specs = rules.base_specs(base, sizes)
    flat = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P))
    return [(p, x, s) for (p, x), s in zip(jax.tree_util.tree_leaves_with_path(base), flat)]


def base_split(spec: StepSpec, sizes: dict[str, int]) -> BaseSplit:
    """The frozen base of a LoRA step on one device of a mesh of axis `sizes` ({} : one device)."""
    model = spec.model
    base = _abstract_base(model, spec.trainable, jnp.dtype(spec.precision.compute_dtype).name)
    L = model.num_layers
    layers = other = gathered = replicated = head = 0
    dtypes = set()
    devices = math.prod(sizes.values()) if sizes else 1
    for path, leaf, leaf_spec in _base_leaves(base, sizes):
        nbytes = int(leaf.size) * leaf.dtype.itemsize
        split, tensor = _split(leaf_spec, sizes)
        if split == 1 and devices > 1:
            replicated += nbytes
        if in_layers(path):
            layers += nbytes // split
            gathered += nbytes // L // tensor
            dtypes.add(leaf.dtype.name)
        else:
            other += nbytes // split
            name = path_text(path).split("/")[-1]
            if (name == "lm_head" or (name == "embed_tokens" and model.tie_embeddings)) \
                    and "fsdp" in leaf_spec:
                head = nbytes // tensor
    return BaseSplit(layers, other, layers // L, gathered, replicated, "+".join(sorted(dtypes)),
                     head)


def base_components(spec: StepSpec, sizes: dict[str, int],
                    transients: dict | None = None) -> list[tuple[str, int, str, str]]:
    """(name, bytes, dtype, phase) of the frozen base on one device; phase "host" for what lives
    in host memory with --offload-base host (never part of a device peak).

    transients: analytic_breakdown's "transients" at the local batch; with them, the LM head
    gathered for the loss is counted where it raises the peak: the backward phase holds one
    layer's backward with its gathered layer, or the loss's logits group with the gathered head,
    whichever is larger (the breakdown already holds the larger of the two without the weights).
    """
    s = base_split(spec, sizes)
    cd = jnp.dtype(spec.precision.compute_dtype).name
    kind = spec.trainable.quantize + ("+dq" if spec.trainable.double_quant else "")
    host = spec.offload_base == "host"
    # names fit the breakdown table's column (34 characters)
    out = [(f"frozen layers {kind}" + (" (host)" if host else ""), s.layers, s.dtypes,
            "host" if host else "both"),
           ("frozen embed, head, final norm", s.other, cd, "both")]
    if host:
        out.append((LAYER_COPY, s.layer_copy, s.dtypes, "backward"))
    if sizes.get("fsdp", 1) > 1:
        out.append((LAYER_GATHERED, s.layer_gathered, s.dtypes, "backward"))
    if s.head_gathered and transients:
        logits, layer = transients["logits_group_bytes"], transients["layer_backward_bytes"]
        layer_weights = sum(b for n, b, _, _ in out if n in (LAYER_COPY, LAYER_GATHERED))
        extra = logits + s.head_gathered - max(logits, layer) - layer_weights
        out.append(("frozen LM head gathered (fsdp)", max(0, extra), cd, "backward"))
    return out


def _abstract_adapters(spec: StepSpec):
    key = jax.eval_shape(lambda: jax.random.PRNGKey(0))  # abstract: no op on a --target device
    return jax.eval_shape(lambda k: spec.trainable.init_adapters(spec.model, k), key)


def adapter_fraction(spec: StepSpec, sizes: dict[str, int]) -> float:
    """Elements of the adapters one device holds under the rules, over all their elements."""
    total = local = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(_abstract_adapters(spec)):
        total += leaf.size
        local += leaf.size // _split(rules.leaf_spec(path, tuple(leaf.shape), sizes), sizes)[0]
    return local / total


def host_split(compiled, stats: dict, hlo_text: str) -> dict:
    """{"host_argument_bytes", "device_peak_bytes"} of a compiled step: the host arguments as
    memory_analysis() reports them apart (GPU), else as the entry layout marks them (XLA:CPU,
    where they are inside argument_size_in_bytes and so taken out of the device peak)."""
    reported = int(getattr(compiled.memory_analysis(), "host_argument_size_in_bytes", 0) or 0)
    marked = 0 if reported else entry_argument_bytes(hlo_text)[0]
    return {"host_argument_bytes": reported or marked,
            "host_source": "memory_analysis" if reported else "entry layout S(5)",
            "device_peak_bytes": stats["peak_bytes"] - marked}


def compare_line(r: dict) -> str:
    """analytic / compiled device peak of a per-device report: the compiled device peak (host
    arguments out), against the analytic figure of the program that was compiled (without
    offload when the compiled step keeps the base on the device)."""
    a, c = r["analytic"], r["compiled"]
    analytic, what = a["total"], ""
    if "analytic_without_offload" in r and not c.get("host_argument_bytes"):
        analytic, what = r["analytic_without_offload"], " (both without offload)"
    return (f"analytic / compiled peak: "
            f"{analytic / c.get('device_peak_bytes', c['peak_bytes']):.3f}{what}")


def format_host_lines(r: dict, div: int) -> list[str]:
    """The host lines of a per-device report (jaxmem.memory.mesh.mesh_report)."""
    a = r["analytic"]
    if not a.get("host"):
        return []
    unit = "MiB" if div == 2**20 else "GiB"
    return [f"{'analytic, host memory (pinned), per device':56s} {a['host'] / div:10.2f}",
            f"{'analytic peak without --offload-base host':56s} "
            f"{r['analytic_without_offload'] / div:10.2f}  ({unit}, device)"]


def format_compiled_host(c: dict, div: int, offload: bool = False) -> list[str]:
    """What the compiled program puts in host memory: its arguments marked with the host
    memory space in the entry layout (memory_analysis() on XLA:CPU counts them as device
    arguments; see jaxmem.xla.hlo.entry_argument_bytes). offload: --offload-base host was asked for; a program
    with no argument on the host is then said not to offload."""
    host = c.get("host_argument_bytes", 0)
    if not host:
        return ["note: the compiled step has no argument in host memory: its figures are those of "
                "the base on the device (this build does not offload it)"] if offload else []
    unit = "MiB" if div == 2**20 else "GiB"
    return [f"compiled arguments in host memory ({c['host_source']}): {host / div:.2f} {unit}; "
            f"device peak: {c['device_peak_bytes'] / div:.2f} {unit}"]
