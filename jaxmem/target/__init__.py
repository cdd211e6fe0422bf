"""Compile for a GPU that is not here: XLA's own GPU compiler, run on any machine (deviceless AOT).

    jaxmem.target.prepare()                         # before JAX starts (a CLI's first line)
    with jaxmem.target.compiling_for("h100", devices=8) as t:
        mesh = jax.make_mesh((8,), ("fsdp",), devices=t.devices)
        jax.jit(step).lower(*shape_dtype_structs).compile()   # an H100 program, on this CPU

Inside `compiling_for`, every `jax.jit(...).lower(...).compile()` without explicit devices
targets the card (the first of its deviceless devices is JAX's default device), and jaxmem's own
choices by backend follow the target, not the host: `platform()` answers "gpu", so the model
takes cuDNN attention and fp16 GEMMs as on the card, the sampler computes in bf16, and
`devices()` hands the mesh code the target's devices. `memory_analysis()` and `as_text()` are
the GPU program's. Nothing can run there: eager jax ops on the default device fail.

Needs the CUDA plugin for the installed jax and cuDNN (`pip install 'jaxmem[gpu-plan]'`, then
`jax-cuda12-plugin` pinned to the installed jaxlib: `install_hint()` prints the exact line), and
JAX on the CPU platform (`prepare()` sets that when JAX has not started yet).

What a deviceless compile cannot see: autotuning (default GEMM configurations), cuDNN / cuBLAS
workspaces, NCCL buffers, the CUDA context, allocator fragmentation. The planner states these as
a margin (docs/memory.md: the calibration).

Host memory: on jax 0.10.2 the topology's devices have no memories, so a `pinned_host` sharding
of a target device loses its memory kind, and a program that moves values to host memory itself
(`device_put(x, jax.memory.Space.Host)`) does not trace against such an argument. A one-device
program with host-resident values is instead traced on this machine's CPU device
(`host_device`), lowered for CUDA and compiled by the card's compiler (`lower`,
jaxmem.target._host).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.metadata
import importlib.util
import os
from dataclasses import dataclass

from jaxmem.target._cards import CARDS, Card, HostLink, target_config
from jaxmem.target._host import Lowered

__all__ = ["CARDS", "Card", "HostLink", "Target", "TargetError", "active", "card", "card_here",
           "check_installed", "compiler", "compiling_for", "device_count", "devices",
           "host_device", "install_hint", "lower", "platform", "prepare", "target_config"]

# XLA's GPU top-k lowers to a CUB radix sort whose scratch size is asked of the CUDA runtime,
# which fails with no GPU ("cudaErrorInvalidDevice"); XLA's own sort needs no device.
XLA_TARGET_FLAGS = ("--xla_gpu_enable_cub_radix_sort=false",)


class TargetError(ValueError):
    """A target compile cannot be set up; the message says what to install or change."""


@dataclass(frozen=True)
class Target:
    """An active target: the card and its deviceless devices (on `hosts` hosts)."""

    card: Card
    devices: tuple

    @property
    def name(self) -> str:
        return self.card.name

    def describe(self) -> str:
        import jax  # noqa: PLC0415
        n = len(self.devices)
        hosts = len({d.process_index for d in self.devices})
        where = "" if hosts == 1 else f" on {hosts} hosts of {n // hosts}"
        return (f"{'' if n == 1 else f'{n} x '}{self.card.describe()}{where}, XLA's GPU "
                f"compiler without a GPU (jax {jax.__version__})")


_ACTIVE: contextvars.ContextVar[Target | None] = contextvars.ContextVar("jaxmem_target",
                                                                      default=None)


def active() -> Target | None:
    """The target being compiled for, or None (then jaxmem follows JAX's own backend)."""
    return _ACTIVE.get()


def platform() -> str:
    """The platform programs are compiled for: "gpu" inside `compiling_for`, else JAX's default
    backend ("cpu", "gpu", "tpu"). jaxmem picks backend-dependent code paths by this."""
    if _ACTIVE.get() is not None:
        return "gpu"
    import jax  # noqa: PLC0415
    return jax.default_backend()


def fuses_elementwise() -> bool:
    """Whether the compiler the programs are built for fuses elementwise work into its kernels
    and its consumers' donated buffers (XLA's GPU compiler; not XLA:CPU, which materializes
    more intermediates). The planner's formula and the skipped-step guard read each compiler's
    buffer reports by this (docs/memory.md)."""
    return platform() != "cpu"


def devices() -> list:
    """The devices a mesh is built from: the target's inside `compiling_for`, else jax.devices()."""
    t = _ACTIVE.get()
    if t is not None:
        return list(t.devices)
    import jax  # noqa: PLC0415
    return jax.devices()


def device_count() -> int:
    return len(devices())


def compiler() -> str:
    """Which compiler the figures of this process come from, in words (reports print it)."""
    import jax  # noqa: PLC0415
    t = _ACTIVE.get()
    if t is not None:
        return t.describe()
    backend = jax.default_backend()
    if backend == "cpu":
        return f"XLA:CPU (jax {jax.__version__}; not a GPU's program: compile with --target)"
    return f"{jax.devices()[0].device_kind} ({backend}, jax {jax.__version__})"


def card_here() -> Card | None:
    """The card programs are compiled for: the target's inside `compiling_for`, else the GPU this
    process runs on where its CUDA name is one of CARDS'; None on a CPU or an unknown GPU."""
    t = _ACTIVE.get()
    if t is not None:
        return t.card
    if platform() != "gpu":
        return None
    import jax  # noqa: PLC0415
    kind = jax.devices()[0].device_kind
    return next((c for c in CARDS.values() if c.device_name == kind), None)


def card(name: str) -> Card:
    try:
        return CARDS[name]
    except KeyError:
        raise TargetError(f"unknown --target {name!r}; known: {', '.join(CARDS)}") from None


def _jax_started() -> bool:
    from jax._src import xla_bridge  # noqa: PLC0415  (no public probe in jax 0.10 / 0.11)
    return bool(getattr(xla_bridge, "_backends", None))


def prepare() -> None:
    """Before JAX starts: the CPU platform (a CUDA plugin must not try a GPU that is not there),
    and the XLA flags a deviceless GPU compile needs. No-op for what is already set."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    names = {f.split("=")[0] for f in flags}
    flags += [f for f in XLA_TARGET_FLAGS if f.split("=")[0] not in names]
    os.environ["XLA_FLAGS"] = " ".join(flags)
    import jax  # noqa: PLC0415
    if not _jax_started():
        jax.config.update("jax_platforms", "cpu")


def install_hint() -> str:
    """The pip line that installs the GPU compiler for the jax in use."""
    import jaxlib  # noqa: PLC0415
    v = jaxlib.__version__
    return (f"pip install 'jaxmem[gpu-plan]' 'jax-cuda12-plugin=={v}' (XLA's GPU compiler and "
            f"cuDNN for jaxlib {v}, about 3 GB)")


def _plugin_version() -> str | None:
    for dist in ("jax-cuda12-plugin", "jax-cuda13-plugin"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def check_installed() -> None:
    """Raise TargetError naming what to install unless the CUDA plugin of the installed jaxlib
    and cuDNN are present (without cuDNN, jax's cuDNN attention check fails and the program
    compiled would not be the card's)."""
    import jaxlib  # noqa: PLC0415
    version = _plugin_version()
    if version is None:
        raise TargetError(f"--target needs XLA's GPU compiler, which is not installed: "
                          f"{install_hint()}")
    if version != jaxlib.__version__:
        raise TargetError(f"--target: the CUDA plugin is {version} but jaxlib is "
                          f"{jaxlib.__version__}; {install_hint()}")
    if importlib.util.find_spec("nvidia.cudnn") is None:
        raise TargetError(f"--target needs cuDNN (the nvidia-cudnn wheel) to compile cuDNN "
                          f"attention as the card does: {install_hint()}")


@functools.lru_cache(maxsize=None)
def _topology(name: str, n: int, hosts: int = 1) -> tuple:
    from jax.experimental import topologies  # noqa: PLC0415
    try:
        topo = topologies.get_topology_desc(platform="cuda", target_config=target_config(
            CARDS[name]), topology=f"1x{hosts}x{n // hosts}")
    except NotImplementedError as e:
        raise TargetError(
            f"--target: JAX started on a platform other than the CPU, so the CUDA plugin cannot "
            f"describe a deviceless {name} ({e}); start the process with JAX_PLATFORMS=cpu") \
            from None
    except Exception as e:  # noqa: BLE001  (the plugin's own errors: parse, version)
        first = (str(e).strip().splitlines() or [""])[0]
        raise TargetError(f"--target {name}: the CUDA plugin refused the device description: "
                          f"{type(e).__name__}: {first}") from None
    return tuple(topo.devices)


@contextlib.contextmanager
def compiling_for(name: str, devices: int = 1, hosts: int = 1):
    """Compile for `devices` deviceless GPUs of the card `name`, on `hosts` hosts of
    devices / hosts GPUs each (device i on process i // (devices / hosts), as JAX numbers a
    multi-host job), inside the block.

    Yields the active `Target`. Raises TargetError (nothing installed, JAX on a GPU platform
    already, an unknown card) before anything is compiled.
    """
    import jax  # noqa: PLC0415
    c = card(name)
    if devices < 1:
        raise TargetError(f"--target {name}: --devices must be at least 1, got {devices}")
    if hosts < 1 or devices % hosts:
        raise TargetError(f"--target {name}: --hosts {hosts} must divide --devices {devices} "
                          f"(every host has the same number of GPUs)")
    check_installed()
    t = Target(c, _topology(name, devices, hosts))
    token = _ACTIVE.set(t)
    # a deviceless program cannot be loaded from (or usefully written to) the persistent cache
    cache = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        with jax.default_device(t.devices[0]):
            yield t
    finally:
        jax.config.update("jax_enable_compilation_cache", cache)
        _ACTIVE.reset(token)


def host_device():
    """The device a one-device plan places its arguments on where some live in host memory:
    inside `compiling_for`, this machine's CPU device stands in for the card's (whose memory
    kinds the deviceless topology does not have); else the first device."""
    import jax  # noqa: PLC0415
    return jax.devices("cpu")[0] if active() is not None else devices()[0]


def lower(jitted, *args, compiler_options: dict | None = None):
    """`jitted.lower(*args)`, or inside `compiling_for` (one device) the program traced on
    `host_device`'s arguments, lowered for CUDA and compiled by the card's compiler when
    `.compile()` is called (jaxmem.target._host). Arguments without a sharding are placed on
    `host_device` too. compiler_options: the jit's own XLA options, which the card's compile
    takes as overrides."""
    import jax  # noqa: PLC0415
    t = active()
    if t is None:
        return jitted.lower(*args)
    if len(t.devices) != 1:
        raise ValueError("host-resident arguments are planned on one device")
    stand_in = jax.sharding.SingleDeviceSharding(host_device())

    def placed(x):
        if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is None:
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=stand_in)
        return x
    args = jax.tree.map(placed, args)
    return Lowered(jitted.trace(*args).lower(lowering_platforms=("cuda",)), t.devices[0],
                   compiler_options)
