"""Runs on 8 simulated CPU devices in a subprocess of tests/test_loss_norm.py: one train step on
one device and on `data=2,context=2` (rows split over devices, tokens over context), grad
accumulation 2, packed rows whose trained-token counts differ from row to row and micro-batch
to micro-batch; beside them, the loss computed directly from the model's logits (sum of token
losses / trained tokens of the whole step), its gradient's norm, and the two wrong
normalizations (mean of the micro-batches' means, mean of the rows' means):

    python tests/loss_norm_worker.py OUT_DIR SEQ

writes OUT_DIR/loss_norm.json. The test asserts; this script only measures.
"""

import json
import os
import sys

from testenv import worker_jax

jax = worker_jax(8)  # 8 simulated CPU devices, precision highest, the suite's compile cache
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxmem.config.run import RunConfig  # noqa: E402
from jaxmem.parallel import run_mesh  # noqa: E402
from jaxmem.train.placement import Placement  # noqa: E402
from jaxmem.train.run import build_step_config  # noqa: E402

K, B = 2, 2
MESH = "data=2,context=2"


def uneven_batch(T: int, vocab: int) -> dict:
    """[K, B, T]: 4 documents per row (segment ids, positions restarting), trailing padding,
    and a loss mask that trains a different number of tokens in every row (3 to T - 40)."""
    rng = np.random.default_rng(0)
    trained = np.array([[T - 40, 3], [17, T // 2]])  # per row
    tokens = rng.integers(0, vocab, (K, B, T + 1)).astype(np.int32)
    seg, pos = np.zeros((K, B, T), np.int32), np.zeros((K, B, T), np.int32)
    mask = np.zeros((K, B, T), np.int32)
    for k in range(K):
        for b in range(B):
            end = T - 8 * (k + b)  # trailing padding: segment 0
            bounds = [0, *np.sort(rng.choice(np.arange(1, end), 3, replace=False)), end]
            for s, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
                seg[k, b, lo:hi], pos[k, b, lo:hi] = s + 1, np.arange(hi - lo)
            real = np.flatnonzero(seg[k, b])
            mask[k, b, rng.choice(real, trained[k, b], replace=False)] = 1
    return {"inputs": tokens[..., :-1], "targets": tokens[..., 1:], "mask": mask,
            "segment_ids": seg, "positions": pos}


def sharpened(state):
    """The state with its LM head x 30: at init every token's loss is about log V, and no
    normalization could be told from another; sharper logits make token losses differ."""
    params = dict(state.params)
    params["lm_head"] = jax.tree.map(lambda w: w * 30.0, params["lm_head"])
    return state.replace(params=params)


def step_metrics(cfg, model_cfg, step_cfg, loss_scale, batch, mesh_text):
    mesh = None if mesh_text is None else run_mesh(mesh_text, model_cfg, B,
                                                   devices=jax.devices()[:4], seq_len=cfg.data.seq_len)
    par = Placement.single() if mesh is None else Placement.on(mesh)
    state = sharpened(par.init_state(step_cfg, loss_scale, 0))
    _, metrics = par.train_step(step_cfg, state)(state, par.batch(batch))
    m = par.host(metrics)
    return {"loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]),
            "tokens": float(m["tokens"])}


def direct(step_cfg, loss_scale, batch):
    """The step's loss from its definition, on one device: every token's -log p(target) from
    the model's full logits, summed over the trained tokens of all micro-batches and rows,
    divided by their number; its gradient's norm; the wrong normalizations."""
    model = step_cfg.build_model()
    params = sharpened(Placement.single().init_state(step_cfg, loss_scale, 0)).params
    b = jax.tree.map(jnp.asarray, batch)

    def nll(params):  # [K, B, T] fp32
        out = []
        for k in range(K):
            logits = model.apply({"params": params}, b["inputs"][k],
                                 segment_ids=b["segment_ids"][k], positions=b["positions"][k])
            logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [B, T, V]
            out.append(-jnp.take_along_axis(logp, b["targets"][k][..., None], -1)[..., 0])
        return jnp.stack(out)

    mask = b["mask"].astype(jnp.float32)
    loss, grads = jax.jit(jax.value_and_grad(lambda p: jnp.sum(nll(p) * mask) / jnp.sum(mask)))(
        params)
    per_token = jax.jit(nll)(params) * mask
    by_micro = jnp.mean(jnp.sum(per_token, (1, 2)) / jnp.sum(mask, (1, 2)))
    by_row = jnp.mean(jnp.sum(per_token, 2) / jnp.sum(mask, 2))
    norm = jnp.sqrt(sum(jnp.sum(g.astype(jnp.float32) ** 2) for g in jax.tree.leaves(grads)))
    return {"loss": float(loss), "grad_norm": float(norm), "tokens": float(jnp.sum(mask)),
            "mean_of_micro_batch_means": float(by_micro), "mean_of_row_means": float(by_row)}


def main(out, seq):
    cfg = RunConfig().replace({"model.num_layers": 2, "model.hidden_size": 64,
                               "model.intermediate_size": 128, "model.num_heads": 4,
                               "model.num_kv_heads": 2, "model.max_position_embeddings": seq,
                               "data.batch_size": B, "data.seq_len": seq, "data.grad_accum": K,
                               "optim.warmup_steps": 1})
    model_cfg, step_cfg, loss_scale = build_step_config(cfg)
    batch = uneven_batch(seq, model_cfg.vocab_size)
    result = {"direct": direct(step_cfg, loss_scale, batch),
              "single": step_metrics(cfg, model_cfg, step_cfg, loss_scale, batch, None),
              "mesh": step_metrics(cfg, model_cfg, step_cfg, loss_scale, batch, MESH),
              "trained_per_row": batch["mask"].sum(-1).tolist()}
    with open(os.path.join(out, "loss_norm.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
