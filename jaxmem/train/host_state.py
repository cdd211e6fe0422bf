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

import jax
import numpy as np
from jax.extend.core import jaxpr_as_fun

from jaxmem.model.typed_init import stacks_to_host
from jaxmem.peft.offload import HOST_KIND

PIECE_BYTES = 256 << 20  # one piece of a host leaf made on the device at a time, at most


def _traced(fn, args):
    """`fn` traced once, as a function of its args returning its flat outputs: the pieces' and
    the device leaves' programs evaluate it, so `fn` (a whole model's init) is not traced again
    for each. (A "stack" program traces `fn` itself, inside `stacks_to_host`: evaluated from a
    jaxpr, the scan's copies to the host were lost.)"""
    run = jaxpr_as_fun(jax.make_jaxpr(fn)(*args))
    return lambda a: run(*jax.tree_util.tree_leaves(a))


def _leaves(fn, args):
    return jax.tree_util.tree_leaves(fn(*args))


def programs(fn, shardings, args=(), pieces: bool = True):
    """The state creation's programs in the order they run, as (kind, leaf index, jitted, rows):
    "piece" (a leaf's rows [a, a + rows), `jitted(a, *args)`), "stack" (a params leaf made a layer
    at a time into host memory, `jitted(*args)`; trace and lower it inside `stacks_to_host`), and
    last "device" (index None: every other leaf, `jitted(*args)`, args donated). pieces=False (a
    mesh, whose leaves are split over devices and processes): each optimizer leaf whole, "leaf"
    (`jitted(*args)`; one device's shard of it on that device at a time)."""
    abstract = jax.eval_shape(fn, *args)
    paths, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    shards = treedef.flatten_up_to(shardings)
    out, rest = [], []
    flat = _traced(fn, args)
    for i, ((path, x), s) in enumerate(zip(paths, shards)):
        on_host = s.memory_kind == HOST_KIND and x.ndim > 0
        is_param = getattr(path[0], "name", None) == "params"
        if not on_host or (is_param and args):  # given params: passed through by "device"
            rest.append(i)
        elif is_param:
            out.append(("stack", i, jax.jit(lambda *a, i=i: _leaves(fn, a)[i],
                                             out_shardings=s), None))
        elif not pieces:
            out.append(("leaf", i, jax.jit(lambda *a, i=i: flat(a)[i], out_shardings=s), None))
        else:
            rows = min(x.shape[0], max(1, PIECE_BYTES // (x.dtype.itemsize
                                                          * math.prod(x.shape[1:]))))
            out.append(("piece", i, jax.jit(
                lambda a, *args, i=i, rows=rows: jax.lax.dynamic_slice_in_dim(
                    flat(args)[i], a, rows, 0)), rows))
    out.append(("device", None, jax.jit(
        lambda *a: [flat(a)[i] for i in rest], out_shardings=[shards[i] for i in rest],
        donate_argnums=tuple(range(len(args)))), rest))
    return out


def create_on_host(fn, shardings, args=(), progress: bool = False, pieces: bool = True):
    """`fn(*args)`'s pytree with `shardings`, made by `programs` one after another (each waited
    for, so no two programs' device buffers are live at once). args: the given params, placed
    with the state's params shardings; donated. progress: a bar of the host bytes made (stderr;
    a 70B state's 267 GiB take minutes). pieces: `programs`'."""
    from tqdm import tqdm

    abstract = jax.eval_shape(fn, *args)
    leaves, treedef = jax.tree_util.tree_flatten(abstract)
    shards = treedef.flatten_up_to(shardings)
    made = [None] * len(leaves)
    progs = programs(fn, shardings, args, pieces)
    nbytes = [0 if i is None else leaves[i].size * leaves[i].dtype.itemsize
              for _, i, _, _ in progs]
    with tqdm(total=sum(nbytes), unit="B", unit_scale=True, unit_divisor=1024, leave=False,
              desc="state to host memory", disable=not progress, file=sys.stderr) as bar:
        for (kind, i, jitted, extra), n in zip(progs, nbytes):
            if kind in ("stack", "leaf"):
                with stacks_to_host() if kind == "stack" else contextlib.nullcontext():
                    made[i] = jax.block_until_ready(jitted(*args))
            elif kind == "piece":
                x, rows = leaves[i], extra
                buf = np.empty(x.shape, x.dtype)
                for start in range(0, x.shape[0], rows):
                    a = min(start, x.shape[0] - rows)  # the last piece ends at the leaf's end
                    buf[a:a + rows] = np.asarray(jitted(np.int32(a), *args))
                made[i] = jax.block_until_ready(jax.device_put(buf, shards[i]))
                del buf
            else:
                for j, y in zip(extra, jitted(*args)):
                    made[j] = y
            bar.update(n)
    return treedef.unflatten(made)
