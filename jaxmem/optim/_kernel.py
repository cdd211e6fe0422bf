"""`AdamW8bitInPlace`'s update of a large leaf as one kernel (`--update-kernel pallas`).

    eligible(g, m, v, p, leaf_key) -> bool     the leaves this kernel updates (else the XLA loop)
    update_leaf(opt, scalars, g, m, v, p, decays, leaf_key, finite) -> (new p, new m, new v)
    threefry_bits(k0, k1, index) -> uint32     jax.random.bits(key)'s element `index`, computed

Why: XLA makes each row piece of the in-place update six kernels (the block absmax, the code
search, the weight's and the two codes' in-place updates, copies of the old code and weight
slices between them), ~40 bytes moved per element where the update reads and writes ~10
(docs/results.md, "The issue's targets"). Here one Pallas kernel per leaf reads the gradient, the
weight and both moments' codes and scales once, and writes the weight, the codes and the scales
in place (the operands aliased to the results): each program holds R blocks of 256 elements.
A leaf whose moments are fp32 (the embedding: the trainer's `keeps_fp32`) goes through the same
kernel with fp32 moment tiles in place of codes and scales: the 8B's [128256, 4096] embedding,
46 bytes per element in XLA's loop, 22 here (the gradient read; the weight and both moments
read and written).

The numbers are the XLA loop's by construction: the kernel runs `AdamW8bitInPlace.piece_of`'s
own piece function on its tile, with the maps and code tables read from its operands (`take`),
and draws the weight's stochastic-rounding bits with threefry-2x32 on the element's index in its
row piece, as `jax.random.bits(fold_in(leaf key, piece))` does (jax_threefry_partitionable's
layout; the kernel is not used without it).

Where it runs: compiled for a GPU (jaxmem.target.platform() == "gpu") it is a Triton kernel
(its bf16 division written as XLA computes one, in fp32: Triton has none); anywhere else it
runs in Pallas' interpreter, the same jax operations tile by tile. The CPU tests compare it with
the XLA loop bitwise where both programs round bf16 at every operation, and within a bf16 ulp
under XLA's default excess precision, which each program applies to other intermediates. On a
GPU its numbers are Triton's lowering of the same operations (FMA contraction, fp32 division and
square root through libdevice / LLVM): how close they come to XLA's has not been measured
(docs/optimizers.md); until it is, the default stays XLA's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem import target
from jaxmem.bits import key_data
import jaxmem.optim._stochastic as sr
from jaxmem.optim._adamw8bit import moment_pieces
from jaxmem.optim._blockwise import (BLOCK, SIGNED_MAP, UNSIGNED_MAP, Quantized, _axes,
                                     _tables, take_constant)
from jaxmem.xla import alu
from jaxmem.optim._cuts import in_host_memory

R = 16  # blocks of 256 elements per program: 4096 elements, a Triton tile of 16 x 256

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_CYCLES: dict = {}  # a tile program's signature -> its lane cycles per element (`_Tile.cycles`)


def _rotl(x, r: int):
    return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


def threefry2x32(k0, k1, x0, x1):
    """Threefry-2x32 (20 rounds) of the counter words (x0, x1) under key (k0, k1), in uint32
    jax operations: jax's own `threefry2x32_p` written out, so a kernel can run it."""
    ks = (k0, k1, k0 ^ k1 ^ np.uint32(0x1BD11BDA))
    x0, x1 = x0 + ks[0], x1 + ks[1]
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x0 = x0 + x1
            x1 = _rotl(x1, r) ^ x0
        x0 = x0 + ks[(i + 1) % 3]
        x1 = x1 + ks[(i + 2) % 3] + np.uint32(i + 1)
    return x0, x1


def threefry_bits(k0, k1, index):
    """uint32 bits of element `index` (< 2^32) of `jax.random.bits(key, shape, jnp.uint32)`,
    key data (k0, k1), under jax_threefry_partitionable: the element's flat index is the counter
    (high word 0), and its two output words xor-ed."""
    b0, b1 = threefry2x32(k0, k1, jnp.zeros_like(index), index)
    return b0 ^ b1


def _tile_rows(n_blocks: int, blocks_per_piece: int) -> int:
    """R where it divides both the leaf's blocks and a row piece's, else 0."""
    return R if n_blocks % R == 0 and blocks_per_piece % R == 0 else 0


def _width(p, m) -> int:
    """Elements per tile row: for 8-bit moments a block, 256 or a last axis of 128 (or less)
    whole, as `quantize` cuts them (`_block_size`), 0 where that is not a power of two of 16 or
    more (Triton's tiles); for fp32 moments the largest power of two up to 256 that divides the
    last axis (0 below 16)."""
    if not isinstance(m, Quantized):
        w = BLOCK
        while w >= 16 and p.shape[-1] % w:
            w //= 2
        return w if w >= 16 else 0
    w = min(m.block, p.shape[-1])
    return w if w >= 16 and w & (w - 1) == 0 and p.shape[-1] % w == 0 else 0


def _fp32_moments(m, v, p) -> bool:
    return all(not isinstance(x, Quantized) and x.dtype == jnp.float32 and x.shape == p.shape
               for x in (m, v))


def eligible(g, m, v, p, leaf_key) -> bool:
    """Whether `update_leaf` takes this leaf: bf16 weights rounded stochastically (a key) with a
    bf16 gradient array; both moments 8-bit in blocks of 256 along the last axis (or the whole
    last axis where it is 128 or 64 wide: `_width`), or both fp32 with a last axis of 16 or more
    (a power of two divides it); on the device (not host memory), a row piece of R tile rows or
    more, and jax's partitionable threefry (the bits' layout the kernel computes)."""
    if leaf_key is None or callable(g) or p.dtype != jnp.bfloat16 or g.dtype != jnp.bfloat16:
        return False
    quantized = isinstance(m, Quantized) and isinstance(v, Quantized)
    if not (quantized or _fp32_moments(m, v, p)) or not jax.config.jax_threefry_partitionable:
        return False
    w = _width(p, m) if p.ndim else 0
    if not w or quantized and (_axes(m), _axes(v), m.block, v.block) != (1, 1, BLOCK, BLOCK):
        return False
    if any(in_host_memory(x) for x in (p, g, *jax.tree.leaves((m, v)))):
        return False
    _, n, same = moment_pieces(p.shape, m)
    return same and _tile_rows(p.size // w, p.size // n // w) > 0


def _tables_in_order() -> list[np.ndarray]:
    """Every map and code table `quantize` / `dequantize` may read for the two 8-bit maps, in
    the order the kernel takes them as operands."""
    out = [SIGNED_MAP, UNSIGNED_MAP]
    for name in ("signed", "unsigned"):
        t = _tables(name)
        out += [t["mids"], t["nearest"][0], t["lower"][0]]
    return out


class _Tile:
    """One program's work, a function of its tile's arrays: `opt.piece_of`'s piece on the tile
    with the step's scalars (`vals`, the flattened StepScalars with traced leaves filled in),
    the weights' threefry bits of the tile's elements, and the old values kept where not `ok`."""

    def __init__(self, opt, scalars, m, v, decays, rows: int, width: int, divide):
        # (m, v)'s pytree: an 8-bit moment's leaves are its codes and scales (its block static),
        # an fp32 moment is one leaf; the kernel takes the leaves as tiles, in this order
        self.moments = jax.tree.structure((m, v))
        self.opt, self.decays = opt, decays
        self.leaves, self.tree = jax.tree_util.tree_flatten(scalars)
        # the step's traced scalars become operands; Python numbers stay constants of the kernel
        self.traced = [i for i, x in enumerate(self.leaves) if isinstance(x, jax.Array)]
        self.rows, self.width, self.divide = rows, width, divide

    def scalar_operands(self) -> list:
        ops = [jnp.asarray(self.leaves[i]).reshape(1) for i in self.traced]
        return [x.astype(jnp.uint32) if x.dtype == jnp.bool_ else x for x in ops]

    def scalars(self, traced_values) -> list:
        """The flattened StepScalars with `traced_values` (operand dtypes) in place."""
        vals = list(self.leaves)
        for i, x in zip(self.traced, traced_values):
            vals[i] = x != 0 if self.leaves[i].dtype == jnp.bool_ else x
        return vals

    def arrays(self) -> int:
        """How many of the kernel's first operands are tiles: g, p and the moments' leaves."""
        return 2 + self.moments.num_leaves

    def __call__(self, g, p, moments, k0, k1, local, ok, vals, take):
        """(new p, *the new moments' leaves) of the tile, `moments` the old ones' leaves as
        tiles (an 8-bit moment's codes [rows, width] and scales [rows], an fp32 moment
        [rows, width]); `local`: its first element's index in its row piece."""
        piece = self.opt.piece_of(jax.tree_util.tree_unflatten(self.tree, vals), take,
                                  self.divide)
        shape = (self.rows, self.width)
        index = (local + jax.lax.broadcasted_iota(jnp.int32, shape, 0) * self.width
                 + jax.lax.broadcasted_iota(jnp.int32, shape, 1)).astype(jnp.uint32)
        old_m, old_v = jax.tree.unflatten(self.moments,
                                          [x[:, None] if x.ndim == 1 else x for x in moments])
        new_p, new_m, new_v = piece(g, old_m, old_v, p, self.decays, None,
                                    threefry_bits(k0, k1, index))
        new = [new_p, *(y.reshape(x.shape)
                        for y, x in zip(jax.tree.leaves((new_m, new_v)), moments))]
        return tuple(jnp.where(ok, a, b) for a, b in zip(new, (p, *moments)))

    def cycles(self, ins: list) -> int:
        """Lane cycles per element (jaxmem.xla.alu) of XLA:CPU's compiled program of one tile,
        the maps as constants: what the Triton kernel's name tells the time model. Counted once
        per distinct tile program (the leaves of a layer stack share theirs)."""
        static = tuple(None if i in self.traced else x for i, x in enumerate(self.leaves))
        o = self.opt  # what its piece function reads of it (a mask may be an unhashable tree)
        key = ((o.b1, o.b2, o.eps, o.weight_decay, o.clip_norm, o.stochastic_rounding),
               self.tree, static, tuple(self.leaves[i].dtype for i in self.traced),
               self.decays, self.rows, self.width, self.divide, self.moments,
               tuple(x.dtype for x in ins[:self.arrays()]))
        if key not in _CYCLES:
            _CYCLES[key] = self._count(ins)
        return _CYCLES[key]

    def _count(self, ins: list) -> int:
        spec = lambda x, *shape: jax.ShapeDtypeStruct(shape, x.dtype)  # noqa: E731
        r, w, n = self.rows, self.width, self.arrays()
        tiles = [spec(x, r, w) if x.ndim == 2 else spec(x, r) for x in ins[:n]]
        u32 = jax.ShapeDtypeStruct((), jnp.uint32)
        scalars = [spec(x) for x in self.scalar_operands()]

        def f(*args):
            tiled, (k0, k1), traced = args[:n], args[n:n + 2], args[n + 2:]
            return self(*tiled[:2], tiled[2:], k0, k1, 0, True, self.scalars(traced),
                        take_constant)

        with jax.default_device(jax.devices("cpu")[0]):
            text = jax.jit(f).lower(*tiles, u32, u32, *scalars).compile().as_text()
        return alu.cycles_per_element(text, r * w)


def update_leaf(opt, scalars, g, m, v, p, decays, leaf_key, finite):
    """One `eligible` leaf through `opt.piece_of(scalars)` in one kernel, its row pieces' keys
    `sr.pieces(leaf_key, p, n)`'s: (new p, new m, new v) in the leaf's buffers (aliased).
    `finite` False writes the old values back (bitwise the inputs)."""
    from jax.experimental import pallas as pl  # noqa: PLC0415  (only where the kernel runs)

    triton = target.platform() == "gpu"
    _, n, _ = moment_pieces(p.shape, m)
    width = _width(p, m)
    blocks = p.size // width
    per_piece = blocks // n
    rows = _tile_rows(blocks, per_piece)
    tile = _Tile(opt, scalars, m, v, decays, rows, width,
                 _divide_in_fp32 if triton else jnp.divide)
    keys = sr.pieces(leaf_key, p, n=n)
    kdata = key_data(keys(0)) if n == 1 else jax.vmap(lambda j: key_data(keys(j)))(jnp.arange(n))
    kdata = kdata.reshape(-1, 2).astype(jnp.uint32)
    scalar_ops, tables = tile.scalar_operands(), _tables_in_order()
    flat = lambda x: x.reshape(blocks, width)  # noqa: E731  blocks as rows
    n_tiles = tile.arrays()  # g, p, then the moments' leaves (scales: one per tile row)
    moments = jax.tree.leaves((m, v))
    ins = [flat(g), flat(p), *(flat(x) if x.size == p.size else x.reshape(blocks)
                               for x in moments),
           kdata[:, 0], kdata[:, 1], jnp.asarray(finite).astype(jnp.uint32).reshape(1),
           *scalar_ops, *[jnp.asarray(t) for t in tables]]
    load = _triton_load() if triton else (lambda ref, idx: ref[idx])

    def kernel(*refs):
        tiled, (k0_ref, k1_ref, fin_ref), rest = (refs[:n_tiles], refs[n_tiles:n_tiles + 3],
                                                  refs[n_tiles + 3:])
        scalar_refs, rest = rest[:len(scalar_ops)], rest[len(scalar_ops):]
        table_refs, outs = rest[:len(tables)], rest[len(tables):]
        by_id = {id(t): ref for t, ref in zip(tables, table_refs)}
        first = pl.program_id(0) * rows  # the tile's first block
        j = first // per_piece  # its row piece
        new = tile(tiled[0][...], tiled[1][...], [ref[...] for ref in tiled[2:]],
                   k0_ref[j], k1_ref[j], (first - j * per_piece) * width, fin_ref[0] != 0,
                   tile.scalars([ref[0] for ref in scalar_refs]),
                   lambda table, idx: load(by_id[id(table)], idx))
        for out, x in zip(outs, new):
            out[...] = x

    block = pl.BlockSpec((rows, width), lambda i: (i, 0))
    one = pl.BlockSpec((rows,), lambda i: (i,))
    spec = [block if x.ndim == 2 else one for x in ins[:n_tiles]]
    whole = [pl.BlockSpec(x.shape, lambda i, d=x.ndim: (0,) * d) for x in ins[n_tiles:]]
    params = {"compiler_params": _triton_params()} if triton else {}
    new_p, *parts = pl.pallas_call(
        kernel, grid=(blocks // rows,), in_specs=[*spec, *whole], out_specs=spec[1:],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in ins[1:n_tiles]],
        input_output_aliases={i: i - 1 for i in range(1, n_tiles)}, interpret=not triton,
        name=alu.tag("adamw8bit_update", tile.cycles(ins)), **params)(*ins)
    new_m, new_v = jax.tree.unflatten(tile.moments,
                                      [y.reshape(x.shape) for y, x in zip(parts, moments)])
    return new_p.reshape(p.shape), new_m, new_v


def _divide_in_fp32(a, b):
    """a / b as XLA computes a bf16 division (in fp32, rounded back to a's dtype): Triton's
    lowering has no bf16 division."""
    return (a.astype(jnp.float32) / b.astype(jnp.float32)).astype(a.dtype)


def _triton_load():
    from jax.experimental.pallas import triton as plt  # noqa: PLC0415
    return lambda ref, idx: plt.load(ref.at[idx])


def _triton_params():
    from jax.experimental.pallas import triton as plt  # noqa: PLC0415
    return plt.CompilerParams(num_warps=4)
