"""Runs on 8 simulated CPU devices in a subprocess of tests/test_parallel.py (the test process's
JAX has already initialized with one device). One process runs every check, so the compiled
steps are shared and the test pays for one JAX start-up:

    python tests/parallel_worker.py OUT_DIR

writes OUT_DIR/<name>.npz (per-step losses, skipped flags, final params flattened) for the
single-device run and each mesh, fp32 and amp-fp16, and OUT_DIR/memory.json (per-device compiled
bytes of the train step for one device and fsdp=8, and the planner's analytic per-device total
for each mesh). The test asserts; this script only measures.
"""

import json
import os
import sys

from testenv import worker_jax

jax = worker_jax(8)  # 8 simulated CPU devices, precision highest, the suite's compile cache
import numpy as np  # noqa: E402

from jaxmem.config.run import RunConfig  # noqa: E402
from jaxmem.parallel import run_mesh  # noqa: E402
from jaxmem.train.placement import Placement  # noqa: E402
from jaxmem.train.loss import synthetic_batch  # noqa: E402
from jaxmem.train.run import build_step_config  # noqa: E402

MESHES = {"fsdp8": "fsdp=8", "data2_fsdp4": "data=2,fsdp=4", "tensor2_fsdp4": "tensor=2,fsdp=4",
          "data8": "data=8", "data2_fsdp2_tensor2": "data=2,fsdp=2,tensor=2"}
BATCH, SEQ, STEPS = 8, 32, 5


def run(cfg: RunConfig, mesh_text, batches):
    model_cfg, step_cfg, loss_scale = build_step_config(cfg)
    k = cfg.data.grad_accum  # the same rows as [k, BATCH / k, T] micro-batches
    batches = [{n: v.reshape((k, BATCH // k) + v.shape[2:]) for n, v in b.items()}
               for b in batches]
    # fsdp=4 alone takes the first 4 of the 8 devices
    devices = jax.devices()[:4] if mesh_text == "fsdp=4" else None
    mesh = None if mesh_text is None else run_mesh(mesh_text, model_cfg, BATCH // k, devices)
    par = Placement.single() if mesh is None else Placement.on(mesh)
    state = par.init_state(step_cfg, loss_scale, 0)
    step = par.train_step(step_cfg, state)
    losses, skipped = [], []
    for b in batches:
        state, metrics = step(state, par.batch(b))
        m = par.host(metrics)
        losses.append(float(m["loss"]))
        skipped.append(bool(m["skipped"]))
    params = np.concatenate([np.asarray(x, np.float32).ravel()
                             for x in jax.tree.leaves(state.params)])
    return dict(losses=np.array(losses), skipped=np.array(skipped), params=params,
                applied=int(par.host(state.applied)))


def main(out):
    # warmup 1: full-size updates from step 2 on, so the params really move
    base = RunConfig().replace({"data.batch_size": BATCH, "data.seq_len": SEQ,
                                "optim.warmup_steps": 1})
    vocab = base.model_config().vocab_size
    batches = []
    for i in range(STEPS):
        b = synthetic_batch(jax.random.PRNGKey(100 + i), BATCH, SEQ, vocab, pad_fraction=0.25)
        batches.append({k: np.asarray(v)[None] for k, v in b.items()})  # [K=1, B, T]
    # amp-fp16 with an initial scale so large that the first two steps overflow and are skipped (checked on one device)
    fp16 = base.replace({"precision.mode": "amp-fp16", "precision.loss_scale_init": 2.0**20})
    # bf16-sr + adamw8bit on widths where fsdp=2 splits the last axes (512 x 2 divides 512 and
    # 1024): the optimizer's row pieces on each shard (issue 28)
    sr8 = base.replace({"precision.mode": "bf16-sr", "optim.optimizer": "adamw8bit",
                        "model.hidden_size": 512, "model.intermediate_size": 1024})
    # fp32 with 2 micro-batches of 4 rows on fsdp=4: the gradients accumulate on their shards
    accum = base.replace({"data.grad_accum": 2, "data.batch_size": BATCH // 2})
    np.savez(os.path.join(out, "fp32_fsdp4_accum2.npz"), **run(accum, "fsdp=4", batches))
    for name, cfg, meshes in (("fp32", base, MESHES), ("fp16", fp16, {"fsdp8": "fsdp=8"}),
                              ("sr8", sr8, {"data4_fsdp2": "data=4,fsdp=2"})):
        np.savez(os.path.join(out, f"{name}_single.npz"), **run(cfg, None, batches))
        for key, text in meshes.items():
            np.savez(os.path.join(out, f"{name}_{key}.npz"), **run(cfg, text, batches))
    if "--memory" in sys.argv:
        from jaxmem.memory.spec import StepSpec
        from jaxmem.memory.analytic import analytic_breakdown
        from jaxmem.memory.compiled import compile_step
        from jaxmem.memory.mesh import resolve
        spec = StepSpec.from_run_config(RunConfig().replace({"data.batch_size": 16}))
        report = {"single": compile_step(spec)}
        for key, text in MESHES.items():
            report[key] = compile_step(spec, text)
            report[key]["analytic_total"] = analytic_breakdown(spec, resolve(spec, text))[
                "total_bytes"]
        report["single"]["analytic_total"] = analytic_breakdown(spec)["total_bytes"]
        with open(os.path.join(out, "memory.json"), "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1])
