"""A Flax init evaluated straight into the params' storage dtype, bitwise the fp32 init cast.

    params = init_in_dtype(lambda key: Decoder(cfg).init(key, tokens)["params"], key, jnp.bfloat16)

equals `cast(init(key), bf16)` bit for bit, but under `jax.jit` no fp32 copy of the model is
ever held. Two things in a plain init hold one:

- Flax's `nn.scan` init is one `lax.scan` whose per-layer outputs are the params, stacked
  [L, ...] in fp32; a cast after it holds the whole fp32 stack (7 GiB for llama-3-8b's gate
  projection). Here each top-level scan is re-run with its returned floating outputs (params,
  read by no later op) cast inside the loop body: one layer's fp32 slice at a time.
- XLA:CPU lowers threefry (jax.random's hash) as a rolled loop whose carries are full-size
  uint32 arrays: four 2 GiB buffers for the 8B embedding. Here `random_bits` of the default
  (partitionable threefry, 32-bit) kind is the same hash written out in 20 rounds, which XLA
  fuses with the normal transform and the cast into one loop. GPUs lower threefry unrolled
  already; the values are the same (same algorithm, same counters).

How: the init is traced to a jaxpr and evaluated op by op (`_Eval`), inlining `jit` calls,
re-running scans through `lax.scan`, replacing `random_bits`; every other op is bound as it is.
Anything not recognised falls back to the op itself (correct values, only more memory), and
tests/test_state_init.py checks the values bitwise against Flax's init.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import warnings

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

_CALLS = ("jit", "pjit", "closed_call")
_SCAN_PARAMS = {"jaxpr", "length", "reverse", "unroll"}
_DROP = getattr(jex, "DropVar", ())  # isinstance(v, ()) is False: nothing dropped
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


_STACKS_TO_HOST = contextvars.ContextVar("stacks_to_host", default=False)


@contextlib.contextmanager
def stacks_to_host():
    """Inside it, `init_in_dtype` puts each returned scan output (the stacked layers' params)
    in host memory one layer at a time, as the scan makes it: a state whose layers live on the
    host (--offload-params host) is then created without the whole stack on the device."""
    token = _STACKS_TO_HOST.set(True)
    try:
        yield
    finally:
        _STACKS_TO_HOST.reset(token)


def init_in_dtype(init, key, dtype):
    """`init(key)` with every floating leaf in `dtype`, built without an fp32 copy of the tree
    (see the module docstring). Call it under `jax.jit`."""
    closed = jax.make_jaxpr(init)(key)
    out_tree = jax.tree_util.tree_structure(jax.eval_shape(init, key))
    outs = _Eval(jnp.dtype(dtype)).run(closed.jaxpr, closed.consts, [key], cast_returned=True)
    return jax.tree_util.tree_unflatten(out_tree, [_cast(x, dtype) for x in outs])


def _cast(x, dtype):
    return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x


def _threefry2x32(k1, k2, x1, x2):
    """The Threefry-2x32 hash (20 rounds), unrolled: jax.random's own algorithm
    (jax/_src/random/threefry2x32.py), so the bits are the same."""
    def rotl(v, d):
        return (v << np.uint32(d)) | (v >> np.uint32(32 - d))

    ks = [k1, k2, k1 ^ k2 ^ np.uint32(0x1BD11BDA)]
    x = [x1 + ks[0], x2 + ks[1]]
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x[0] = x[0] + x[1]
            x[1] = x[0] ^ rotl(x[1], r)
        x = [x[0] + ks[(i + 1) % 3], x[1] + ks[(i + 2) % 3] + np.uint32(i + 1)]
    return x


def _random_bits(key, bit_width: int, shape):
    """32-bit partitionable threefry random bits of `shape`, or None where this does not apply
    (then the op itself runs)."""
    size = math.prod(shape)
    if (bit_width != 32 or key.shape != () or size >= 2**32 or not shape
            or not getattr(jax.config, "jax_threefry_partitionable", False)
            or "threefry" not in str(jax.random.key_impl(key))):
        return None
    k = jax.random.key_data(key)  # [2] uint32
    counts = jax.lax.iota(jnp.uint32, size).reshape(shape)  # the flat index: high word 0
    b1, b2 = _threefry2x32(k[0], k[1], jnp.zeros(shape, jnp.uint32), counts)
    return b1 ^ b2


def _scan_counts(p):
    """A scan equation's (constants, carries) counts, or None where its params are not known:
    jax 0.10 names them num_consts / num_carry; jax 0.11 packs the operands as a flat tree
    (consts, carry, xs) in ft_in, whose parts' lengths are the counts."""
    if "ft_in" in p:
        try:
            parts = p["ft_in"].unpack()
            return (len(parts[0]), len(parts[1])) if len(parts) == 3 else None
        except (AttributeError, TypeError):  # another flat tree than jax 0.11's: not known
            return None
    if "num_consts" in p and "num_carry" in p:
        return p["num_consts"], p["num_carry"]
    return None


def _unrecognised_scan(p):
    """A top-level scan this module cannot re-run: the init still gives the right values, but
    holds each stacked fp32 leaf whole (7 GiB for llama-3-8b's gate projection), so say so."""
    warnings.warn(f"jaxmem.model.typed_init: a scan with params {sorted(p)} (jax "
                  f"{jax.__version__}) is not re-run layer by layer; the init is correct but "
                  "holds its fp32 stacks whole (more device memory)", RuntimeWarning,
                  stacklevel=3)


class _Eval:
    def __init__(self, dtype):
        self.dtype = dtype

    def run(self, jaxpr, consts, args, cast_returned=False):
        """Evaluate `jaxpr`; with cast_returned, top-level scans emit their returned floating
        outputs in self.dtype."""
        env = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, args))
        used = {v for e in jaxpr.eqns for v in e.invars if not isinstance(v, jex.Literal)}

        def read(v):
            return v.val if isinstance(v, jex.Literal) else env[v]

        for eqn in jaxpr.eqns:
            vals = [read(v) for v in eqn.invars]
            name, p = eqn.primitive.name, eqn.params
            outs = None
            if name in _CALLS and isinstance(p.get("jaxpr", p.get("call_jaxpr")), jex.ClosedJaxpr):
                sub = p.get("jaxpr", p.get("call_jaxpr"))
                outs = self.run(sub.jaxpr, sub.consts, vals)
            elif name == "scan":
                counts = _scan_counts(p) if _SCAN_PARAMS <= set(p) else None
                if counts is not None:
                    casts = [cast_returned and v not in used for v in eqn.outvars[counts[1]:]]
                    outs = self._scan(p, counts, vals, casts)
                elif cast_returned:
                    _unrecognised_scan(p)
            elif name == "random_bits":
                bits = _random_bits(vals[0], p["bit_width"], tuple(p["shape"]))
                outs = None if bits is None else [bits]
            if outs is None:
                params = eqn.primitive.get_bind_params(p)
                if isinstance(params, tuple):  # older jax: (subfuns, params)
                    vals, params = [*params[0], *vals], params[1]
                outs = eqn.primitive.bind(*vals, **params)
                outs = outs if eqn.primitive.multiple_results else [outs]
            env.update((v, x) for v, x in zip(eqn.outvars, outs) if not isinstance(v, _DROP))
        return [read(v) for v in jaxpr.outvars]

    def _scan(self, p, counts, vals, casts):
        (nc, nk), body = counts, p["jaxpr"]
        consts = vals[:nc]

        def step(carry, xs):
            out = self.run(body.jaxpr, body.consts, [*consts, *carry, *xs])
            ys = [_cast(y, self.dtype) if c else y for y, c in zip(out[nk:], casts)]
            if _STACKS_TO_HOST.get():  # each layer's slice to the host as it is made
                ys = [jax.device_put(y, jax.memory.Space.Host) if c else y
                      for y, c in zip(ys, casts)]
            return list(out[:nk]), ys

        carry, ys = jax.lax.scan(step, list(vals[nc:nc + nk]), list(vals[nc + nk:]),
                                 length=p["length"], reverse=p["reverse"], unroll=p["unroll"])
        return [*carry, *ys]
