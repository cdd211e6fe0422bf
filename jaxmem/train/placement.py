"""Where a run's arrays live: one device (no mesh) or split over a mesh.

    par = Placement.single()               # one device: today's functions, untouched
    par = Placement.on(mesh)               # a mesh from jaxmem.parallel.mesh.run_mesh
    state = par.init_state(step_cfg, loss_scale, seed)
    step = par.train_step(step_cfg, state) # jit, state donated, in/out shardings
    state, metrics = step(state, par.batch(numpy_batch))
    par.host(metrics)                      # numpy values on every process

On one device with --offload-optimizer host and / or --offload-params host
(`Placement.single("host", "host")`) every array of the optimizer state and / or the params'
stacked layer leaves are created, stepped (donated, with in and out shardings) and restored in
pinned host memory (`host_shardings`); the in-backward step streams them a layer at a time, and
without it (--optimizer adamw8bit, the optimizer state only) the 8-bit update streams each leaf's
moments a row piece at a time (jaxmem.optim.AdamW8bitInPlace, `apply_leaf_in_place`).

On a mesh:
- the state is created directly split (`jit(state_creation_fn(...), out_shardings=...)`, the
  same function as on one device): no device ever holds a full copy, and the values are
  bitwise those of the single-device init;
- the step is jitted with `in_shardings` and `out_shardings` (with inputs placed by
  `device_put` alone, gradients came back replicated in a probe: always pass out_shardings) and
  the state donated;
- the activation rules (jaxmem.parallel.rules.activation_rules) are installed around every call,
  so they are in place whenever jit traces;
- with a `context` axis (context parallelism, jaxmem.model.context) the step and the eval
  function permute the batch's sequence into the load-balanced layout first (inside the jit:
  the host batch is the plain one, split over `context` as it comes) and attention runs over
  the split sequence;
- a batch is built on each process from its own rows only (`make_array_from_callback` asks for
  exactly the rows of the devices this process holds), so multi-process runs read the same
  global batch at the same data position as a single process would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from jaxmem.errors import ConfigError
from jaxmem.model.context import balance, context_parallel
from jaxmem.sharding import activation_sharding, weight_sharding
from jaxmem.model.fp8_compile import compiler_options as fp8_compiler_options
import jaxmem.parallel.rules as R
from jaxmem.peft.offload import (HOST_KIND, abstract_in_host_memory, host_memory_kind,
                                 host_sharding, offload_shardings, one_device_shardings)
from jaxmem.quant import gather_packed
from jaxmem.train.host_state import create_on_host
from jaxmem.train.run import make_eval_fn
from jaxmem.train.step import (create_train_state, jit_train_step, make_train_step,
                               state_creation_fn)


class _WithRules:
    """A jitted function called (and lowered) with the activation rules installed."""

    def __init__(self, jitted, rules, gather=None, weights=None, mesh=None):
        self._jitted, self._rules, self._gather = jitted, rules, gather
        self._weights, self._mesh = weights, mesh

    def __call__(self, *args):
        with activation_sharding(self._rules), gather_packed(self._gather), \
                weight_sharding(self._weights), context_parallel(self._mesh):
            return self._jitted(*args)

    def lower(self, *args):
        with activation_sharding(self._rules), gather_packed(self._gather), \
                weight_sharding(self._weights), context_parallel(self._mesh):
            return self._jitted.lower(*args)


def _balanced(fn, mesh, step_cfg):
    """`fn(state_or_params, batch, *rest)` with the batch permuted into context parallelism's
    load-balanced layout first (jaxmem.model.context.balance); `fn` itself without `context`."""
    c = dict(mesh.shape).get("context", 1)
    if c == 1:
        return fn
    if step_cfg.attention_padding:
        raise ConfigError(f"--mesh context={c}: context parallelism takes right-padded or "
                          f"packed rows only (no attention padding mask)")

    def balanced(first, batch, *rest):
        return fn(first, balance(batch, c), *rest)
    return balanced


def host_shardings(abstract_state, parts, device=None, shardings=None):
    """--offload-optimizer / --offload-params host: a sharding per leaf of a train state (or its
    abstract form) with, for each of `parts`, in pinned host memory: "params" the trained
    weights' stacked leaves (those under "layers": the embedding, head and final norm stay, as
    --offload-base's base does, jaxmem.peft.offload); "opt_state" every array of the optimizer
    state (the moments, for adamw8bit their codes and scales; the counters stay). Everything
    else is on the device. `shardings`: the state's on a mesh (each device's shard goes to its
    host memory); None: one device's."""
    shardings = shardings or one_device_shardings(abstract_state, device)
    moved = {}
    if "params" in parts:
        moved["params"] = offload_shardings(shardings.params)
    if "opt_state" in parts:  # every array of it; the counters (scalars) stay
        moved["opt_state"] = jax.tree.map(lambda s, x: host_sharding(s) if x.ndim else s,
                                          shardings.opt_state, abstract_state.opt_state)
    return shardings.replace(**moved)


def check_offload(optim, device=None) -> None:
    """ConfigError (one line, naming the flag) where the device has no pinned host memory for
    --offload-optimizer host or --offload-params host (`optim`: the run's OptimConfig). Their
    other conditions are the config's (OptimConfig: --optimizer-in-backward, or adamw8bit for
    --offload-optimizer) and the CLI's (one device)."""
    for flag, value in (("--offload-optimizer", optim.offload_optimizer),
                        ("--offload-params", optim.offload_params)):
        if value == "none":
            continue
        device = device or jax.devices()[0]
        if host_memory_kind(device) is None:
            raise ConfigError(f"{flag} host: {device.platform} device {device} has no "
                              f"{HOST_KIND} memory")


@dataclass(frozen=True)
class Placement:
    """One device (mesh None) or a mesh; see the module docstring."""

    mesh: Any = None
    offload_base: str = "none"  # "host": the frozen base's layers in pinned host memory
    offload_optimizer: str = "none"  # "host": every array of the optimizer state in pinned
                                     # host memory (on a mesh each device's shard)
    offload_params: str = "none"  # "host": the trained params' stacked leaves, likewise

    @classmethod
    def single(cls, offload_optimizer: str = "none", offload_params: str = "none") -> "Placement":
        return cls(None, offload_optimizer=offload_optimizer, offload_params=offload_params)

    @property
    def host_parts(self) -> tuple[str, ...]:
        """The train state's parts with leaves in pinned host memory on one device (`host_shardings`
        says which): "params" (--offload-params), "opt_state" (--offload-optimizer). () on a mesh,
        where `state_shardings` puts the optimizer state's shards there itself."""
        if self.mesh is not None:
            return ()
        return tuple(p for p, v in (("params", self.offload_params),
                                    ("opt_state", self.offload_optimizer)) if v == "host")

    @property
    def state_on_host(self) -> bool:
        """Whether parts of the train state live in pinned host memory (one device's
        `host_parts`, or a mesh's optimizer state): then a fresh state is made by
        jaxmem.train.host_state's programs, never those parts whole on the device (on a mesh,
        one leaf's shards at a time)."""
        return bool(self.host_parts) or self.offload_optimizer == "host"

    @classmethod
    def on(cls, mesh, offload_base: str = "none", offload_optimizer: str = "none") -> "Placement":
        return cls(mesh, offload_base, offload_optimizer)

    @property
    def is_main(self) -> bool:
        """Only process 0 writes config.json, metrics and the progress bar."""
        return jax.process_index() == 0

    def state_shardings(self, abstract_state):
        """The state's NamedShardings on the mesh (jaxmem.parallel.rules); with
        --offload-optimizer host the optimizer state's arrays in pinned host memory."""
        shardings = R.state_shardings(abstract_state, self.mesh)
        if self.offload_optimizer != "host":
            return shardings
        return host_shardings(abstract_state, ("opt_state",), shardings=shardings)

    def abstract(self, abstract_state):
        """The restore target: shapes and dtypes with this placement's shardings (single
        device: unchanged, Orbax restores onto the default device)."""
        if self.host_parts:
            return R.with_given_shardings(abstract_state,
                                          host_shardings(abstract_state, self.host_parts))
        if self.mesh is None:
            return abstract_state
        return R.with_given_shardings(abstract_state, self.state_shardings(abstract_state))

    def _placed_shardings(self, abstract_state):
        """The state's shardings where this placement gives them: on a mesh, or on one device
        with stacks on the host (`host_parts`); None on a plain device."""
        if self.host_parts:
            return host_shardings(abstract_state, self.host_parts)
        return None if self.mesh is None else self.state_shardings(abstract_state)

    def state_creation(self, step_cfg, loss_scale, seed: int, with_params: bool = False):
        """The jitted state creation (`jaxmem.train.step.state_creation_fn`) with this
        placement's `out_shardings`: what `init_state` runs and what a planner compiles
        (`.lower().compile().memory_analysis()`, per device on a mesh)."""
        fn = state_creation_fn(step_cfg, loss_scale, seed, with_params=with_params)
        # the same shapes with or without given params: take them from the fresh state's
        shardings = self._placed_shardings(
            jax.eval_shape(state_creation_fn(step_cfg, loss_scale, seed)))
        if shardings is None:
            return jax.jit(fn, donate_argnums=(0,) if with_params else ())
        if not with_params:
            return jax.jit(fn, out_shardings=shardings)
        return jax.jit(fn, in_shardings=(shardings.params,), out_shardings=shardings,
                       donate_argnums=0)

    def init_state(self, step_cfg, loss_scale, seed: int, params=None, progress: bool = False):
        """A fresh state, created under jit (on a mesh: directly split, with out_shardings).
        `params` (host arrays in the storage dtype, e.g. from --init-from) are put on the
        device(s) piece by piece (`device_put` with the params' shardings: no device receives
        the whole checkpoint; --offload-params host: the layers go to pinned host memory) and
        donated to the jit, so they are not copied again. progress: a bar while a state with
        parts on the host is made (jaxmem.train.host_state)."""
        if self.mesh is None and not self.host_parts:
            return create_train_state(step_cfg, loss_scale, seed, params=params)
        if params is None and not self.state_on_host:
            return self.state_creation(step_cfg, loss_scale, seed)()
        shardings = self._placed_shardings(
            jax.eval_shape(state_creation_fn(step_cfg, loss_scale, seed)))
        placed = () if params is None else (jax.device_put(params, shardings.params),)
        if self.state_on_host:
            fn = state_creation_fn(step_cfg, loss_scale, seed, with_params=params is not None)
            return create_on_host(fn, shardings, placed, progress, pieces=self.mesh is None)
        return self.state_creation(step_cfg, loss_scale, seed, with_params=True)(*placed)

    def base_shardings(self, step_cfg):
        """LoRA: the frozen base's shardings on this mesh (jaxmem.parallel.rules.lora_base_shardings),
        in pinned host memory for the decoder layers with `--offload-base host`
        (jaxmem.peft.offload); None on one device or for a full fine-tune."""
        if self.mesh is None:
            return None
        shardings = R.lora_base_shardings(step_cfg, self.mesh)
        if not self.base_on_host:  # LoRA only: the config refuses --offload-base host otherwise
            return shardings
        return offload_shardings(shardings)

    @property
    def base_on_host(self) -> bool:
        """Whether a LoRA base's decoder layers live in pinned host memory (--offload-base)."""
        return self.offload_base == "host"

    def abstract_base(self, step_cfg, frozen):
        """A frozen base's abstract form (None: nothing frozen) as this placement passes it to
        the step: split by `base_shardings` on a mesh; on one device with --offload-base host
        its layers in pinned host memory (jaxmem.peft.offload); else as given."""
        if frozen is None:
            return None
        if self.mesh is None:
            return abstract_in_host_memory(frozen) if self.base_on_host else frozen
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            frozen, self.base_shardings(step_cfg))

    def train_step(self, step_cfg, like):
        """The jitted, donated step for states shaped like `like` (a state or its abstract
        form: its structure depends on the loss scale). LoRA: the frozen base is the third
        argument, split by `base_shardings` and never donated."""
        if self.host_parts:  # donated; the state comes back with its stacks in pinned_host
            return jit_train_step(step_cfg, host_shardings(like, self.host_parts))
        if self.mesh is None:
            return jit_train_step(step_cfg)
        shardings = self.state_shardings(like)
        base = self.base_shardings(step_cfg)
        jitted = jax.jit(_balanced(make_train_step(step_cfg), self.mesh, step_cfg),
                         donate_argnums=0,
                         compiler_options=fp8_compiler_options(step_cfg.precision),
                         in_shardings=(shardings, R.batch_sharding(self.mesh))
                         + step_cfg.trainable.step_args(base),
                         out_shardings=(shardings, R.replicated(self.mesh)))
        return _WithRules(jitted, R.activation_rules(self.mesh, step_cfg.model.vocab_size),
                          R.lora_packed_gather(step_cfg, self.mesh),
                          R.weight_rule(self.mesh, step_cfg.model.num_layers), self.mesh)

    def eval_fn(self, step_cfg):
        if self.mesh is None:
            return make_eval_fn(step_cfg)
        jitted = jax.jit(_balanced(make_eval_fn(step_cfg), self.mesh, step_cfg),
                         out_shardings=R.replicated(self.mesh))
        return _WithRules(jitted, R.activation_rules(self.mesh, step_cfg.model.vocab_size),
                          R.lora_packed_gather(step_cfg, self.mesh), mesh=self.mesh)

    def _place(self, batch: dict, sharding):
        def one(x):
            x = np.asarray(x)
            return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
        return {k: one(v) for k, v in batch.items()}

    def batch(self, batch: dict):
        """A step batch {name: [K, B, T]} of numpy arrays, placed."""
        return batch if self.mesh is None else self._place(batch, R.batch_sharding(self.mesh))

    def eval_batch(self, batch: dict):
        """An eval batch {name: [B, T]}, placed."""
        return batch if self.mesh is None else self._place(batch, R.eval_batch_sharding(self.mesh))

    def host(self, tree):
        """Numpy values of replicated arrays (on every process; multi-process arrays are not
        fully addressable, so read this process's copy)."""
        def one(x):
            if isinstance(x, jax.Array) and not x.is_fully_addressable:
                return np.asarray(x.addressable_data(0))
            return np.asarray(x)
        return jax.tree.map(one, tree)
