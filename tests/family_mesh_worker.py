"""Runs on 8 simulated CPU devices in a subprocess of tests/test_family_mesh.py: a tiny Gemma 3
(sliding-window and global layers, sandwich norms, QK-norm, scaled embedding) trained 5 fp32
steps on one device and on fsdp, tensor and context meshes.

    python tests/family_mesh_worker.py OUT_DIR

writes OUT_DIR/<mesh>.npz (per-step losses, final params flattened). The test asserts.
"""

import os
import sys

from testenv import worker_jax

jax = worker_jax(8)  # 8 simulated CPU devices, precision highest, the suite's compile cache
import numpy as np  # noqa: E402

from jaxmem.config.run import RunConfig  # noqa: E402
from jaxmem.parallel import run_mesh  # noqa: E402
from jaxmem.train.loss import synthetic_batch  # noqa: E402
from jaxmem.train.placement import Placement  # noqa: E402
from jaxmem.train.run import build_step_config  # noqa: E402

MESHES = {"single": None, "fsdp4": "fsdp=4", "fsdp2_tensor2": "fsdp=2,tensor=2",
          "context2_fsdp2": "context=2,fsdp=2"}
BATCH, SEQ, STEPS = 4, 32, 5
GEMMA3 = {"family": "gemma3", "qk_norm": True, "norm_plus_one": True,
          "norm_placement": "sandwich", "mlp_activation": "gelu_tanh", "embed_scale": True,
          "query_pre_attn_scalar": 24,
          "sliding_window": 8, "rope_local_theta": 500.0, "rope_type": "linear",
          "rope_factor": 2.0, "tie_embeddings": True,
          "layer_types": ("sliding_attention",) * 3 + ("full_attention",)}


def run(cfg: RunConfig, mesh_text, batches):
    model_cfg, step_cfg, loss_scale = build_step_config(cfg)
    devices = jax.devices()[:4]
    mesh = None if mesh_text is None else run_mesh(mesh_text, model_cfg, BATCH, devices)
    par = Placement.single() if mesh is None else Placement.on(mesh)
    state = par.init_state(step_cfg, loss_scale, 0)
    step = par.train_step(step_cfg, state)
    losses = []
    for b in batches:
        state, metrics = step(state, par.batch(b))
        losses.append(float(par.host(metrics)["loss"]))
    params = np.concatenate([np.asarray(x, np.float32).ravel()
                             for x in jax.tree.leaves(state.params)])
    return dict(losses=np.array(losses), params=params)


def main(out):
    cfg = RunConfig().replace({"data.batch_size": BATCH, "data.seq_len": SEQ,
                               "optim.warmup_steps": 1,
                               **{f"model.{k}": v for k, v in GEMMA3.items()}})
    vocab = cfg.model_config().vocab_size
    batches = []
    for i in range(STEPS):
        b = synthetic_batch(jax.random.PRNGKey(100 + i), BATCH, SEQ, vocab, pad_fraction=0.25)
        batches.append({k: np.asarray(v)[None] for k, v in b.items()})  # [K=1, B, T]
    for name, text in MESHES.items():
        np.savez(os.path.join(out, f"{name}.npz"), **run(cfg, text, batches))


if __name__ == "__main__":
    main(sys.argv[1])
