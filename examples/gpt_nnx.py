"""A GPT-2-style Flax NNX model (not jaxmem's Llama) trained in fp16 with jaxmem's parts.

    python examples/gpt_nnx.py [--steps 30]

Learned positions, LayerNorm, GELU MLP, its own parameter names. Each saving is added in turn
and the train step analyzed with `jaxmem.memory.analyze` (compile only, nothing allocated):
  1. fp32, optax.adamw, optax cross-entropy over full [B, T, V] logits (the baseline);
  2. + jaxmem.optim.adamw_8bit: the optimizer state, an argument of the step, shrinks;
  3. + jaxmem.loss.fused_cross_entropy: no [B, T, V] logits, the compiled temp shrinks;
  4. + fp16 compute, jaxmem.optim.DynamicLossScale (GradScaler's): the backward keeps less
     (softmax and LayerNorm statistics stay fp32; XLA:CPU emulates fp16: no GPU figure).
The model is small (V=8192, D=64, T=128, one layer: a CPU runs it in seconds) and shaped so that,
as in an LLM with a large vocabulary, the [B, T, V] logits are the step's largest temporary; where
attention scores [B, N, T, T] over many layers dominate instead, the fused loss removes a smaller
share of temp. The analysis batch (256 x 128) is larger than the training one (4 x 128): the
fused loss's backward takes vocabulary slices of up to 256 MiB of fp32 logits, so below that size
it saves nothing.
Step 4 then trains --steps steps with adamw_8bit and with optax.adamw (same init, data, scale).
Exit 1 if a check fails: each saving shrinks its figure (the fused loss's temp by the printed
factor) and the two final losses agree within 1%.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxmem.memory import analyze
from jaxmem.optim import DynamicLossScale, NoOpLossScale, adamw_8bit, all_finite, select_tree
from jaxmem.loss import fused_cross_entropy


class Block(nnx.Module):
    def __init__(self, D: int, N: int, dtype, rngs: nnx.Rngs):
        self.N = N
        self.ln1, self.ln2 = (nnx.LayerNorm(D, dtype=dtype, rngs=rngs) for _ in range(2))
        self.qkv = nnx.Linear(D, 3 * D, dtype=dtype, rngs=rngs)
        self.proj = nnx.Linear(D, D, dtype=dtype, rngs=rngs)
        self.fc = nnx.Linear(D, 4 * D, dtype=dtype, rngs=rngs)
        self.out = nnx.Linear(4 * D, D, dtype=dtype, rngs=rngs)

    def __call__(self, x):  # [B, T, D]
        B, T, D = x.shape
        qkv = self.qkv(self.ln1(x)).reshape(B, T, 3, self.N, D // self.N)  # [B, T, 3, N, H]
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # [B, T, N, H]
        s = jnp.einsum("BTNH,BSNH->BNTS", q, k).astype(jnp.float32) / np.sqrt(D // self.N)
        s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -1e9)  # causal
        p = jax.nn.softmax(s, axis=-1).astype(x.dtype)  # softmax in fp32, [B, N, T, S]
        x = x + self.proj(jnp.einsum("BNTS,BSNH->BTNH", p, v).reshape(B, T, D))
        return x + self.out(jax.nn.gelu(self.fc(self.ln2(x))))  # [B, T, D]


class GPT(nnx.Module):
    def __init__(self, V, T, D, N, L, dtype, rngs: nnx.Rngs):
        self.wte = nnx.Embed(V, D, dtype=dtype, rngs=rngs)
        self.wpe = nnx.Param(0.02 * jax.random.normal(rngs.params(), (T, D)))  # learned
        self.blocks = nnx.List([Block(D, N, dtype, rngs) for _ in range(L)])
        self.ln_f = nnx.LayerNorm(D, dtype=dtype, rngs=rngs)
        self.head = nnx.Param(0.02 * jax.random.normal(rngs.params(), (D, V)))  # untied [D, V]
        self.dtype = dtype

    def __call__(self, ids):  # [B, T] -> final hidden states [B, T, D]
        x = self.wte(ids) + self.wpe[...][: ids.shape[1]].astype(self.dtype)
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)


def make_loss(graphdef, fused: bool, chunk: int):
    def loss_fn(params, batch):
        model = nnx.merge(graphdef, params)
        h = model(batch["inputs"])  # [B, T, D]
        head = model.head[...].astype(h.dtype)  # [D, V]
        if fused:
            return fused_cross_entropy(h, head, batch["targets"], chunk=chunk)
        logits = jnp.einsum("BTD,DV->BTV", h, head).astype(jnp.float32)  # [B, T, V]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
    return loss_fn


def make_step(loss_fn, tx):
    """One step: scaled loss, unscale, skip the update if a gradient is not finite, adjust."""
    def train_step(state, batch):
        params, opt_state, scale = state
        loss, grads = jax.value_and_grad(lambda p: scale.scale(loss_fn(p, batch)))(params)
        grads = scale.unscale(grads)
        finite = all_finite(grads)
        updates, new_opt = tx.update(grads, opt_state, params)
        new = (optax.apply_updates(params, updates), new_opt)
        params, opt_state = select_tree(finite, new, (params, opt_state))
        return (params, opt_state, scale.adjust(finite)), (loss / scale.loss_scale, finite)
    return jax.jit(train_step, donate_argnums=0)


def batches(B: int, T: int, steps: int, used: int = 256, seed: int = 0):
    """Batches over ids < used: the next id follows a fixed random bigram table 90% of the time."""
    rng = np.random.default_rng(seed)
    table, ids = rng.permutation(used), rng.integers(0, used, (steps, B, T + 1))
    for t in range(1, T + 1):
        follow = rng.random((steps, B)) < 0.9
        ids[:, :, t] = np.where(follow, table[ids[:, :, t - 1]], ids[:, :, t])
    return [{"inputs": jnp.asarray(x[:, :-1]), "targets": jnp.asarray(x[:, 1:])} for x in ids]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="gpt_nnx", description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="train steps per optimizer (30)")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps {args.steps}: must be at least 1")
    V, T, D, N, L, B = 8192, 128, 64, 4, 1, 4
    # analysis batch: fp32 logits 4 x B_a x T x V bytes over the fused backward's 256 MiB slice
    B_a, chunk, lr = 256, T // 8, 3e-3

    def create(dtype):
        return nnx.split(GPT(V, T, D, N, L, dtype, nnx.Rngs(0)), nnx.Param)
    graph32, abstract = nnx.eval_shape(lambda: create(jnp.float32))
    graph16, _ = nnx.eval_shape(lambda: create(jnp.float16))
    tok = jax.ShapeDtypeStruct((B_a, T), jnp.int32)
    batch = {"inputs": tok, "targets": tok}
    fp16_scale = lambda: DynamicLossScale.create(2.0**15, growth_interval=10)  # noqa: E731
    fp32 = NoOpLossScale()
    a, stages = [], [("1 baseline: fp32, optax.adamw, full logits", graph32, optax.adamw(lr),
                      False, fp32), ("2 + adamw_8bit", graph32, adamw_8bit(lr), False, fp32),
                     ("3 + fused_cross_entropy", graph32, adamw_8bit(lr), True, fp32),
                     ("4 + fp16 compute, dynamic loss scale", graph16, adamw_8bit(lr), True,
                      fp16_scale())]
    for title, graph, tx, fused, scale in stages:
        loss_fn = make_loss(graph, fused, chunk)
        state = (abstract, jax.eval_shape(tx.init, abstract), scale)
        a.append(analyze(make_step(loss_fn, tx), state, batch, residuals_of=loss_fn,
                         residual_args=(abstract, batch), name=title))
        r, mib = a[-1], lambda n: f"{n / 2**20:7.2f} MiB"  # noqa: E731
        print(f"{title:<42} argument {mib(r.argument_bytes)}  temp {mib(r.temp_bytes)}  "
              f"peak {mib(r.peak_bytes)}  saved for backward {mib(r.residual_bytes)}")
    factor = a[1].temp_bytes / a[2].temp_bytes
    print(f"fused loss: compiled temp {factor:.2f}x smaller than optax over full [B, T, V] logits "
          f"(B={B_a}, T={T}, V={V}, D={D}; {jax.default_backend()} compile)")

    params = jax.jit(lambda: create(jnp.float32)[1])()  # made under jit: no eager init
    data = batches(B, T, args.steps)
    final = {}
    for name, tx in (("adamw_8bit", adamw_8bit(lr)), ("optax.adamw", optax.adamw(lr))):
        step = make_step(make_loss(graph16, True, chunk), tx)
        state = (jax.tree.map(jnp.copy, params), tx.init(params), fp16_scale())
        losses, skipped = [], 0
        for b in data:
            state, (loss, finite) = step(state, b)
            losses, skipped = losses + [float(loss)], skipped + (not bool(finite))
        final[name], first = losses[-1], losses[0]
        print(f"{name:<12} loss {first:.4f} -> {final[name]:.4f} after {args.steps} steps "
              f"(fp16; {skipped} skipped as non-finite; loss scale 2^15 -> "
              f"{float(state[2].loss_scale):g})")
    rel = abs(final["adamw_8bit"] - final["optax.adamw"]) / final["optax.adamw"]
    checks = {
        "adamw_8bit: the step's arguments shrink": a[1].argument_bytes < a[0].argument_bytes,
        f"fused loss: temp {factor:.2f}x smaller": factor > 1,
        "fp16: the backward keeps less": a[3].residual_bytes < a[2].residual_bytes,
        f"adamw_8bit's loss within 1% of optax.adamw's ({rel:.3%})": rel < 0.01,
        "the loss went down": final["optax.adamw"] < first,
    }
    for claim, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {claim}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
