"""`jaxmem.memory.analyze` on your own jitted train step: plain JAX + optax, no jaxmem model.

    python examples/analyze_step.py --tiny --device 24GiB --plot /tmp/step.png

prints XLA's memory plan of the step (argument, output, donated alias, temp, peak: bytes per
device, nothing allocated: the arguments are ShapeDtypeStructs), the values the backward keeps
grouped by name, shape and dtype, and the verdict against a device size; writes the plot when
matplotlib is installed (the `plot` extra), else says it skipped it. Then it checks its own
numbers and exits 1 if one is wrong:
  - the step's arguments are params + AdamW state + batch, counted here from the shapes;
  - the state is donated: alias bytes = params + AdamW state;
  - each block keeps its [B, T, F] GELU input (named 'mlp_in') for the backward, once per block;
    with `jax.checkpoint` on the blocks the backward keeps less.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import jax
import jax.numpy as jnp
import optax
from jax.ad_checkpoint import checkpoint_name

from jaxmem.memory import analyze

F32 = jnp.float32


def init_shapes(V: int, D: int, F: int, L: int) -> dict:
    """The model's params as ShapeDtypeStructs (what jax.eval_shape(init) would give)."""
    s = lambda *shape: jax.ShapeDtypeStruct(shape, F32)  # noqa: E731
    return {"embed": s(V, D), "head": s(D, V),
            "blocks": [{"w_in": s(D, F), "w_out": s(F, D)} for _ in range(L)]}


def make_loss(remat: bool):
    def block(h, p):
        u = checkpoint_name(h @ p["w_in"], "mlp_in")  # [B, T, F]
        return h + jax.nn.gelu(u) @ p["w_out"]  # [B, T, D]

    block = jax.checkpoint(block) if remat else block

    def loss_fn(params, batch):
        h = params["embed"][batch["inputs"]]  # [B, T, D]
        for p in params["blocks"]:
            h = block(h, p)
        logits = h @ params["head"]  # [B, T, V]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
    return loss_fn


def make_step(loss_fn, tx):
    def train_step(state, batch):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss
    return jax.jit(train_step, donate_argnums=0)  # the state is updated in place


def nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="analyze_step", description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="CI size (compiles in seconds on a CPU)")
    ap.add_argument("--device", default="80GiB", help="device size for the verdict (80GiB)")
    ap.add_argument("--plot", default=None, help="write the memory plot here (.png/.svg/.pdf)")
    args = ap.parse_args(argv)
    if not re.fullmatch(r"\s*[0-9]*\.?[0-9]+\s*([KMGT]i?B|B)?\s*", args.device, re.I):
        ap.error(f"--device {args.device!r}: expected a size such as 80GiB or 40GB")
    if args.plot and not os.path.isdir(os.path.dirname(os.path.abspath(args.plot))):
        ap.error(f"--plot {args.plot}: directory {os.path.dirname(args.plot)} does not exist")
    B, T, V, D, F, L = (2, 32, 512, 64, 256, 2) if args.tiny else (8, 512, 32768, 1024, 4096, 8)

    params = init_shapes(V, D, F, L)
    tx = optax.adamw(1e-3)
    opt_state = jax.eval_shape(tx.init, params)
    tokens = jax.ShapeDtypeStruct((B, T), jnp.int32)
    batch = {"inputs": tokens, "targets": tokens}
    loss_fn = make_loss(remat=False)
    a = analyze(make_step(loss_fn, tx), (params, opt_state), batch,
                residuals_of=loss_fn, residual_args=(params, batch))
    print(a.report())
    print(a.verdict(args.device))
    if args.plot:
        try:
            print("plot:", a.plot(args.plot))
        except ImportError as e:
            print(f"plot skipped: {e}")

    remat_loss = make_loss(remat=True)
    r = analyze(make_step(remat_loss, tx), (params, opt_state), batch,
                residuals_of=remat_loss, residual_args=(params, batch))
    print(f"\nwith jax.checkpoint on each block: saved for the backward "
          f"{a.residual_bytes:,} -> {r.residual_bytes:,} bytes, temp {a.temp_bytes:,} -> "
          f"{r.temp_bytes:,} bytes")

    state_bytes = nbytes((params, opt_state))
    named = [x for x in a.residuals if x.name == "named 'mlp_in'"]
    checks = {
        "arguments = params + AdamW state + batch": a.argument_bytes == state_bytes + nbytes(batch),
        "donated: alias = params + AdamW state": a.alias_bytes == state_bytes,
        f"'mlp_in' [{B}, {T}, {F}] kept once per block ({L})":
            [(x.shape, x.count) for x in named] == [((B, T, F), L)],
        "jax.checkpoint keeps less for the backward": r.residual_bytes < a.residual_bytes,
    }
    for claim, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {claim}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
