"""Long context on a CPU: packed rows split over 4 simulated devices, save, stop, resume.

    python examples/long_context.py                           # 16,384-token rows: ~30 s on 2 cores
    python examples/long_context.py --seq-len 65536           # the full size: ~11 minutes on 2 cores
    python examples/long_context.py --seq-len 1024 --out DIR  # the CI size (tests/test_examples.py)

It writes packed data of its own (short synthetic documents, one per line of a .jsonl), then runs
`python -m jaxmem.train` three times, in this process, with these flags:

    --data DIR/docs.jsonl --seq-len T --max-position-embeddings T --mesh context=4
    --num-layers 1 --hidden-size 32 --intermediate-size 64 --num-heads 1 --num-kv-heads 1
    --batch-size 1 --steps 2 --warmup-steps 1 --eval-batches 1 --sample-tokens 0
      --out DIR/straight                          2 steps in one go
      --out DIR/split --stop-at 1                 stopped after step 1 (saved), then
      --out DIR/split --resume --mesh context=4   continued to step 2

and checks that the stopped-and-resumed run equals the uninterrupted one bitwise: every step's
loss and gradient norm in metrics.jsonl, and every parameter of the saved step 2. Each row holds
many documents (segment ids, RoPE positions restarting per document); the sequence is split over
the `context` axis (jaxmem.model.context, docs/long-context.md). Exits 1 when a check fails.

The model is as small as the flags allow (one layer, one head of 32), because attention is T^2
work: at T=65,536 a step takes minutes on 2 CPU cores, so the default is 16,384 (16x less
attention work) and the full size is `--seq-len 65536` (README, "Long context").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

DEVICES = 4
# a CPU demonstration: 4 simulated CPU devices, set before JAX starts (on a GPU machine too)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + f" --xla_force_host_platform_device_count={DEVICES}").strip()

MODEL = ["--num-layers", "1", "--hidden-size", "32", "--intermediate-size", "64",
         "--num-heads", "1", "--num-kv-heads", "1"]
STEPS = 2
DEFAULT_SEQ = 16384  # ~30 s on 2 CPU cores; --seq-len 65536 is the full size (~11 minutes)


def write_documents(path: Path, tokens: int, seed: int = 0) -> int:
    """A .jsonl of short text documents (about 10 to 200 bytes, so byte tokens) about `tokens`
    long in all; returns how many."""
    import numpy as np

    rng = np.random.default_rng(seed)
    words = ("context rows split over devices each document restarts its positions the loss "
             "counts trained tokens packed segments attend within themselves").split()
    lines, total = [], 0
    while total < tokens:
        text = " ".join(rng.choice(words, int(rng.integers(2, 25))))
        lines.append(json.dumps({"text": text}))
        total += len(text) + 2  # its bytes, BOS and EOS
    path.write_text("\n".join(lines) + "\n")
    return len(lines)


def train_flags(data: Path, seq_len: int) -> list[str]:
    return ["--data", str(data), "--seq-len", str(seq_len), "--max-position-embeddings",
            str(seq_len), "--mesh", f"context={DEVICES}", *MODEL, "--batch-size", "1",
            "--steps", str(STEPS), "--warmup-steps", "1", "--eval-batches", "1",
            "--sample-tokens", "0", "--no-progress", "--log-every", "1"]


def records(run: Path) -> list[tuple]:
    return [(r["step"], r["loss"], r["grad_norm"]) for r in
            map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]


def saved_params(run: Path):
    import jax
    import numpy as np

    from jaxmem.train.rundir import load_run

    state = load_run(run).state
    return int(state.step), [np.asarray(x) for x in jax.tree_util.tree_leaves(state.params)]


def check(name: str, ok: bool, failures: list) -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name}", flush=True)
    if not ok:
        failures.append(name)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="long_context", description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=DEFAULT_SEQ,
                   help=f"tokens per row, a multiple of {2 * DEVICES} (default {DEFAULT_SEQ}; "
                        "65536 is the full-size run: ~11 minutes on 2 CPU cores)")
    p.add_argument("--out", default="runs/long-context", help="directory for the data and runs")
    args = p.parse_args(argv)
    if args.seq_len < 256 or args.seq_len % (2 * DEVICES):
        p.error(f"--seq-len {args.seq_len}: expected a multiple of {2 * DEVICES}, at least 256")
    out = Path(args.out)
    if (out / "straight").exists() or (out / "split").exists():
        p.error(f"--out {out} already holds runs of this example; choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    from jaxmem.train.cli import main as train

    # documents for STEPS rows and the eval split (10% of the documents), with room to spare
    docs = write_documents(out / "docs.jsonl", tokens=int(1.3 * (STEPS + 1) * args.seq_len))
    flags = train_flags(out / "docs.jsonl", args.seq_len)
    print(f"{docs} documents in {out / 'docs.jsonl'}; python -m jaxmem.train {' '.join(flags)}",
          flush=True)
    t0 = time.perf_counter()
    runs = [[*flags, "--out", str(out / "straight")],
            [*flags, "--out", str(out / "split"), "--stop-at", str(STEPS - 1)],
            # a resumed run takes the default mesh of its devices unless --mesh is given again
            ["--out", str(out / "split"), "--resume", "--mesh", f"context={DEVICES}"]]
    for argv_ in runs:
        if train(argv_) != 0:
            print(f"FAIL python -m jaxmem.train {' '.join(argv_)}", file=sys.stderr)
            return 1
    wall = time.perf_counter() - t0
    failures: list[str] = []
    straight, split = records(out / "straight"), records(out / "split")
    check(f"steps 1..{STEPS}: losses and gradient norms of the resumed run equal the "
          f"uninterrupted one bitwise", straight == split and len(straight) == STEPS, failures)
    (s1, p1), (s2, p2) = saved_params(out / "straight"), saved_params(out / "split")
    check(f"the saved params at step {STEPS} are bitwise equal",
          s1 == s2 == STEPS and all(a.dtype == b.dtype and (a == b).all() for a, b in zip(p1, p2)),
          failures)
    stats = json.loads((out / "straight" / "config.json").read_text())["data_stats"]
    check(f"rows hold many documents ({stats['train_examples']} documents in "
          f"{stats['train_rows']} rows of {args.seq_len} tokens)",
          stats["train_examples"] >= 5 * stats["train_rows"], failures)
    print(f"3 runs, {2 * STEPS} steps at {args.seq_len} tokens on {DEVICES} CPU devices "
          f"(context={DEVICES}): {wall:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
