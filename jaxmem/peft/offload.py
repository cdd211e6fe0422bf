"""`--offload-base host`: the frozen base's layers live in pinned host memory and reach the device
one layer at a time, inside the layer scan (as MaxText's `parameter_memory_host_offload`).

    shardings = offload_shardings(one_device_shardings(abstract))  # or a mesh's base_shardings
    frozen = base_on_device(host, spec, dtype, shardings)  # layers/* in pinned_host, rest on device
    state, metrics = train_step(state, batch, frozen)  # the model fetches layer i in iteration i
    host_argument_bytes(compiled)                      # the arguments' bytes XLA put on the host

What goes where: every leaf under params["layers"] (the seven projections, int8 / NF4 codes and
scales included, and the block norms) is stacked [L, ...] in pinned host memory. The embedding,
the final norm and the LM head stay on the device: the embedding gather and the (fused) LM head
read them whole, so offloading them would only add a whole-array copy per step.

The copy to the device is `jax.device_put(leaf, jax.memory.Space.Device)` on the sliced layer
inside the scanned block (jaxmem.model.fetch.layer_to_device): the model sees the leaves' memory
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
import sys

import jax
import numpy as np

from jaxmem import target
from jaxmem.xla.hlo import entry_argument_bytes

HOST_KIND = "pinned_host"
_WARNED: set = set()  # platforms warned about (one line per process)


def host_memory_kind(device=None) -> str | None:
    """"pinned_host" where `device` has that memory space (CPU, GPU and TPU in jax 0.10 / 0.11),
    else None."""
    device = device or target.devices()[0]
    if target.active() is not None and device.platform == "gpu":
        return HOST_KIND  # the card has it; the deviceless topology may list no memories
    try:
        kinds = {m.kind for m in device.addressable_memories()}
    except Exception:  # a runtime without the memories API
        return None
    return HOST_KIND if HOST_KIND in kinds else None


def host_sharding(sharding):
    """`sharding` (SingleDeviceSharding or NamedSharding) in pinned host memory."""
    return sharding.with_memory_kind(HOST_KIND)


def _is_layer(path) -> bool:
    return any(getattr(k, "key", None) == "layers" for k in path)


def offload_shardings(shardings):
    """A frozen base's sharding tree (one Sharding per leaf: NamedShardings on a mesh from
    jaxmem.parallel.rules.base_shardings, or `one_device_shardings`) with every leaf under
    "layers" moved to pinned host memory; the embedding, final norm and head keep theirs.

    Without a pinned_host memory space the tree is returned unchanged, with one warning line
    (the base then stays on the device)."""
    device = next(iter(jax.tree_util.tree_leaves(shardings)[0].device_set))
    if host_memory_kind(device) is None:
        if device.platform in _WARNED:
            return shardings
        _WARNED.add(device.platform)
        print(f"jaxmem: warning: --offload-base host: {device.platform} device {device} has no "
              f"{HOST_KIND} memory; the frozen base stays on the device", file=sys.stderr)
        return shardings
    return jax.tree_util.tree_map_with_path(
        lambda path, s: host_sharding(s) if _is_layer(path) else s, shardings)


def one_device_shardings(abstract_base, device=None):
    """A replicated NamedSharding on a one-device mesh of `device` (default: the first) for
    every leaf of a base tree. Not a SingleDeviceSharding: in jax 0.10.2
    `make_array_from_callback` with SingleDeviceSharding(memory_kind="pinned_host") places the
    data in pinned_host but gives the array a device-memory aval, so the model would not see
    that the leaf is on the host (and no copy would be made in the loop). Inside
    `jaxmem.target.compiling_for` the default device is this machine's CPU, standing in for the
    card's (`jaxmem.target.host_device`)."""
    mesh = jax.sharding.Mesh(np.array([device or target.host_device()]), ("one",))
    one = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.tree.map(lambda _: one, abstract_base)


def abstract_in_host_memory(abstract_base, shardings=None):
    """ShapeDtypeStructs of an abstract frozen base (jaxmem.peft.base.abstract_base) carrying
    `offload_shardings(shardings)` (default: one device): what a planner compiles the step
    with to see the host / device split (`host_argument_bytes`)."""
    shardings = offload_shardings(shardings or one_device_shardings(abstract_base))
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        abstract_base, shardings)


def host_argument_bytes(compiled) -> tuple[int, int]:
    """(host, device) bytes of a compiled program's arguments, from its entry layout
    (jaxmem.xla.hlo.entry_argument_bytes: a parameter whose layout says `S(5)` is in host
    memory). Per device under a mesh. The CPU's memory_analysis() counts both in
    argument_size_in_bytes; this tells them apart.

    Example: a scan over w [4, 256, 256] fp32 in pinned_host and x [8, 256] on the device
    -> (1048576, 8192).
    """
    return entry_argument_bytes(compiled.as_text())


def device_fetches(lowered_text: str) -> dict[str, int]:
    """Where a program lowered for GPU/TPU
    (`jitted.trace(*args).lower(lowering_platforms=("cuda",)).as_text()`) places values in
    device memory (`annotate_device_placement`, `_xla_buffer_placement = "device"`):

      loop: inside a while body or a function called from one: the per-layer fetches of the
            layer scans (forward, and the backward's recomputation);
      outside: anywhere else (under a mesh jit also annotates its device outputs this way);
      whole: those outside whose type is that of a pinned_host argument: a whole stacked leaf
            copied to the device.

    The offloaded step has loop = 2 x the layer leaves and whole = 0.
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
    main = next((t for n, t in funcs.items() if n == "main"), "")
    header = main[:main.find("{\n")] if main else ""
    host_types = set(re.findall(r"(tensor<[^>]*>) \{[^{}]*mhlo\.memory_kind = \"pinned_host\"",
                                header))
    counts = {"loop": 0, "outside": 0, "whole": 0}
    for name, text in funcs.items():
        spans = _while_spans(text)
        for m in _FETCH.finditer(text):
            if name in in_loop or any(a <= m.start() < b for a, b in spans):
                counts["loop"] += 1
            else:
                counts["outside"] += 1
                counts["whole"] += m.group(1) in host_types
    return counts


_FETCH = re.compile(r'annotate_device_placement[^\n]*_xla_buffer_placement = "device"[^\n]*'
                    r"-> (tensor<[^>]*>)")


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
