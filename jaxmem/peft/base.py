"""The frozen base of a LoRA / QLoRA run: where it comes from, its content hash, its device copy.

    host = base_on_host(cfg, model_cfg)             # numpy tree: HF files or the seed's init
    digest = base_sha256(host)                       # recorded in config.json, checked on resume
    frozen = base_on_device(host, spec, dtype)       # int8 / NF4 projections, layer by layer
    frozen = base_on_device(host, spec, dtype, shardings)  # on a mesh: each device its shard

The run's checkpoints hold the adapters only; the base is referenced by its source (a Hugging
Face directory given with --init-from, or "init:seed=N", the same random init a full run of that
seed starts from) and the sha256 of its tensors. A resumed run recomputes the hash and refuses to
continue on other weights (RunError, exit 2): adapters trained on one base mean nothing on
another.

The full-precision base never sits whole on the device: it is read into host memory, and each
projection is put on the device one layer at a time and quantized there
(jaxmem.peft.quant.quantize_layers). The embedding, the norms and the LM head are never
quantized (the fused LM-head loss reads the head weight as an array).

On a mesh the base is split by the parameter rules (jaxmem.parallel.rules.base_shardings: codes,
absmax and double-quantization scales are each a sharded leaf) and stays split: the train step's
layer scan slices one layer of each stacked leaf and XLA gathers that slice inside the loop, so
no device ever holds the whole base (tests/test_lora_mesh.py checks the optimized HLO). The base
is never checkpointed: a resumed run rebuilds it from its source, checks the sha256, and places
it for whatever mesh it runs on.
"""

from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem.model.roles import param_role, path_text
from jaxmem.peft.lora import LoraSpec
from jaxmem.peft.offload import offload_shardings, one_device_shardings
from jaxmem.peft.quant import quantize_layers

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


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
    from jaxmem.model.llama import init_params
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


def base_on_device(host_params, spec: LoraSpec, dtype, shardings=None):
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
            n_in = 2 if role == "o_proj" else 1
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
    spec = step_cfg.peft
    if cfg.peft.offload_base == "host":
        shardings = offload_shardings(shardings or one_device_shardings(
            abstract_base(model_cfg, spec, step_cfg.precision.compute_dtype)))
    frozen = base_on_device(host, spec, step_cfg.precision.compute_dtype, shardings)
    del host
    return frozen, {"source": source, "sha256": digest, "quantize": spec.quantize,
                    "block": spec.block, "double_quant": spec.double_quant}


def abstract_base(model_cfg, spec: LoraSpec, dtype):
    """The frozen base's device shapes and dtypes (packed NF4 / int8 codes, scales), allocating
    nothing: what the memory planner compiles the step with."""
    from jaxmem.model.llama import abstract_params
    return jax.eval_shape(lambda p: base_on_device(p, spec, dtype), abstract_params(model_cfg))
