"""`--offload-base host`: the frozen base's layers live in pinned host memory and reach the device
one layer at a time, inside the layer scan (as MaxText's `parameter_memory_host_offload`).

    frozen = base_in_host_memory(host, spec, dtype)   # layers/* in pinned_host, the rest on device
    state, metrics = train_step(state, batch, frozen)  # the model fetches layer i in iteration i
    host_argument_bytes(compiled)                      # the arguments' bytes XLA put on the host

What goes where: every leaf under params["layers"] (the seven projections, int8 / NF4 codes and
scales included, and the block norms) is stacked [L, ...] in pinned host memory. The embedding,
the final norm and the LM head stay on the device: the embedding gather and the (fused) LM head
read them whole, so offloading them would only add a whole-array copy per step.

The copy to the device is `jax.device_put(leaf, jax.memory.Space.Device)` on the sliced layer
inside the scanned block (jaxmem.model.llama.layer_to_device): the model sees the leaves' memory
space in their avals and adds the copy only where a leaf is in host memory. The copy is tagged
"base_layer" and never saved for the backward, so the backward's loop fetches each layer again.

What each backend does with it (jax 0.10.2, read from jax/_src/dispatch.py and measured here):
- GPU / TPU: the device_put lowers to `annotate_device_placement` (`_xla_buffer_placement =
  "device"`) inside the while body; XLA's host offloader turns it into a host-to-device copy per
  iteration, which it may prefetch one layer ahead (overlap with compute is the GPU's to show).
- CPU: the arguments are placed in `pinned_host` memory (compiled entry layout `S(5)`), but
  device_put inside jit lowers to nothing (host and device memory are the same RAM), and
  `memory_analysis()` counts those arguments in `argument_size_in_bytes`, never in
  `host_argument_size_in_bytes` (0). `host_argument_bytes` reads the layout instead.
So on a CPU the numerics and the program structure are testable (tests/test_offload.py lowers
for CUDA without a GPU to check the copy sits in the loop); the device-memory saving is not.
"""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem.model.roles import param_role
from jaxmem.peft.lora import LoraSpec
from jaxmem.peft.quant import QuantizedWeight, quantize

HOST_KIND = "pinned_host"
MODES = ("none", "host")


def host_memory_kind(device=None) -> str | None:
    """"pinned_host" where `device` has that memory space (CPU, GPU and TPU in jax 0.10 / 0.11),
    else None."""
    device = device or jax.devices()[0]
    try:
        kinds = {m.kind for m in device.addressable_memories()}
    except Exception:  # a runtime without the memories API
        return None
    return HOST_KIND if HOST_KIND in kinds else None


def host_sharding(sharding):
    """`sharding` (SingleDeviceSharding or NamedSharding) in pinned host memory."""
    return sharding.with_memory_kind(HOST_KIND)


def _stack(layers: list, target):
    """Per-layer device arrays -> one [L, ...] array placed with `target`, assembled in numpy:
    the stacked leaf never exists on the device unless `target` puts it there."""
    return jax.device_put(np.stack([np.asarray(x) for x in layers]), target)


def _layer_leaf(leaf, spec: LoraSpec, dtype, role: str, target):
    """One stacked base leaf [L, ...] (host numpy) -> placed with `target`: projections quantized
    (or cast) one layer at a time on the device, as quantize_layers does; norms as stored."""
    L = leaf.shape[0]
    if role == "norm":
        return jax.device_put(np.asarray(leaf), target)
    if spec.quantize == "none":
        cast = jax.jit(lambda w: w.astype(dtype))
        return _stack([cast(jnp.asarray(leaf[i])) for i in range(L)], target)
    n_in = 2 if role == "o_proj" else 1
    fn = jax.jit(lambda w: quantize(w, spec.quantize, n_in, spec.block, spec.double_quant))
    layers = [fn(jnp.asarray(leaf[i])) for i in range(L)]
    parts = zip(*(q.tree_flatten()[0] for q in layers))
    leaves = [None if p[0] is None else _stack(p, target) for p in parts]
    return QuantizedWeight.tree_unflatten(layers[0].tree_flatten()[1], leaves)


def base_in_host_memory(host_params, spec: LoraSpec, dtype, sharding=None):
    """The frozen base as jaxmem.peft.base.base_on_device makes it (same values, bitwise), with
    every leaf under "layers" in pinned host memory and the rest on the device.

    Args:
      host_params: the base's numpy tree (jaxmem.peft.base.base_on_host), layers stacked [L, ...].
      spec: the run's LoraSpec (quantize, block, double_quant).
      dtype: the compute dtype of the dense leaves (embedding, head, unquantized projections).
      sharding: the device sharding of a layer leaf (default: the default device's); its
        pinned-host twin holds the stacked leaves. Only one layer's 16/32-bit slice is ever on
        the device.
    Returns: the params tree of the step's `frozen` argument. Without a pinned_host memory
    space: `base_on_device`'s placement with one warning line (nothing offloaded).
    """
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    device = next(iter(sharding.device_set))
    target = host_sharding(sharding)
    if host_memory_kind(device) is None:
        warnings.warn(f"--offload-base host: {device.platform} device {device} has no "
                      f"{HOST_KIND} memory; the base stays on the device", stacklevel=2)
        target = sharding

    def place(path, leaf):
        role = param_role(path)
        if any(getattr(k, "key", None) == "layers" for k in path):
            return _layer_leaf(leaf, spec, dtype, role, target)
        return jnp.asarray(leaf) if role == "norm" else jnp.asarray(leaf, dtype)
    return jax.tree_util.tree_map_with_path(place, host_params)


def abstract_in_host_memory(abstract_base, device=None):
    """ShapeDtypeStructs of an abstract frozen base (jaxmem.peft.base.abstract_base) with the
    "layers" leaves in pinned host memory on `device`: what a planner compiles the step with."""
    device = device or jax.devices()[0]
    host = jax.sharding.SingleDeviceSharding(device, memory_kind=HOST_KIND)

    def place(path, leaf):
        if any(getattr(k, "key", None) == "layers" for k in path):
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=host)
        return leaf
    return jax.tree_util.tree_map_with_path(place, abstract_base)


# f32[4,256,256]{2,1,0:S(5)}: an entry parameter in memory space 5 (XLA's host memory space)
_PARAM = re.compile(r"(\w+)\[([\d,]*)\]\{[\d,]*(?::([^}]*))?\}")
_BYTES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2,
          "s16": 2, "u16": 2, "s8": 1, "u8": 1, "pred": 1, "f8e4m3fn": 1, "f8e5m2": 1}


def host_argument_bytes(compiled) -> tuple[int, int]:
    """(host, device) bytes of a compiled program's arguments, from its entry layout: a
    parameter whose layout says `S(5)` is in host memory. Per device under a mesh (the layout
    of the partitioned module). The CPU's memory_analysis() counts both in
    argument_size_in_bytes; this tells them apart.

    Example: a scan over w [4, 256, 256] fp32 in pinned_host and x [8, 256] on the device
    -> (1048576, 8192).
    """
    text = compiled.as_text()
    head = text[text.index("entry_computation_layout={(") + len("entry_computation_layout={("):]
    params = head[:head.index(")->")]
    host = device = 0
    for dtype, dims, attrs in _PARAM.findall(params):
        size = int(np.prod([int(d) for d in dims.split(",") if d])) * _BYTES.get(dtype, 4)
        if attrs and "S(5)" in attrs:
            host += size
        else:
            device += size
    return host, device


def device_fetches(lowered_text: str) -> dict[str, int]:
    """Counts of `annotate_device_placement` copies to the device in a program lowered for
    GPU/TPU (`jitted.trace(*args).lower(lowering_platforms=("cuda",)).as_text()`), by where
    they are: "loop" (in a while body or a function called from one) or "outside".

    The offloaded step has copies in the loops only (forward scan, and the backward's
    recomputation) and none outside, i.e. no whole-base copy.
    """
    funcs = _functions(lowered_text)
    in_loop: set[str] = set()
    todo = [name for t in funcs.values() for a, b in _while_spans(t) for name in _callees(t[a:b])]
    while todo:
        name = todo.pop()
        if name in in_loop or name not in funcs:
            continue
        in_loop.add(name)
        todo += _callees(funcs[name])
    counts = {"loop": 0, "outside": 0}
    for name, text in funcs.items():
        n = _fetch_count(text)
        spans = _while_spans(text)  # outermost only: a nested body lies inside its parent's
        outer = [(a, b) for a, b in spans if not any(c <= a and b <= d and (c, d) != (a, b)
                                                     for c, d in spans)]
        loop_n = n if name in in_loop else sum(_fetch_count(text[a:b]) for a, b in outer)
        counts["loop"] += loop_n
        counts["outside"] += n - loop_n
    return counts


def _fetch_count(text: str) -> int:
    return len(re.findall(r'annotate_device_placement[^\n]*_xla_buffer_placement = "device"',
                          text))


def _functions(text: str) -> dict[str, str]:
    """func name -> its text (StableHLO module text)."""
    out, starts = {}, [(m.start(), m.group(1)) for m in
                       re.finditer(r"func\.func (?:public |private )?@([\w.$-]+)", text)]
    for i, (start, name) in enumerate(starts):
        end = starts[i + 1][0] if i + 1 < len(starts) else len(text)
        out[name] = text[start:end]
    return out


def _while_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of the `do { ... }` regions of the stablehlo.while ops in `text`."""
    spans = []
    for m in re.finditer(r"\}\s*do\s*\{", text):
        depth, i = 1, m.end()
        while depth and i < len(text):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        spans.append((m.end(), i))
    return spans


def _callees(text: str) -> list[str]:
    return re.findall(r"(?:func\.)?call @([\w.$-]+)", text)
