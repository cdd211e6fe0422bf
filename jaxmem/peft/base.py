"""The frozen base of a LoRA / QLoRA run: where it comes from, its content hash, its device copy.

    host = base_on_host(cfg, model_cfg)             # numpy tree: HF files or the seed's init
    digest = base_sha256(host)                       # recorded in config.json, checked on resume
    frozen = base_on_device(host, spec, dtype)       # int8 / NF4 projections, layer by layer
    frozen = base_on_device(host, spec, dtype, shardings)  # on a mesh: each device its shard
    programs = import_programs(model_cfg, spec)      # what the import compiles (memory planner)

The run's checkpoints hold the adapters only; the base is referenced by its source (a Hugging
Face directory given with --init-from, or "init:seed=N", the same random init a full run of that
seed starts from) and the sha256 of its tensors. A resumed run recomputes the hash and refuses to
continue on other weights (RunError, exit 2): adapters trained on one base mean nothing on
another.

The full-precision base never sits whole on the device: it is read into host memory, and each
projection is put on the device one layer at a time and quantized there into its stacked,
donated result (`quantize_on_device`, one jitted `layer_quantizer` per projection shape; the
next layer is put only once the last one is quantized, so one layer's full-precision weight is
on the device at a time). The device's peak while importing is the base made so far, one
projection's stacked result and one layer's input with the quantizer's temporaries
(`import_programs` gives the planner those programs). The embedding, the norms and the LM head
are never quantized (the fused LM-head loss reads the head weight as an array).

On a mesh the base is split by the parameter rules (jaxmem.parallel.rules.base_shardings: codes,
absmax and double-quantization scales are each a sharded leaf) and stays split: the train step's
layer scan slices one layer of each stacked leaf and XLA gathers that slice inside the loop, so
no device ever holds the whole base (tests/test_lora_mesh.py checks the optimized HLO). The base
is never checkpointed: a resumed run rebuilds it from its source, checks the sha256, and places
it for whatever mesh it runs on.
"""

from __future__ import annotations

import functools
import hashlib

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem.families.config import ModelConfig
from jaxmem.families.names import PROJECTIONS as DECODER_PROJECTIONS, input_ndim
from jaxmem.model.roles import param_role
from jaxmem.paths import path_text
from jaxmem.peft.offload import offload_shardings, one_device_shardings
from jaxmem.quant import QuantizedWeight, quantize_layers, quantize_weight

PROJECTIONS = tuple(name for _, name in DECODER_PROJECTIONS.values())  # their roles


def weight_axes(c: ModelConfig) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """name -> (einsum subscripts, per-layer weight shape, number of input axes)."""
    D, N, K, H, F = (c.hidden_size, c.num_heads, c.num_kv_heads, c.resolved_head_dim,
                     c.intermediate_size)
    return {"q": ("BTD,DNH->BTNH", (D, N, H), 1), "k": ("BTD,DKH->BTKH", (D, K, H), 1),
            "v": ("BTD,DKH->BTKH", (D, K, H), 1), "o": ("BTNH,NHD->BTD", (N, H, D), 2),
            "gate": ("BTD,DF->BTF", (D, F), 1), "up": ("BTD,DF->BTF", (D, F), 1),
            "down": ("BTF,FD->BTD", (F, D), 1)}


def init_source(seed: int) -> str:
    return f"init:seed={seed}"


def base_on_host(model_cfg, seed: int, init_from: str | None = None):
    """(source, numpy params tree) of the base: `init_from` (an HF directory) or the random init
    a full run with `seed` starts from, computed on the CPU (nothing left on the accelerator)."""
    if init_from:
        import ml_dtypes

        from jaxmem.io.hf import hf_dtype_name, load_hf_params, read_hf_config
        # kept in the checkpoint's own dtype on the host: an 8B bf16 base is 16 GB, not 32
        dtype = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}.get(
            hf_dtype_name(read_hf_config(init_from)), np.float32)
        return str(init_from), load_hf_params(init_from, model_cfg, dtype)
    from jaxmem.families.params import init_params
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        init_key, _ = jax.random.split(jax.random.PRNGKey(seed))
        params = init_params(model_cfg, init_key)
    return init_source(seed), jax.tree_util.tree_map(np.asarray, params)


def base_sha256(host_params) -> str:
    """sha256 over every tensor's path, dtype, shape and bytes, in path order."""
    h = hashlib.sha256()
    leaves = sorted(jax.tree_util.tree_leaves_with_path(host_params),
                    key=lambda kv: path_text(kv[0]))
    for path, leaf in leaves:
        a = np.ascontiguousarray(np.asarray(leaf))
        h.update(f"{path_text(path)}|{a.dtype}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def base_on_device(host_params, spec: "LoraSpec", dtype, shardings=None):
    """The frozen base for the train step: block projections int8 / NF4 (or `dtype` when
    spec.quantize is "none"), embedding and LM head in `dtype`, norms as stored.

    shardings: None (the default device), or a tree like the result holding a Sharding per leaf
    (jaxmem.parallel.rules.base_shardings). Then each projection is quantized one layer at a time
    on the default device as before, its packed layer copied back to the host, and every leaf
    is placed with `make_array_from_callback`: each device receives only its own shard, and the
    values are bitwise those of the one-device base.
    """
    def place(path, leaf):
        role = param_role(path)
        if role in PROJECTIONS and spec.quantize != "none":
            n_in = input_ndim(role)
            if shardings is None and not isinstance(leaf, jax.core.Tracer):  # eval_shape: not
                return quantize_on_device(leaf, spec.quantize, n_in, spec.block,
                                          spec.double_quant)
            return quantize_layers(leaf, spec.quantize, n_in, spec.block, spec.double_quant,
                                   to_host=shardings is not None)
        if shardings is not None:  # the cast on the host (round to nearest even, as XLA's)
            return np.asarray(leaf) if role == "norm" else np.asarray(leaf).astype(np.dtype(dtype))
        if role == "norm":
            return jnp.asarray(leaf)
        return jnp.asarray(leaf, dtype)
    base = jax.tree_util.tree_map_with_path(place, host_params)
    if shardings is None:
        return base
    return jax.tree.map(lambda x, s: jax.make_array_from_callback(x.shape, s, lambda i: x[i]),
                        base, shardings)


@functools.lru_cache(maxsize=None)
def layer_quantizer(kind: str, n_in: int, block: int, double_quant: bool):
    """jit((stacked leaves, w, i) -> stacked leaves with layer i replaced by quantize_weight(w)), the
    stacked leaves donated (updated in place): w is one layer [in..., out...] in any float
    dtype, i an int32 scalar, the leaves a tuple as QuantizedWeight.tree_flatten gives them."""
    def put(stacked, w, i):
        leaves = quantize_weight(w, kind, n_in, block, double_quant).tree_flatten()[0]
        return tuple(None if s is None else jax.lax.dynamic_update_index_in_dim(s, x, i, 0)
                     for s, x in zip(stacked, leaves))
    return jax.jit(put, donate_argnums=0)


def _stacked_abstract(layer, num_layers: int, kind, n_in, block, double_quant):
    """(abstract stacked leaves, the QuantizedWeight's static data) for `num_layers` layers
    shaped like `layer` (a ShapeDtypeStruct)."""
    q = jax.eval_shape(functools.partial(quantize_weight, kind=kind, n_in=n_in, block=block,
                                         double_quant=double_quant), layer)
    leaves, aux = q.tree_flatten()
    return tuple(None if x is None else jax.ShapeDtypeStruct((num_layers,) + x.shape, x.dtype)
                 for x in leaves), aux


def quantize_on_device(w, kind: str, n_in: int, block: int, double_quant: bool):
    """A stacked weight w [L, in..., out...] (host or device) quantized layer by layer into
    its stacked QuantizedWeight on the default device: bitwise `quant.quantize_layers`' result,
    holding on the device the stacked result and one layer of w (each layer is quantized before
    the next is put: async dispatch would otherwise put every layer first)."""
    layer = jax.ShapeDtypeStruct(w.shape[1:], w.dtype)
    abstract, aux = _stacked_abstract(layer, w.shape[0], kind, n_in, block, double_quant)
    fn = layer_quantizer(kind, n_in, block, double_quant)
    stacked = tuple(None if a is None else jnp.zeros(a.shape, a.dtype) for a in abstract)
    for i in range(w.shape[0]):
        stacked = fn(stacked, jnp.asarray(w[i]), np.int32(i))
        jax.block_until_ready(stacked)
    return QuantizedWeight.tree_unflatten(aux, list(stacked))


def import_programs(model_cfg, spec: "LoraSpec", host_dtype=np.float32) -> list[dict]:
    """The programs a one-device import of a QLoRA base runs, one per projection role:
    {"role", "fn" (layer_quantizer), "args" (ShapeDtypeStructs: the stacked leaves, one layer
    of `host_dtype`, the layer index), "stacked_bytes"}; [] when the base is not quantized.
    host_dtype: the dtype the base is read in (a seed's init: float32, the largest; a
    checkpoint: its own dtype, jaxmem.peft.slices.host_dtype)."""
    from jaxmem.families.params import abstract_params
    if spec.quantize == "none":
        return []
    out = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(abstract_params(model_cfg)):
        role = param_role(path)
        if role not in PROJECTIONS:
            continue
        n_in = input_ndim(role)
        layer = jax.ShapeDtypeStruct(leaf.shape[1:], np.dtype(host_dtype))
        stacked, _ = _stacked_abstract(layer, leaf.shape[0], spec.quantize, n_in, spec.block,
                                       spec.double_quant)
        nbytes = sum(int(x.size) * x.dtype.itemsize for x in stacked if x is not None)
        out.append({"role": role, "stacked_bytes": nbytes,
                    "fn": layer_quantizer(spec.quantize, n_in, spec.block, spec.double_quant),
                    "args": (stacked, layer, jax.ShapeDtypeStruct((), np.int32))})
    return out


def check_base(record: dict, source: str, digest: str) -> None:
    """Refuse a resume whose base differs from the one recorded (ValueError naming both)."""
    saved = (record or {}).get("peft_base")
    if not saved:
        return
    if saved.get("sha256") != digest:
        raise ValueError(f"base weights changed since the run began: {source} has sha256 "
                         f"{digest[:16]}..., the run was trained on {saved.get('source')} with "
                         f"sha256 {str(saved.get('sha256'))[:16]}... (adapters only fit their base)")


def prepare_base(cfg, model_cfg, step_cfg, record: dict | None, init_from: str | None = None,
                 shardings=None):
    """(frozen base on the device, {"source", "sha256", "quantize"} for config.json) of a LoRA
    run; `record` (a continued run's config.json) is checked first: a changed base raises.
    shardings: see `base_on_device` (None: one device). --offload-base host: the "layers"
    leaves go to pinned host memory (jaxmem.peft.offload)."""
    source, host = base_on_host(model_cfg, cfg.data.seed, init_from)
    digest = base_sha256(host)
    check_base(record, source, digest)
    spec = step_cfg.trainable
    if cfg.peft.offload_base == "host":
        shardings = offload_shardings(shardings or one_device_shardings(
            abstract_base(model_cfg, spec, step_cfg.precision.compute_dtype)))
    frozen = base_on_device(host, spec, step_cfg.precision.compute_dtype, shardings)
    del host
    return frozen, {"source": source, "sha256": digest, "quantize": spec.quantize,
                    "block": spec.block, "double_quant": spec.double_quant}


def abstract_base(model_cfg, spec: "LoraSpec", dtype):
    """The frozen base's device shapes and dtypes (packed NF4 / int8 codes, scales), allocating
    nothing: what the memory planner compiles the step with."""
    from jaxmem.families.params import abstract_params
    return jax.eval_shape(lambda p: base_on_device(p, spec, dtype), abstract_params(model_cfg))
