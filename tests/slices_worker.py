"""One process of tests/test_slices.py: 2 processes x 2 simulated CPU devices build a tiny
checkpoint's frozen base shard by shard (jaxmem.peft.slices) and compare every addressable shard
with the one-device quantization of the whole base, bitwise:

    python tests/slices_worker.py HF_DIR OUT_DIR PORT PROCESS_ID

writes OUT_DIR/<process>.json: {case: {"mismatch": [leaf paths], "bytes_read": int}} plus the
HF tensor bytes ("total", "rank1": the final norm, replicated) and whether the streamed sha256 equals base_sha256. The test
asserts; this script only measures.
"""

import json
import os
import sys

os.environ["JAX_NUM_CPU_DEVICES"] = "2"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax  # noqa: E402

import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

from jaxmem.io.hf import load_hf_params, read_hf_config, config_from_hf  # noqa: E402
from jaxmem.peft.slices import (HFSlices, abstract_base, host_dtype, sharded_base,  # noqa: E402
                                 streamed_sha256)
from jaxmem.parallel.rules import base_shardings  # noqa: E402
from jaxmem.peft.base import base_on_device, base_sha256  # noqa: E402
from jaxmem.peft.lora import LoraSpec  # noqa: E402


def rule_shardings(abstract, mesh):
    """The run's own rules for the base (jaxmem.parallel.rules.base_shardings)."""
    return base_shardings(abstract, mesh)


def cut_shardings(abstract, mesh):
    """Codes cut inside their blocks (axis 2), absmax on its output axis, the rest on the last
    axis: shard boundaries that are not block boundaries."""
    def one(a):
        spec = [None] * a.ndim
        spec[2 if a.ndim == 4 else -1] = "fsdp"
        return NamedSharding(mesh, P(*spec))
    return jax.tree.map(lambda a: one(a) if a.ndim >= 2 else NamedSharding(mesh, P()), abstract)


def out_shardings(abstract, mesh):
    """Every leaf of rank >= 2 split on its last (output) axis over all the mesh's devices
    (replicated where that axis does not divide): each process holds half of it."""
    axes, n = tuple(mesh.shape), mesh.devices.size

    def one(a):
        if a.ndim < 2 or a.shape[-1] % n:
            return NamedSharding(mesh, P())
        return NamedSharding(mesh, P(*([None] * (a.ndim - 1)), axes))
    return jax.tree.map(one, abstract)


def mismatches(got, ref) -> list[str]:
    bad = []
    for (path, r), g in zip(jax.tree_util.tree_leaves_with_path(ref), jax.tree.leaves(got)):
        r = np.asarray(r)
        if g.dtype != r.dtype or g.shape != r.shape:
            bad.append(f"{jax.tree_util.keystr(path)}: {g.dtype}{g.shape} vs {r.dtype}{r.shape}")
            continue
        for shard in g.addressable_shards:
            if not np.array_equal(np.asarray(shard.data), r[shard.index]):
                bad.append(f"{jax.tree_util.keystr(path)} shard {shard.index}")
    return bad


def main(hf_dir, out_dir, port, pid):
    jax.distributed.initialize(f"localhost:{port}", 2, pid, initialization_timeout=60,
                               heartbeat_timeout_seconds=15)
    model_cfg = config_from_hf(read_hf_config(hf_dir))
    local = jax.local_devices()[0]
    with jax.default_device(local):  # the reference: the whole base on one local device
        host = load_hf_params(hf_dir, model_cfg, host_dtype(hf_dir))
    fsdp = jax.make_mesh((4,), ("fsdp",), axis_types=(AxisType.Auto,))
    data_fsdp = jax.make_mesh((2, 2), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2)
    tensor_fsdp = jax.make_mesh((2, 2), ("tensor", "fsdp"), axis_types=(AxisType.Auto,) * 2)
    cases = {"nf4_dq_rules": (LoraSpec(4, quantize="nf4", double_quant=True), fsdp, rule_shardings),
             "nf4_dq_tensor_fsdp": (LoraSpec(4, quantize="nf4", double_quant=True), tensor_fsdp,
                                    rule_shardings),
             "nf4_dq_out": (LoraSpec(4, quantize="nf4", double_quant=True), fsdp, out_shardings),
             "nf4_cut": (LoraSpec(4, quantize="nf4"), fsdp, cut_shardings),
             "int8_data_fsdp": (LoraSpec(4, quantize="int8"), data_fsdp, out_shardings)}
    result = {}
    for name, (spec, mesh, shardings_of) in cases.items():
        source = HFSlices(hf_dir)
        abstract = abstract_base(model_cfg, spec, np.float32, source.dtype)
        got = sharded_base(source, model_cfg, spec, np.float32, shardings_of(abstract, mesh))
        with jax.default_device(local):
            ref = base_on_device(host, spec, np.float32)
        result[name] = {"mismatch": mismatches(got, ref), "bytes_read": source.bytes_read}
    leaves = jax.tree_util.tree_leaves_with_path(host)
    result["total"] = sum(np.asarray(a).nbytes for _, a in leaves)
    result["rank1"] = sum(np.asarray(a).nbytes for _, a in leaves if np.ndim(a) == 1)
    result["sha256_equal"] = streamed_sha256(HFSlices(hf_dir), model_cfg) == base_sha256(host)
    with open(os.path.join(out_dir, f"{pid}.json"), "w") as f:
        json.dump(result, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
