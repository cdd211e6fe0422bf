"""Runs on 8 simulated CPU devices in a subprocess of tests/test_context.py (context
parallelism, jaxmem.model.context). For each case it computes, on one device and on each mesh:
the step's loss and gradients (the train step's own loss function, jitted under the placement's
rules and the load-balanced batch permutation), and the losses of 2 real train steps
(Placement.train_step):

    python tests/context_worker.py OUT_DIR SEQ CASE[,CASE...]

writes OUT_DIR/<case>_<mesh>.npz. The test asserts; this script only measures.
"""

import os
import sys

from testenv import worker_jax

jax = worker_jax(8)  # 8 simulated CPU devices, precision highest, the suite's compile cache
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxmem.parallel.rules as R  # noqa: E402
from jaxmem.config.run import RunConfig  # noqa: E402
from jaxmem.parallel import run_mesh  # noqa: E402
from jaxmem.peft.base import base_on_device, base_on_host  # noqa: E402
from jaxmem.peft.lora import LoraSpec  # noqa: E402
from jaxmem.train.loss import token_loss  # noqa: E402
from jaxmem.train.placement import Placement, _balanced, _WithRules  # noqa: E402
from jaxmem.train.run import build_step_config  # noqa: E402

BATCH = 4
LONG_BATCH = 2  # rows at T >= 4096: half the CPU time of the issue's size test, same meshes
MESHES = {"context4": "context=4", "fsdp2_context2": "fsdp=2,context=2",
          "data2_context4": "data=2,context=4", "tensor2_context2": "tensor=2,context=2",
          "fsdp4": "fsdp=4"}
CASES = {  # name: (RunConfig overrides, grad_accum, meshes)
    "packed": ({}, 1, ("context4", "fsdp2_context2")),
    "unpacked": ({}, 1, ("context4",)),
    "remat_accum": ({"remat.policy": "full"}, 2, ("fsdp2_context2", "data2_context4")),
    "tensor": ({}, 1, ("tensor2_context2",)),
    "qlora": ({"peft.lora_rank": 4, "peft.quantize_base": "nf4", "peft.double_quant": True},
              1, ("fsdp2_context2",)),
    # fp8's gradients on a mesh are not one device's to 1e-4 (tests/test_context.py says why):
    # compared with each other and with amp-bf16 on one device ("fp8_ref") instead
    "fp8": ({"precision.mode": "fp8"}, 1, ("context4", "fsdp4")),
    "fp8_ref": ({"precision.mode": "amp-bf16"}, 1, ()),
}


def packed_batch(rng, K, B, T, vocab, packed=True):
    """[K, B, T] numpy batch: several documents per row (segment ids from 1, positions
    restarting per document) and trailing padding (segment 0, mask 0)."""
    tokens = rng.integers(0, vocab, (K, B, T + 1)).astype(np.int32)
    seg = np.zeros((K, B, T), np.int32)
    pos = np.zeros((K, B, T), np.int32)
    for k in range(K):
        for b in range(B):
            end = T - int(rng.integers(0, T // 8))  # trailing padding
            cuts = np.sort(rng.choice(np.arange(1, end), size=5, replace=False))
            bounds = [0, *cuts, end]
            for s, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
                seg[k, b, lo:hi] = s + 1
                pos[k, b, lo:hi] = np.arange(hi - lo)
    out = {"inputs": tokens[..., :-1], "targets": tokens[..., 1:],
           "mask": (seg != 0).astype(np.int32)}
    if packed:
        out.update(segment_ids=seg, positions=pos)
    return out


def run(cfg, mesh_text, batches, accum):
    model_cfg, step_cfg, loss_scale = build_step_config(cfg)
    mesh = None if mesh_text is None else run_mesh(
        mesh_text, model_cfg, cfg.data.batch_size, devices=jax.devices()[:int(np.prod(
            [int(p.split("=")[1]) for p in mesh_text.split(",")]))],
        seq_len=cfg.data.seq_len)
    par = Placement.single() if mesh is None else Placement.on(mesh)
    frozen = ()
    if isinstance(step_cfg.trainable, LoraSpec):
        _, host = base_on_host(model_cfg, cfg.data.seed)
        frozen = (base_on_device(host, step_cfg.trainable, step_cfg.precision.compute_dtype,
                                 par.base_shardings(step_cfg)),)
    state = par.init_state(step_cfg, loss_scale, 0)
    model, dtype = step_cfg.build_model(), step_cfg.precision.compute_dtype

    def loss_fn(params, batch, *base):  # the step's micro-batch loss over the whole batch
        total = jnp.maximum(jnp.sum(batch["mask"]).astype(jnp.float32), 1.0)
        d = dtype
        if base:
            params, d = step_cfg.trainable.model_params(params, base[0], dtype)
        return sum(token_loss(model, params, jax.tree.map(lambda x: x[k], batch), False, d,
                              step_cfg.loss_chunk)[0]
                   for k in range(batch["mask"].shape[0])) / total

    grad = jax.value_and_grad(loss_fn)
    if mesh is None:
        grad_fn = jax.jit(grad)
    else:
        grad_fn = _WithRules(jax.jit(_balanced(grad, mesh, step_cfg)),
                             R.activation_rules(mesh, model_cfg.vocab_size),
                             R.lora_packed_gather(step_cfg, mesh),
                             R.weight_rule(mesh, model_cfg.num_layers), mesh)
    loss, g = grad_fn(state.params, par.batch(batches[0]), *frozen)
    grads = np.concatenate([np.asarray(x, np.float32).ravel() for x in jax.tree.leaves(g)])
    step = par.train_step(step_cfg, state)
    losses = []
    for b in batches:
        state, metrics = step(state, par.batch(b), *frozen)
        losses.append(float(par.host(metrics)["loss"]))
    return dict(loss=float(loss), grads=grads, losses=np.array(losses))


def main(out, seq, cases):
    for case in cases.split(","):
        overrides, accum, meshes = CASES[case]
        batch = BATCH if seq < 4096 else LONG_BATCH
        cfg = RunConfig().replace({"data.batch_size": batch, "data.seq_len": seq,
                                   "data.grad_accum": accum, "model.num_layers": 2,
                                   "model.max_position_embeddings": max(512, seq),
                                   "optim.warmup_steps": 1, **overrides})
        rng = np.random.default_rng(0)
        batches = [packed_batch(rng, accum, batch, seq, cfg.model_config().vocab_size,
                                packed=case != "unpacked") for _ in range(2)]
        np.savez(os.path.join(out, f"{case}_single.npz"), **run(cfg, None, batches, accum))
        for m in meshes:
            np.savez(os.path.join(out, f"{case}_{m}.npz"), **run(cfg, MESHES[m], batches, accum))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
