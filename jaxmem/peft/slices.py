"""A LoRA run's frozen base built shard by shard: each process reads and quantizes only the rows
its devices hold, so no process ever holds the whole 16-bit base.

    source = HFSlices(hf_dir)                 # or HostSlices(model_cfg, host_params)
    frozen = sharded_base(source, model_cfg, spec, dtype, shardings)
    digest = streamed_sha256(source, model_cfg)   # == jaxmem.peft.base.base_sha256(host tree)

`shardings` is a pytree shaped like the frozen base (jaxmem.peft.base.abstract_base): one
jax.sharding.Sharding per leaf, a QuantizedWeight's codes, absmax (or absmax_q, absmax_scale,
absmax_offset under double quantization) included. Every leaf is made with
`jax.make_array_from_callback`, which asks only for the shards of this process's devices; a shard
of a stacked [L, ...] leaf is read layer by layer (HF keeps one tensor per layer).

Why it is bitwise the one-device quantization (jaxmem.peft.base.base_on_device; tested in
tests/test_slices.py): a projection's blocks run along its input axis In, one absmax per block
and output column. The codes [L, In/block, block(/2), Out] and absmax [L, In/block, Out] of any
rectangle of whole blocks x any output columns depend on those weights only, so a shard of either
is quantized from the HF rectangle [out rows, in columns] it covers (HF stores [Out, In]). A
shard that cuts the block axis itself (axis 2 of the codes) is cut from its whole blocks, read in
full. Double quantization's second level (absmax in groups of 256 around the layer's mean) needs
the layer's whole absmax: that one small array (4 bytes per 64 weights) is gathered per layer and
quantized by the same per-layer code as jaxmem.quant.quantize_weight.

Bytes: a process reads the HF rectangles of its devices' shards (each distinct shard once); with
fsdp=N over N processes that is about 1/N of every projection and of the embedding / LM head
(`bytes_read` counts them). The sha256 the run records needs every byte: `streamed_sha256` reads
the whole base once, one tensor at a time, holding one tensor.

HF files must be safetensors (sliceable in place); `HFSlices` refuses pytorch_model.bin files
with an HFError naming the file.
"""

from __future__ import annotations

import functools
import hashlib
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem.io.hf import HFError, hf_dtype_name, read_hf_config, weight_files
from jaxmem.io.hf_names import TensorSpec, tensor_specs
from jaxmem.paths import path_text
from jaxmem.peft.base import base_on_device
from jaxmem.quant import QuantizedWeight, double_quantize, quantize_weight

PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")


def host_dtype(hf_dir):
    """The numpy dtype jaxmem.peft.base.base_on_host keeps a checkpoint's weights in."""
    import ml_dtypes  # noqa: PLC0415

    return {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}.get(
        hf_dtype_name(read_hf_config(hf_dir)), np.float32)


class HFSlices:
    """Rectangles of a Hugging Face checkpoint's tensors, read in place from its safetensors files.

    hf_slice(spec, layer, index) -> numpy array: tensor `spec.name(layer)` [index] in HF layout
    (of the param's part where the tensor is fused: TensorSpec.part) and `dtype` (the host dtype of jaxmem.peft.base.base_on_host). bytes_read counts the bytes of
    every rectangle returned (what this process read from the files).
    """

    def __init__(self, hf_dir):
        hf_dir = Path(hf_dir)
        pickled = [hf_dir / n for n in PICKLE_WEIGHTS if (hf_dir / n).is_file()]
        has_st = any(hf_dir.glob("*.safetensors"))
        if pickled and not has_st:
            raise HFError(f"{pickled[0]}: PyTorch pickle weights cannot be read shard by shard "
                          f"(a mesh run slices each tensor in place); convert the checkpoint to "
                          f"safetensors (transformers: save_pretrained(..., "
                          f"safe_serialization=True))")
        self.hf_dir, self.files = hf_dir, weight_files(hf_dir)
        self.dtype = host_dtype(hf_dir)
        self.bytes_read = 0

    def hf_slice(self, spec: TensorSpec, layer, index: tuple) -> np.ndarray:
        from safetensors import safe_open  # noqa: PLC0415

        name = spec.name(layer)
        if name not in self.files:
            raise HFError(f"{self.hf_dir}: no tensor {name} in the checkpoint's weights")
        # opened per read and closed: a file kept open keeps its pages resident (jaxmem.io.hf)
        with safe_open(self.files[name], framework="numpy") as f:
            part = f.get_slice(name)
            shape = tuple(part.get_shape())
            if shape != spec.tensor_shape:
                raise HFError(f"{self.hf_dir}: tensor {name} has shape {shape}, "
                              f"expected {spec.tensor_shape}")
            # a param stored as part of a fused tensor: the index shifted to its rows
            out = np.asarray(part[spec.tensor_index(index)]).astype(self.dtype, copy=False)
        self.bytes_read += out.nbytes
        return out


class HostSlices:
    """The same rectangles of a params tree already in host memory (a seed's random init)."""

    def __init__(self, host_params):
        self.params, self.bytes_read = host_params, 0
        self.dtype = np.asarray(jax.tree_util.tree_leaves(host_params)[0]).dtype

    def hf_slice(self, spec: TensorSpec, layer, index: tuple) -> np.ndarray:
        leaf = self.params
        for key in spec.path:
            leaf = leaf[key]
        w = np.asarray(leaf[layer] if spec.stacked else leaf)
        if spec.flat:
            w = w.reshape(-1)
        if spec.in_ndim:  # jaxmem [in..., out...] viewed as HF's [Out, In]
            w = w.reshape(math.prod(spec.shape[:spec.in_ndim]), -1).T
        out = np.ascontiguousarray(w[index])
        self.bytes_read += out.nbytes
        return out


# ----------------------------------------------------------------------------- helpers

def _ranges(index, shape) -> list[range]:
    """make_array_from_callback's index (slices, maybe open) -> one range per axis."""
    return [range(*s.indices(n)) for s, n in zip(index, shape)]


def _as_slice(r: range) -> slice:
    return slice(r.start, r.stop)


def _tree_specs(model_cfg) -> dict:
    """The params tree with each leaf's TensorSpec in it."""
    tree: dict = {}
    for spec in tensor_specs(model_cfg):
        node = tree
        for key in spec.path[:-1]:
            node = node.setdefault(key, {})
        node[spec.path[-1]] = spec
    return tree


def _dense_part(source, spec: TensorSpec, layer, ranges: list[range]) -> np.ndarray:
    """One layer's region of a parameter in jaxmem's layout, read as the HF rectangle that holds
    it (a projection's in / out axes flatten to HF's columns / rows)."""
    if spec.flat:  # a bias, flat in HF's file: read whole (small), cut in jaxmem's layout
        whole = source.hf_slice(spec, layer, (slice(0, spec.hf_shape[0]),))
        return np.ascontiguousarray(whole.reshape(spec.shape)[np.ix_(*ranges)])
    if not spec.in_ndim:
        return source.hf_slice(spec, layer, tuple(_as_slice(r) for r in ranges))
    n = spec.in_ndim
    if all(len(r) == size for r, size in zip(ranges, spec.shape)):  # the whole tensor
        whole = tuple(slice(0, size) for size in spec.hf_shape)
        return np.ascontiguousarray(source.hf_slice(spec, layer, whole).T).reshape(spec.shape)
    # flat In / Out index of every element of the region (row-major, as jaxmem.io.hf_names)
    flat_in = np.ravel_multi_index(np.ix_(*ranges[:n]), spec.shape[:n]) if n > 1 else \
        np.asarray(ranges[0])
    out_axes = ranges[n:]
    flat_out = (np.ravel_multi_index(np.ix_(*out_axes), spec.shape[n:]) if len(out_axes) > 1
                else np.asarray(out_axes[0]))
    i0, o0 = int(flat_in.min()), int(flat_out.min())
    box = source.hf_slice(spec, layer, (slice(o0, int(flat_out.max()) + 1),
                                        slice(i0, int(flat_in.max()) + 1))).T  # [In', Out']
    rows = (flat_in - i0).reshape(flat_in.shape + (1,) * flat_out.ndim)
    cols = (flat_out - o0).reshape((1,) * flat_in.ndim + flat_out.shape)
    return np.ascontiguousarray(box[rows, cols])


def _stacked(spec: TensorSpec, index, shape, part) -> np.ndarray:
    """Assemble a shard of a (maybe stacked) leaf from part(layer, per-layer ranges)."""
    ranges = _ranges(index, shape)
    if not spec.stacked:
        return part(None, ranges)
    return np.stack([part(i, ranges[1:]) for i in ranges[0]])


def _dense_leaf(source, spec: TensorSpec, shape, dtype, sharding) -> jax.Array:
    cache: dict = {}  # replicated shards (e.g. over `data`) are read once

    def callback(index):
        key = tuple(tuple(_ranges(index, shape)))
        if key not in cache:
            cache[key] = _stacked(spec, index, shape,
                                  lambda i, r: _dense_part(source, spec, i, r)).astype(dtype)
        return cache[key]
    return jax.make_array_from_callback(shape, sharding, callback)


# ----------------------------------------------------------------------------- quantized

@functools.lru_cache(maxsize=None)
def _quantize_fn(kind: str, block: int):
    """One [In', Out'] rectangle of whole blocks -> (codes, absmax), jitted once per shape."""
    return jax.jit(lambda w: quantize_weight(w, kind, 1, block, False).tree_flatten()[0][:2])


# one layer's absmax [In/block, Out] -> (absmax_q, absmax_scale, absmax_offset): the code of
# jaxmem.quant.quantize_weight after its absmax, compiled once (tests/test_slices.py: bitwise)
_second_level = jax.jit(double_quantize)


class _Quantizer:
    """Quantized rectangles of one projection, each read and quantized once per build."""

    def __init__(self, source, spec: TensorSpec, kind: str, block: int):
        self.source, self.spec, self.kind, self.block = source, spec, kind, block
        self.In = math.prod(spec.shape[:spec.in_ndim])
        self.cache: dict = {}

    def blocks(self, layer: int, blocks: range, out: range):
        """(codes [nb', block(/2), Out'], absmax [nb', Out']) of whole blocks `blocks` x `out`."""
        for (i, b0, b1, o0, o1), (codes, absmax) in self.cache.items():
            if i == layer and b0 <= blocks.start and blocks.stop <= b1 and o0 <= out.start \
                    and out.stop <= o1:  # inside a rectangle already read (absmax of codes)
                rows = slice(blocks.start - b0, blocks.stop - b0)
                cols = slice(out.start - o0, out.stop - o0)
                return codes[rows, :, cols], absmax[rows, cols]
        b = self.block
        rect = self.source.hf_slice(self.spec, layer, (slice(out.start, out.stop),
                                                       slice(blocks.start * b, blocks.stop * b)))
        codes, absmax = _quantize_fn(self.kind, b)(jnp.asarray(rect.T))  # [In', Out']
        key = (layer, blocks.start, blocks.stop, out.start, out.stop)
        self.cache[key] = (np.asarray(codes), np.asarray(absmax))
        return self.cache[key]


def _quantized_leaf(qz: _Quantizer, which: int, shape, dtype, sharding) -> jax.Array:
    """codes (which=0) or absmax (which=1) of the stacked projection, shard by shard."""
    def callback(index):
        ranges = _ranges(index, shape)
        layers, blocks, out = ranges[0], ranges[1], ranges[-1]
        parts = []
        for i in layers:
            codes, absmax = qz.blocks(i, blocks, out)
            parts.append(codes[:, _as_slice(ranges[2])] if which == 0 else absmax)
        return np.stack(parts).astype(dtype, copy=False)
    return jax.make_array_from_callback(shape, sharding, callback)


def _absmax_sharding(codes_sharding):
    """The codes' sharding without its block axis: where the layer's absmax is computed."""
    from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: PLC0415

    if not isinstance(codes_sharding, NamedSharding):
        return codes_sharding
    spec = tuple(codes_sharding.spec) + (None,) * (4 - len(codes_sharding.spec))
    return NamedSharding(codes_sharding.mesh, P(spec[0], spec[1], spec[3]))


def _quantized_base(source, spec: TensorSpec, q_abs: QuantizedWeight, shardings: QuantizedWeight):
    """One stacked projection's QuantizedWeight, its leaves placed as `shardings` says."""
    kind, shape, n_in, block = q_abs.tree_flatten()[1]
    qz = _Quantizer(source, spec, kind, block)
    codes_abs, absmax_abs, absmax_q_abs, scale_abs, offset_abs = q_abs.tree_flatten()[0]
    codes_sh, absmax_sh, q_sh, scale_sh, offset_sh = shardings.tree_flatten()[0]
    codes = _quantized_leaf(qz, 0, codes_abs.shape, codes_abs.dtype, codes_sh)
    if absmax_abs is not None:
        absmax = _quantized_leaf(qz, 1, absmax_abs.shape, absmax_abs.dtype, absmax_sh)
        return QuantizedWeight(codes, absmax, None, None, None, kind, shape, n_in, block)
    # double quantization: the layer's whole absmax (small) on every device, one layer at a time
    L, nb, _, Out = codes_abs.shape
    absmax = _quantized_leaf(qz, 1, (L, nb, Out), np.float32, _absmax_sharding(codes_sh))
    gather = jax.jit(lambda a, i: jax.lax.dynamic_index_in_dim(a, i, keepdims=False),
                     out_shardings=_replicated_like(codes_sh))
    levels = []
    for i in range(L):
        whole = np.asarray(gather(absmax, i).addressable_data(0))  # [nb, Out], this host
        levels.append([np.asarray(x) for x in _second_level(jnp.asarray(whole))])
    del absmax
    q, scale, offset = (np.stack(parts) for parts in zip(*levels))
    out = [jax.make_array_from_callback(a.shape, sh, lambda idx, h=h: h[idx])
           for a, sh, h in ((absmax_q_abs, q_sh, q), (scale_abs, scale_sh, scale),
                            (offset_abs, offset_sh, offset))]
    return QuantizedWeight(codes, None, *out, kind, shape, n_in, block)


def _replicated_like(sharding):
    from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: PLC0415

    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, P())
    return jax.sharding.SingleDeviceSharding(next(iter(sharding.device_set)))


# ----------------------------------------------------------------------------- the base

def abstract_base(model_cfg, spec, dtype, host_dtype=np.float32):
    """The frozen base's shapes and dtypes when the host weights are `host_dtype` (the norms
    keep it), allocating nothing."""
    from jaxmem.families.params import abstract_params  # noqa: PLC0415

    host = abstract_params(model_cfg, host_dtype)
    return jax.eval_shape(lambda p: base_on_device(p, spec, dtype), host)


def sharded_base(source, model_cfg, spec, dtype, shardings):
    """The frozen base of jaxmem.peft.base.base_on_device, built shard by shard from `source`.

    Args:
      source: HFSlices(hf_dir) or HostSlices(host_params).
      model_cfg: the run's ModelConfig.
      spec: the run's LoraSpec (quantize "none" / "int8" / "nf4", block, double_quant).
      dtype: compute dtype of the unquantized leaves (embedding, LM head, a 16-bit base).
      shardings: a pytree shaped like abstract_base(model_cfg, spec, dtype) with one Sharding
        per leaf (e.g. the mesh's parameter rules; SingleDeviceSharding for one device).
    Returns:
      The frozen base tree, each leaf a global jax.Array with its sharding, equal bitwise to
      base_on_device(host tree, spec, dtype).
    Example: tests/test_slices.py (4 simulated devices, fsdp=4: equal bitwise, each device's
      shard reads 1/4 of each projection's bytes).
    """
    abstract = abstract_base(model_cfg, spec, dtype, source.dtype)
    specs = _tree_specs(model_cfg)

    def build(tspec, a, sh):
        if isinstance(a, QuantizedWeight):
            return _quantized_base(source, tspec, a, sh)
        return _dense_leaf(source, tspec, tuple(a.shape), a.dtype, sh)
    is_leaf = lambda x: isinstance(x, (QuantizedWeight, TensorSpec))  # noqa: E731
    return jax.tree_util.tree_map(build, specs, abstract, shardings, is_leaf=is_leaf)


def streamed_sha256(source, model_cfg) -> str:
    """jaxmem.peft.base.base_sha256 of the base `source` holds, read one tensor (one layer's
    slice) at a time: the same digest without holding the base."""
    leaves = jax.tree_util.tree_leaves_with_path(
        _tree_specs(model_cfg), is_leaf=lambda x: isinstance(x, TensorSpec))
    h = hashlib.sha256()
    for path, spec in sorted(leaves, key=lambda kv: path_text(kv[0])):
        shape = ((model_cfg.num_layers,) if spec.stacked else ()) + spec.shape
        h.update(f"{path_text(path)}|{np.dtype(source.dtype)}|{shape}|".encode())
        whole = [range(n) for n in spec.shape]
        for layer in (range(model_cfg.num_layers) if spec.stacked else (None,)):
            part = np.ascontiguousarray(_dense_part(source, spec, layer, whole))
            h.update(part.reshape(-1).view(np.uint8).data)  # the bytes, not a copy of them
    return h.hexdigest()


# ----------------------------------------------------------------------------- a run's base

def differing_base(digests: list[str], me: int) -> str | None:
    """The error for process `me` when the processes' base sha256s (index = process) are not all
    the same, else None. The process that differs from process 0 names itself; the others name
    it, so every process stops with the same cause."""
    odd = [i for i, d in enumerate(digests) if d != digests[0]]
    if not odd:
        return None
    if me in odd:
        return (f"process {me}: its base weights differ from process 0's (sha256 "
                f"{digests[me][:16]}... vs {digests[0][:16]}...): every process must read the same "
                f"base")
    return (f"process {odd[0]}: its base weights differ from process 0's (sha256 "
            f"{digests[odd[0]][:16]}... vs {digests[0][:16]}...); process {me} stops too")


def _all_digests(digest: str) -> list[str]:
    """Every process's sha256 (one all-gather of 32 bytes), in process order."""
    if jax.process_count() == 1:
        return [digest]
    from jax.experimental import multihost_utils  # noqa: PLC0415

    mine = np.frombuffer(bytes.fromhex(digest), np.uint8)
    every = np.asarray(multihost_utils.process_allgather(mine)).reshape(jax.process_count(), -1)
    return [bytes(row).hex() for row in every]


def prepare_base_from_slices(cfg, model_cfg, step_cfg, record, init_from=None, shardings=None):
    """jaxmem.peft.base.prepare_base, reading a Hugging Face base shard by shard when it is
    split over a mesh, and checking that every process has the same base.

    Args: as prepare_base; shardings from Placement.base_shardings (None: one device).
    Returns: (frozen base, {"source", "sha256", "quantize", "block", "double_quant"}).
    Raises: HFError (pytorch_model.bin: cannot be sliced; a missing tensor), ValueError (the
      base differs from the run's record, or from process 0's), each one line naming the file /
      process. Example: `python -m jaxmem.launch --processes 2 --devices-per-process 2 --
      --init-from hf/tiny --lora-rank 8 --quantize-base nf4 --mesh fsdp=4 ...` (each process
      reads half of every projection; tests/test_lora_multiprocess.py).
    """
    from jaxmem.peft.base import check_base, prepare_base  # noqa: PLC0415

    spec = step_cfg.trainable
    if shardings is None or not init_from:  # one device, or a seed's init (whole on the host)
        frozen, rec = prepare_base(cfg, model_cfg, step_cfg, record, init_from, shardings)
    else:
        source = HFSlices(init_from)
        digest = streamed_sha256(source, model_cfg)
        check_base(record, str(init_from), digest)
        frozen = sharded_base(source, model_cfg, spec, step_cfg.precision.compute_dtype,
                              shardings)
        rec = {"source": str(init_from), "sha256": digest, "quantize": spec.quantize,
               "block": spec.block, "double_quant": spec.double_quant}
    error = differing_base(_all_digests(rec["sha256"]), jax.process_index())
    if error:
        raise ValueError(error)
    return frozen, rec
