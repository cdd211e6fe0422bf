"""The device mesh of a run: `--mesh data=D,fsdp=F,tensor=T,context=C` parsed, checked, built.

    spec = MeshSpec.parse("data=2,fsdp=-1")      # -1: this axis takes the devices left over
    spec.resolve(8)                             # MeshSpec(data=2, fsdp=4, tensor=1)
    mesh = build_mesh(spec.resolve(n))          # jax Mesh, axes ("data", "fsdp", "tensor")

Axes (docs/distributed.md):
    data    pure data parallel: params replicated, batch split
    fsdp    ZeRO-3: params, gradients and optimizer state split, batch split too
    tensor  Megatron-style: heads / kv heads / MLP width split, the batch is not
    context context parallel: the sequence split (load-balanced causal chunks, attention
            all-gathers K/V over this axis: jaxmem.model.context), params not split

The default with more than one device is all of them on `fsdp`; with one device there is no
mesh at all and the train step is exactly the single-device one (`run_mesh` returns None).

The mesh always has the four axes (size-1 axes cost nothing), so one set of rules covers every
combination. Its axes are `AxisType.Auto`: `jax.make_mesh` defaults to Explicit axes in current
JAX, and Explicit mode fails on the embedding gather in jax 0.10.2 (docs/architecture.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax

from jaxmem import target
from jaxmem.errors import ConfigError
from jaxmem.families.config import ModelConfig

AXES = ("data", "fsdp", "tensor", "context")
BATCH_AXES = ("data", "fsdp")  # the batch dimension is split over both


class MeshError(ConfigError):
    """A --mesh value that cannot work here; the message names the flag and the value."""


@dataclass(frozen=True)
class MeshSpec:
    """Size of each mesh axis; -1 on at most one axis means 'the rest of the devices'."""

    data: int = 1
    fsdp: int = -1
    tensor: int = 1
    context: int = 1

    @classmethod
    def parse(cls, text: str | None) -> "MeshSpec":
        """'data=2,fsdp=4' -> MeshSpec(data=2, fsdp=4, tensor=1); None/'' -> all on fsdp.

        Axes not named get size 1, unless no axis has -1 and none is named at all."""
        if not text:
            return cls()
        sizes = {}
        for part in text.split(","):
            name, eq, value = part.strip().partition("=")
            name = name.strip()
            if name not in AXES:
                raise MeshError(f"--mesh {text!r}: unknown axis {name!r} (axes: {', '.join(AXES)})")
            if not eq:
                raise MeshError(f"--mesh {text!r}: expected AXIS=SIZE, got {part.strip()!r}")
            if name in sizes:
                raise MeshError(f"--mesh {text!r}: axis {name!r} given twice")
            try:
                size = int(value)
            except ValueError:
                raise MeshError(f"--mesh {text!r}: size of {name!r} must be an integer, "
                                f"got {value.strip()!r}") from None
            if size == 0 or size < -1:
                raise MeshError(f"--mesh {text!r}: size of {name!r} must be positive or -1")
            sizes[name] = size
        if list(sizes.values()).count(-1) > 1:
            raise MeshError(f"--mesh {text!r}: only one axis may be -1")
        return cls(**{a: sizes.get(a, 1) for a in AXES})

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        return (self.data, self.fsdp, self.tensor, self.context)

    def resolve(self, devices: int, text: str | None = None) -> "MeshSpec":
        """The spec with -1 replaced so that the product is `devices`; MeshError otherwise."""
        shown = text if text is not None else str(self)
        known = math.prod(s for s in self.sizes if s != -1)
        if -1 in self.sizes:
            if devices % known:
                raise MeshError(f"--mesh {shown}: the fixed axes ({known} devices) do not divide "
                                f"the {devices} devices")
            return MeshSpec(*(devices // known if s == -1 else s for s in self.sizes))
        if known != devices:
            raise MeshError(f"--mesh {shown}: the axis sizes multiply to {known}, but there are "
                            f"{devices} devices")
        return self

    @property
    def batch_shards(self) -> int:
        """How many pieces the batch is split into (data x fsdp)."""
        return self.data * self.fsdp

    def check(self, model: ModelConfig, batch_size: int, text: str | None = None,
              seq_len: int | None = None) -> None:
        """MeshError when the model or the batch (or the sequence) cannot be split this way."""
        shown = text if text is not None else str(self)
        c = self.context
        if c > 1 and seq_len is not None and seq_len % (2 * c):
            raise MeshError(f"--mesh {shown}: --seq-len {seq_len} is not divisible by 2 x context "
                            f"= {2 * c} (each device holds one chunk from the start of the "
                            f"sequence and its mirror from the end)")
        t = self.tensor
        for name, value in (("num_kv_heads", model.num_kv_heads), ("num_heads", model.num_heads),
                            ("intermediate_size", model.intermediate_size)):
            if value % t:
                raise MeshError(f"--mesh {shown}: tensor={t} does not divide the model's "
                                f"{name} {value}")
        if batch_size % self.batch_shards:
            n = self.batch_shards
            raise MeshError(f"--mesh {shown}: --batch-size {batch_size} is not divisible by "
                            f"data x fsdp = {n} (--batch-size counts the sequences of all devices "
                            f"together: one per device here is --batch-size {n})")

    def __str__(self) -> str:  # context shown only when used (the three-axis text otherwise)
        return ",".join(f"{a}={s}" for a, s in zip(AXES, self.sizes)
                        if a != "context" or s != 1)


def build_mesh(spec: MeshSpec, devices=None) -> jax.sharding.Mesh:
    """A Mesh with axes data, fsdp, tensor, context (all `AxisType.Auto`) over `devices` (default all:
    `jaxmem.target.devices()`, the deviceless GPUs when compiling for a --target)."""
    devices = target.devices() if devices is None else list(devices)
    if math.prod(spec.sizes) != len(devices):
        raise MeshError(f"--mesh {spec}: needs {math.prod(spec.sizes)} devices, have {len(devices)}")
    auto = (jax.sharding.AxisType.Auto,) * len(AXES)
    return jax.make_mesh(spec.sizes, AXES, axis_types=auto, devices=devices)


def run_mesh(text: str | None, model: ModelConfig, batch_size: int, devices=None,
             seq_len: int | None = None):
    """The mesh of a run, or None for one device (today's single-device step, bit for bit).

    MeshError (a ConfigError: exit 2 in the CLIs) names --mesh when it cannot work here."""
    devices = target.devices() if devices is None else list(devices)
    spec = MeshSpec.parse(text).resolve(len(devices), text)
    if len(devices) == 1:
        return None
    spec.check(model, batch_size, text, seq_len)
    return build_mesh(spec, devices)


def mesh_spec(mesh) -> MeshSpec:
    """The MeshSpec of a mesh built here (None: one device)."""
    if mesh is None:
        return MeshSpec(1, 1, 1)
    return MeshSpec(*(mesh.shape.get(a, 1) for a in AXES))
