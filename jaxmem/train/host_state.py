"""A fresh train state with parts in pinned host memory (--offload-optimizer / --offload-params
host), made without the device ever holding those parts whole.

Made as one program (`jax.jit(fn, out_shardings=...)`), XLA:GPU held every host-bound value on
the device before copying it out: measured on an H200 (jax 0.11.2), llama-3-8b bf16-sr +
adamw8bit, the fresh state's device peak was 30.50 GiB with both flags and 39.96 GiB with the
optimizer alone on the host, for steps that need about 5 and 16 GiB
(experiments.offload_peak). So the state is made by several programs, run one after another:

- each host leaf of the optimizer state in row pieces of at most PIECE_BYTES (the leaf's program
  with its output dynamic-sliced: XLA makes only the piece), gathered in a numpy buffer and put
  in pinned host memory as a whole;
- each host leaf of the params (the stacked layers') by a program in which the layer scan sends
  each layer's slice to the host as it makes it (`jaxmem.model.typed_init.stacks_to_host`);
- then the device-resident leaves in one program, which takes the given params (--init-from),
  donated, and returns the host ones as they are.

Each program is `fn` with the other outputs dead, so every value is the one `jax.jit(fn)` gives
(tests/test_offload_params.py and test_offload_optimizer.py compare the runs bitwise). The device's
peak is the device-resident state plus one piece or one layer. The planner compiles the same
programs (`programs`).
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.extend.core import jaxpr_as_fun

from jaxmem.model.typed_init import stacks_to_host
from jaxmem.peft.offload import HOST_KIND

PIECE_BYTES = 256 << 20  # one piece of a host leaf made on the device at a time, at most


class Program(NamedTuple):
    """One program of a state's creation (`programs`)."""

    kind: str  # "piece", "stack", "leaf" or "device"
    index: Any  # the leaf's index among the state's leaves; "device": the list of its leaves
    jitted: Any
    leaf: Any = None  # the leaf's abstract value ("device": None)
    sharding: Any = None  # the leaf's sharding ("device": None)
    rows: int = 0  # "piece": the rows of one piece

    @property
    def nbytes(self) -> int:
        """The host bytes it makes (0 for "device")."""
        return 0 if self.leaf is None else self.leaf.size * self.leaf.dtype.itemsize

    def lower(self, *args, lower=None):
        """`jitted` lowered for `args` (a piece's int32 row offset put first), a stack's inside
        `stacks_to_host`; lower(jitted, *args): how (None: jitted.lower; the planner's lowers
        for the target). Its executable then runs outside the context."""
        first = (jax.ShapeDtypeStruct((), np.int32),) if self.kind == "piece" else ()
        with stacks_to_host() if self.kind == "stack" else contextlib.nullcontext():
            if lower is None:
                return self.jitted.lower(*first, *args)
            return lower(self.jitted, *first, *args)


def _leaves(fn, args):
    return jax.tree_util.tree_leaves(fn(*args))


def programs(fn, shardings, args=(), pieces: bool = True):
    """(the state creation's programs in the order they run, the state's treedef). Kinds:
    "piece" (a leaf's rows [a, a + rows), `jitted(a, *args)`), "stack" (a params leaf made a layer
    at a time into host memory, `jitted(*args)`; trace and lower it inside `stacks_to_host`), and
    last "device" (every other leaf, `jitted(*args)`, args donated). pieces=False (a mesh, whose
    leaves are split over devices and processes): each optimizer leaf whole, "leaf"
    (`jitted(*args)`; one device's shard of it on that device at a time).

    `fn` is traced once here (its abstract value and its jaxpr), and the pieces', leaves' and
    device leaves' programs evaluate that jaxpr instead of tracing `fn` (a whole model's init)
    again. A "stack" program traces `fn` itself, inside `stacks_to_host`: evaluated from a jaxpr,
    the scan's copies to the host were lost."""
    closed, abstract = jax.make_jaxpr(fn, return_shape=True)(*args)
    run = jaxpr_as_fun(closed)

    def flat(a):  # fn's flat outputs, from its jaxpr
        return run(*jax.tree_util.tree_leaves(a))

    paths, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    shards = treedef.flatten_up_to(shardings)
    out, rest = [], []
    for i, ((path, x), s) in enumerate(zip(paths, shards)):
        on_host = s.memory_kind == HOST_KIND and x.ndim > 0
        is_param = getattr(path[0], "name", None) == "params"
        if not on_host or (is_param and args):  # given params: passed through by "device"
            rest.append(i)
        elif is_param:
            out.append(Program("stack", i, jax.jit(lambda *a, i=i: _leaves(fn, a)[i],
                                                   out_shardings=s), x, s))
        elif not pieces:
            out.append(Program("leaf", i, jax.jit(lambda *a, i=i: flat(a)[i], out_shardings=s),
                               x, s))
        else:
            rows = min(x.shape[0], max(1, PIECE_BYTES // (x.dtype.itemsize
                                                          * math.prod(x.shape[1:]))))
            out.append(Program("piece", i, jax.jit(
                lambda a, *args, i=i, rows=rows: jax.lax.dynamic_slice_in_dim(
                    flat(args)[i], a, rows, 0)), x, s, rows))
    out.append(Program("device", rest, jax.jit(
        lambda *a: [flat(a)[i] for i in rest], out_shardings=[shards[i] for i in rest],
        donate_argnums=tuple(range(len(args))))))
    return out, treedef


def create_on_host(fn, shardings, args=(), progress: bool = False, pieces: bool = True,
                   report=None):
    """`fn(*args)`'s pytree with `shardings`, made by `programs` one after another (each waited
    for, so no two programs' device buffers are live at once). args: the given params, placed
    with the state's params shardings; donated. progress: a bar of the host bytes made (stderr;
    a 70B state's 267 GiB take minutes). pieces: `programs`'. report: called after each program
    as report(program, its compiled executable, seconds) (experiments.offload_peak --programs)."""
    from tqdm import tqdm

    progs, treedef = programs(fn, shardings, args, pieces)
    made = [None] * treedef.num_leaves
    with tqdm(total=sum(p.nbytes for p in progs), unit="B", unit_scale=True,
              unit_divisor=1024, leave=False, desc="state to host memory",
              disable=not progress, file=sys.stderr) as bar:
        for p in progs:
            t = time.perf_counter()
            compiled = p.lower(*args).compile()
            if p.kind in ("stack", "leaf"):
                made[p.index] = jax.block_until_ready(compiled(*args))
            elif p.kind == "device":
                for j, y in zip(p.index, jax.block_until_ready(compiled(*args))):
                    made[j] = y
            else:  # "piece"
                n = p.leaf.shape[0]
                buf = np.empty(p.leaf.shape, p.leaf.dtype)
                for start in range(0, n, p.rows):
                    a = min(start, n - p.rows)  # the last piece ends at the leaf's end
                    buf[a:a + p.rows] = np.asarray(compiled(np.int32(a), *args))
                made[p.index] = jax.block_until_ready(jax.device_put(buf, p.sharding))
                del buf
            bar.update(p.nbytes)
            if report is not None:
                report(p, compiled, time.perf_counter() - t)
    return treedef.unflatten(made)
