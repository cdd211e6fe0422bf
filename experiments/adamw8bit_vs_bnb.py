"""jaxmem's 8-bit AdamW against bitsandbytes' AdamW8bit and fp32 AdamW, step for step (issue 29.8).

    python -m experiments.adamw8bit_vs_bnb [--steps 300] [--lr 3e-3] [--seeds 1]

Needs torch and bitsandbytes (>= 0.45, its CPU build) beside jaxmem; neither is a jaxmem dependency.
Three small problems of our own (an MLP regression, a tiny embedding + 64-wide LM, a linear model
with a 200-wide last axis), each without and with global-norm clipping (at half the initial
gradient norm, so that it acts on the first steps). The gradients of
every optimizer come from one JAX loss function (bnb's params are fed JAX's gradients), so the
optimizers are the only difference. Prints, per problem x clipping, the final loss of fp32 AdamW
(optax.adamw), jaxmem.optim.adamw_8bit (its default, stochastic rounding of the moments, and
`stochastic_moments=False`: nearest, bitsandbytes' rule) and bnb.optim.AdamW8bit, each 8-bit
one's gap to fp32, and the max |param - fp32 param| of jaxmem's default and bnb over the first
steps. With --seeds N each problem is drawn N times (seeds 0..N-1) and a summary gives the mean
gaps and how often jaxmem's is the smaller (with nearest rounding one seed's gap moves by as
much as jaxmem's and bitsandbytes' differ).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxmem.optim import adamw_8bit

B1, B2, EPS, WD = 0.9, 0.999, 1e-8, 1e-2


def _mlp(key):
    k = jax.random.split(key, 4)
    x = jax.random.normal(k[0], (512, 64))
    w_true = jax.random.normal(k[1], (64, 64)) / 8
    y = jnp.tanh(x @ w_true) + 0.1 * jax.random.normal(k[2], (512, 64))
    kk = jax.random.split(k[3], 2)
    params = {"w1": jax.random.normal(kk[0], (64, 128)) / 8, "b1": jnp.zeros(128),
              "w2": jax.random.normal(kk[1], (128, 64)) / 11, "b2": jnp.zeros(64)}

    def loss(p):
        h = jax.nn.gelu(x @ p["w1"] + p["b1"])
        return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2)
    return params, loss


def _lm(key):
    """Embedding [256, 64] -> two 64x64 mixing layers -> head [64, 256]; next-token loss on a
    fixed random Markov chain's sequences."""
    k = jax.random.split(key, 6)
    vocab, d, n, t = 256, 64, 64, 32
    trans = jax.random.normal(k[0], (vocab, vocab)) * 3
    first = jax.random.randint(k[1], (n,), 0, vocab)

    def walk(tok, kk):
        nxt = jax.random.categorical(kk, trans[tok])
        return nxt, nxt
    _, seq = jax.lax.scan(walk, first, jax.random.split(k[2], t))
    toks = jnp.concatenate([first[None], seq], 0).T  # [n, t + 1]
    params = {"emb": jax.random.normal(k[3], (vocab, d)) * 0.02,
              "w_a": jax.random.normal(k[4], (d, d)) / 8,
              "w_b": jax.random.normal(k[5], (d, d)) / 8,
              "norm": jnp.ones(d), "head": jax.random.normal(k[0], (d, vocab)) / 8}

    def loss(p):
        h = p["emb"][toks[:, :-1]]
        h = h + jax.nn.relu(h @ p["w_a"]) @ p["w_b"]
        h = h * p["norm"] / jnp.sqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6)
        logits = h @ p["head"]
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, toks[:, 1:]))
    return params, loss


def _linear(key):
    k = jax.random.split(key, 3)
    x = jax.random.normal(k[0], (1024, 96))
    y = x @ (jax.random.normal(k[1], (96, 200)) * jnp.logspace(-2, 0, 200)) \
        + 0.05 * jax.random.normal(k[2], (1024, 200))
    params = {"w": jnp.zeros((96, 200))}
    return params, lambda p: jnp.mean((x @ p["w"] - y) ** 2)


PROBLEMS = {"mlp": _mlp, "lm": _lm, "linear": _linear}


def _clip(grads, clip):
    if clip <= 0:
        return grads
    norm = optax.global_norm(grads)
    return jax.tree.map(lambda g: jnp.where(norm < clip, g, g / norm * clip), grads)


def run_optax(tx, params, loss, steps, clip):
    grad_fn = jax.jit(jax.value_and_grad(loss))

    @jax.jit
    def step(p, s):
        _, g = grad_fn(p)
        u, s = tx.update(_clip(g, clip), s, p)
        return optax.apply_updates(p, u), s
    s = tx.init(params)
    traj = [params]
    for _ in range(steps):
        params, s = step(params, s)
        traj.append(params)
    return traj


def run_bnb(params, loss, steps, clip, lr):
    import bitsandbytes as bnb
    import torch
    grad_fn = jax.jit(lambda p: _clip(jax.grad(loss)(p), clip))
    tp = {k: torch.nn.Parameter(torch.from_numpy(np.array(v, np.float32)))
          for k, v in params.items()}
    opt = bnb.optim.AdamW8bit(list(tp.values()), lr=lr, betas=(B1, B2), eps=EPS, weight_decay=WD)
    traj = [params]
    for _ in range(steps):
        g = grad_fn({k: jnp.asarray(v.detach().numpy()) for k, v in tp.items()})
        for k, v in tp.items():
            v.grad = torch.from_numpy(np.array(g[k], np.float32))
        opt.step()
        traj.append({k: jnp.asarray(v.detach().numpy().copy()) for k, v in tp.items()})
    return traj


def _maxdiff(a, b):
    return max(float(jnp.max(jnp.abs(a[k] - b[k]))) for k in a)


def compare(name, clip, steps, lr, first=5, seed=0):
    params, loss = PROBLEMS[name](jax.random.key(seed))
    if clip:  # a fraction of the initial gradient norm
        clip = clip * float(optax.global_norm(jax.grad(loss)(params)))
    ref = run_optax(optax.adamw(lr, B1, B2, EPS, weight_decay=WD), params, loss, steps, clip)
    j8 = run_optax(adamw_8bit(lr, B1, B2, EPS, weight_decay=WD), params, loss, steps, clip)
    near = run_optax(adamw_8bit(lr, B1, B2, EPS, weight_decay=WD, stochastic_moments=False),
                     params, loss, steps, clip)
    b8 = run_bnb(params, loss, steps, clip, lr)
    lf = jax.jit(loss)
    row = {"problem": name, "clip": clip, "seed": seed, "fp32": float(lf(ref[-1])),
           "jaxmem8": float(lf(j8[-1])), "nearest8": float(lf(near[-1])), "bnb8": float(lf(b8[-1])),
           "jaxmem_diff": [_maxdiff(j8[i], ref[i]) for i in range(1, first + 1)],
           "bnb_diff": [_maxdiff(b8[i], ref[i]) for i in range(1, first + 1)],
           "jaxmem_vs_bnb": [_maxdiff(j8[i], b8[i]) for i in range(1, first + 1)]}
    row["gap_jaxmem"] = abs(row["jaxmem8"] - row["fp32"])
    row["gap_bnb"] = abs(row["bnb8"] - row["fp32"])
    row["gap_nearest"] = abs(row["nearest8"] - row["fp32"])
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--problems", default=",".join(PROBLEMS))
    ap.add_argument("--seeds", type=int, default=1, help="draw each problem this many times")
    args = ap.parse_args(argv)
    jax.config.update("jax_default_matmul_precision", "float32")
    rows = [compare(n, c, args.steps, args.lr, seed=s) for n in args.problems.split(",")
            for c in (0.0, 0.5) for s in range(args.seeds)]
    print(f"{args.steps} steps, lr {args.lr}, wd {WD}; gaps are |final loss - fp32 AdamW's|")
    print("jaxmem8: adamw_8bit's default (stochastic moments); nearest: stochastic_moments=False")
    print(f"{'problem':8} {'clip':>6} {'seed':>4} {'fp32':>10} {'jaxmem8':>10} {'nearest':>10} "
          f"{'bnb8':>10} {'gap jaxmem':>11} {'gap nearest':>11} {'gap bnb':>10}  ok")
    for r in rows:
        print(f"{r['problem']:8} {r['clip']:6.3f} {r['seed']:4d} {r['fp32']:10.6f} "
              f"{r['jaxmem8']:10.6f} {r['nearest8']:10.6f} {r['bnb8']:10.6f} "
              f"{r['gap_jaxmem']:11.2e} {r['gap_nearest']:11.2e} {r['gap_bnb']:10.2e}  "
              f"{'yes' if r['gap_jaxmem'] <= r['gap_bnb'] else 'NO '}")
    if args.seeds > 1:
        print(f"\nover {args.seeds} seeds: mean gap, and the seeds where jaxmem's is the smaller")
        for n in args.problems.split(","):
            for c in (False, True):
                rs = [r for r in rows if r["problem"] == n and bool(r["clip"]) == c]
                gj, gn, gb = (np.mean([r[k] for r in rs])
                              for k in ("gap_jaxmem", "gap_nearest", "gap_bnb"))
                wins = sum(r["gap_jaxmem"] <= r["gap_bnb"] for r in rs)
                print(f"{n:8} clip {'yes' if c else 'no ':3}  jaxmem {gj:.3e}  nearest {gn:.3e}  "
                      f"bnb {gb:.3e}  {'yes' if gj <= gb else 'NO '}  {wins}/{len(rs)}")
    print("\nmax |param - fp32 AdamW's param| after steps 1..5 (jaxmem / bnb), and jaxmem vs bnb")
    for r in rows:
        fmt = lambda xs: " ".join(f"{x:.1e}" for x in xs)  # noqa: E731
        print(f"{r['problem']:8} clip {r['clip']:.3f} seed {r['seed']}  jaxmem "
              f"{fmt(r['jaxmem_diff'])}")
        print(f"{'':28} bnb    {fmt(r['bnb_diff'])}")
        print(f"{'':28} j-bnb  {fmt(r['jaxmem_vs_bnb'])}")
    return rows


if __name__ == "__main__":
    main()
