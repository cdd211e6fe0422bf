"""jaxmem vs the PyTorch recipe (eager and torch.compile): same model, weights, batches, optimizer.

    python -m experiments.compare --quick                      # CPU, a few minutes
    python -m experiments.compare --preset llama-3.2-1b --seq-len 2048 --batch-size 4 \\
        --steps 20 --modes amp-bf16 bf16 --remats none full selective    # GPU (H100/H200)

For every precision mode x remat policy, each framework runs in its OWN subprocess (a process's
peak-memory counters never go down), starting from the same weights (jaxmem's init, converted to
a torch state_dict with experiments/convert.py) and the same batches (numpy, fixed seed; no
padding, so both sides run causal-only attention). Per run it reports:

    saved_bytes   bytes kept for the backward pass by one forward + loss, parameters and their
                  compute-dtype copies EXCLUDED on both sides (the same count):
                    jax:   jax's saved_residuals of the loss as a function of the params already
                           cast to the compute dtype, minus the residuals that are those params
                    torch: saved_tensors_hooks over the forward (experiments.torch_train.
                           saved_bytes_for_backward, exclude_param_copies=True, which drops the
                           parameters and autocast's cached weight copies), plus what a selective
                           checkpoint policy keeps in its own cache
                  Inputs such as token ids and targets count on both sides when they are saved.
    peak_est      jax only: XLA's compiled estimate for the whole donated train step
                  (memory_analysis: temp + arguments + outputs - aliased)
    peak_bytes    measured peak on GPU: jax `peak_bytes_in_use`, torch `max_memory_allocated`
                  (on CPU neither framework has a peak allocator stat: null)
    step_ms, tok/s  median over the steps after `--warmup` (jax: block_until_ready)
    loss          the loss of the last step (the same step and batch on both sides)
    mfu           GPU, bf16/fp16 modes: (6 N + 12 L D T) tokens/s / the device's dense peak

Remat policies, by name: `none`, `full` (keep only each block's input), and `selective`:
jaxmem `names:query,key,value,attn_context,mlp_gate,mlp_up` / torch per-layer checkpoint whose
policy keeps the matmul and attention outputs (experiments.torch_train.SelectiveCheckpoint).
Why that jaxmem policy: on the tiny preset at B=4, T=256 (fp32, CPU) it keeps 22.9 MiB for
backward at 1.965 GFLOP per step, vs 57.1 MiB / 1.926 (none), 4.9 MiB / 2.300 (full, +19%),
24.9 / 1.932 (dots), 22.9 / 2.000 (dots_no_batch): the bytes of dots_no_batch for half of its
recompute (it keeps q/k after RoPE, so RoPE is not recomputed); docs/results.md. (XLA attention
recomputes its T x T probabilities in the backward under every policy, docs/remat.md.) Any jaxmem
policy string can be given instead (`--remats none "names:query,key"`); torch then runs
`selective`.

`--json` prints only the JSON document; results go to experiments/results/compare-*.json and
a bar chart (pure-python PNG) next to it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"
MODES = ("fp32", "bf16", "amp-bf16", "amp-fp16")
SELECTIVE = "names:query,key,value,attn_context,mlp_gate,mlp_up"
FRAMEWORKS = ("jax", "torch", "torch-compile")
# Dense bf16 peak FLOP/s (no sparsity) by device-name substring, for MFU.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L4": 121e12, "A10": 125e12}


# ---------------------------------------------------------------- shared


def model_config(spec: dict):
    from jaxmem.config.model import get_preset
    return get_preset(spec["preset"], num_layers=spec.get("num_layers"))


def make_batches(config, n: int, batch_size: int, seq_len: int, seed: int) -> list[dict]:
    """n random int32 batches {inputs, targets} [B, T], identical in every process."""
    import numpy as np
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        tok = rng.integers(0, config.vocab_size, (batch_size, seq_len + 1), dtype=np.int32)
        out.append({"inputs": tok[:, :-1], "targets": tok[:, 1:]})
    return out


def optim_config(spec: dict):
    from jaxmem.train.optim import OptimConfig
    return OptimConfig(lr=spec["lr"], min_lr=spec["lr"] / 10, warmup_steps=spec["lr_warmup"],
                       total_steps=max(spec["steps"], 2), weight_decay=0.1, clip=1.0)


def flops_per_token(config, seq_len: int) -> float:
    """PaLM's training FLOPs per token: 6 x (matmul params, head included) + 12 L D T."""
    c = config
    n = c.num_params() - c.vocab_size * c.hidden_size * (0 if c.tie_embeddings else 1)
    return 6 * n + 12 * c.num_layers * c.hidden_size * seq_len


def jax_params(spec: dict):
    """jaxmem's init for the spec (storage dtype of the mode): the weights both sides start from."""
    import jax
    from jaxmem.train.loss_scale import parse_loss_scale
    from jaxmem.train.precision import get_precision
    from jaxmem.model.remat import RematPolicy
    from jaxmem.train.step import StepConfig, create_train_state
    remat = spec["remat"] if spec["framework"] == "jax" else "none"
    cfg = StepConfig(model_config(spec), get_precision(spec["mode"]), RematPolicy.parse(remat),
                     optim_config(spec))
    state = create_train_state(cfg, parse_loss_scale(cfg.precision.loss_scale), seed=spec["seed"])
    return cfg, state


def initial_params(spec: dict):
    """The params `jax_params` starts from, without building an optimizer state (the torch
    process only needs the weights): the same key split as jaxmem.train.step.create_train_state."""
    import jax
    from jaxmem.model.llama import init_params
    from jaxmem.train.precision import cast_floating, get_precision
    init_key, _ = jax.random.split(jax.random.PRNGKey(spec["seed"]))
    return cast_floating(init_params(model_config(spec), init_key),
                         get_precision(spec["mode"]).param_dtype)


def _median_after(times: list[float], warmup: int) -> float:
    rest = times[warmup:] or times[-1:]
    return statistics.median(rest)


# ---------------------------------------------------------------- jax


def _saved_residuals():
    """jax's saved_residuals(f, *args) -> [(aval, description)], wherever this jax keeps it."""
    import importlib
    for mod in ("jax.ad_checkpoint", "jax._src.ad_checkpoint"):
        try:
            return getattr(importlib.import_module(mod), "saved_residuals")
        except (ImportError, AttributeError):
            continue
    return None


def jax_saved_bytes(model, abstract_compute_params, batch) -> tuple[int, int]:
    """(bytes, count) of the residuals of the loss w.r.t. the compute-dtype params, params excluded."""
    import numpy as np
    from jaxmem.train.loss import cross_entropy

    def loss_of(params, batch):
        logits = model.apply({"params": params}, batch["inputs"])  # causal only, as the step
        total, count = cross_entropy(logits, batch["targets"], np.ones(batch["targets"].shape))
        return total / count

    fn = _saved_residuals()
    if fn is None:  # pragma: no cover - future jax without it
        raise RuntimeError("this jax has no saved_residuals (jax.ad_checkpoint)")
    res = fn(loss_of, abstract_compute_params, batch)
    kept = [(a, d) for a, d in res if not d.startswith("from the argument params")]
    if len(kept) == len(res):  # the weights are always among the residuals: the format changed
        raise RuntimeError("saved_residuals descriptions no longer name 'the argument params': "
                           + "; ".join(d for _, d in res[:3]))
    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a, _ in kept), len(kept)


def run_jax(spec: dict) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jaxmem.memory.report import compiled_stats
    from jaxmem.train.precision import cast_params
    from jaxmem.train.step import jit_train_step

    cfg, state = jax_params(spec)
    c, B, T = cfg.model, spec["batch_size"], spec["seq_len"]
    compute = jax.eval_shape(lambda p: cast_params(p, cfg.precision.compute_dtype), state.params)
    batches = make_batches(c, spec["n_batches"], B, T, spec["seed"] + 1)
    try:  # a jax without saved_residuals (or with new descriptions) still gets timed
        saved, n_res, saved_error = *jax_saved_bytes(cfg.build_model(), compute, batches[0]), None
    except Exception as e:  # noqa: BLE001 - reported in the JSON, not hidden
        saved, n_res, saved_error = None, None, f"{type(e).__name__}: {e}"[:300]

    def step_batch(b):  # [1, B, T]: one micro-batch
        return {"inputs": jnp.asarray(b["inputs"][None]), "targets": jnp.asarray(b["targets"][None]),
                "mask": jnp.ones((1, B, T), jnp.int32)}

    jb = [step_batch(b) for b in batches]
    t0 = time.perf_counter()
    compiled = jit_train_step(cfg).lower(state, jb[0]).compile()
    compile_s = time.perf_counter() - t0
    stats, flops = compiled_stats(compiled)
    times, losses, skipped = [], [], []
    for i in range(spec["steps"]):
        t0 = time.perf_counter()
        state, m = compiled(state, jb[i % len(jb)])
        jax.block_until_ready((state, m))
        times.append(time.perf_counter() - t0)
        losses.append(float(m["loss"]))
        skipped.append(bool(m["skipped"]))
    dev = jax.devices()[0]
    mem = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    return {"saved_bytes": saved, "saved_residuals": n_res, "saved_error": saved_error,
            "peak_est_bytes": stats["peak_bytes"],
            "temp_bytes": stats["temp_bytes"], "xla_flops_per_step": flops,
            "peak_bytes": (mem or {}).get("peak_bytes_in_use"), "compile_s": compile_s,
            "step_times": times, "losses": losses, "skipped": skipped,
            "device": f"{dev.platform}:{getattr(dev, 'device_kind', '')}",
            "remat_detail": str(cfg.remat)}


# ---------------------------------------------------------------- torch


def torch_remat(remat: str) -> str:
    return remat if remat in ("none", "full") else "selective"


def run_torch(spec: dict, compiled: bool) -> dict:
    import jax
    import numpy as np
    import torch
    from experiments import torch_train as tt
    from experiments.convert import jax_to_torch_state_dict

    c, B, T = model_config(spec), spec["batch_size"], spec["seq_len"]
    params = initial_params(spec)  # on the CPU (JAX_PLATFORMS=cpu in this process)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    model = tt.build_model(c, spec["mode"], device="cpu")
    model.load_state_dict(jax_to_torch_state_dict(jax.tree_util.tree_map(np.asarray, params), c),
                          strict=True)
    del params
    model.to(device)
    tt.set_remat(model, torch_remat(spec["remat"]))
    batches = [{k: torch.from_numpy(v).long().to(device) for k, v in b.items()}  # no mask: causal
               for b in make_batches(c, spec["n_batches"], B, T, spec["seed"] + 1)]
    if compiled:
        model.compile()  # in place: state_dict names and the recipe are unchanged
    # torch.compile: AOTAutograd's compiled forward saves its tensors through the same hooks, so
    # this counts what the compiled graph keeps (its partitioner recomputes cheap ops).
    saved = tt.saved_bytes_for_backward(model, batches[0], spec["mode"], exclude_param_copies=True,
                                        count_selective=not compiled)
    o = optim_config(spec)
    recipe = tt.make_recipe(model, spec["mode"], o.total_steps, o.lr, o.warmup_steps, o.min_lr,
                            o.weight_decay, o.clip)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, losses, skipped = [], [], []
    for i in range(spec["steps"]):
        t0 = time.perf_counter()
        r = recipe.step(batches[i % len(batches)])  # float(loss) inside: synchronizes
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(r["loss"])
        skipped.append(r["skipped"])
    return {"saved_bytes": saved, "peak_est_bytes": None,
            "peak_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None,
            "compile_s": times[0] if compiled else None,
            "step_times": times, "losses": losses, "skipped": skipped,
            "device": device if device == "cpu" else f"cuda:{torch.cuda.get_device_name()}",
            "remat_detail": torch_remat(spec["remat"])}


# ---------------------------------------------------------------- one process per configuration


def worker(spec: dict) -> dict:
    if spec["framework"] == "jax":
        out = run_jax(spec)
    else:
        out = run_torch(spec, compiled=spec["framework"] == "torch-compile")
    tokens = spec["batch_size"] * spec["seq_len"]
    step_s = _median_after(out["step_times"], spec["warmup"])
    out.update(spec=spec, step_ms=1e3 * step_s, tokens_per_s=tokens / step_s,
               loss=out["losses"][-1])
    return out


def run_in_subprocess(spec: dict, timeout: float) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if spec["framework"] != "jax":
        env["JAX_PLATFORMS"] = "cpu"  # jax only builds the weights there: keep it off the GPU
    if spec.get("threads") == 1:  # CPU: one compute thread for XLA and torch alike
        env["OMP_NUM_THREADS"] = "1"
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()
    cmd = [sys.executable, "-m", "experiments.compare", "--worker", json.dumps(spec)]
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"spec": spec, "error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        err = (p.stderr or p.stdout).strip().splitlines()
        # the exception line ("torch._dynamo.exc.Unsupported: ...") says more than the tail
        exc = [ln for ln in err if ln[:1].isalpha() and ("Error" in ln.split(":")[0]
                                                         or "exc." in ln.split(":")[0])]
        msg = " | ".join(exc[-2:] + err[-3:])
        return {"spec": spec, "error": f"exit {p.returncode}: {msg}"[:1200]}
    return json.loads(lines[-1])


# ---------------------------------------------------------------- report


def versions() -> dict:
    import importlib.metadata as md
    v = {"python": platform.python_version()}
    for name in ("jax", "jaxlib", "flax", "optax", "torch", "numpy"):
        try:
            v[name] = md.version(name)
        except md.PackageNotFoundError:
            v[name] = None
    return v


def _ratio(a, b):
    return None if a is None or b in (None, 0) else a / b


def add_ratios(results: list[dict]) -> list[dict]:
    """One row per (mode, remat): jax vs torch eager and torch.compile, with the target ratios."""
    by = {(r["spec"]["framework"], r["spec"]["mode"], r["spec"]["remat"]): r
          for r in sorted(results, key=_order)}
    rows = []
    for (fw, mode, remat), j in by.items():
        if fw != "jax":
            continue
        t, tc = by.get(("torch", mode, remat), {}), by.get(("torch-compile", mode, remat), {})
        rows.append({
            "mode": mode, "remat": remat,
            "saved_ratio": _ratio(j.get("saved_bytes"), t.get("saved_bytes")),  # target <= 1
            "tps_ratio_eager": _ratio(j.get("tokens_per_s"), t.get("tokens_per_s")),  # >= 1
            "tps_ratio_compile": _ratio(j.get("tokens_per_s"), tc.get("tokens_per_s")),  # >= 1
            "peak_ratio_compile": _ratio(j.get("peak_bytes"), tc.get("peak_bytes")),  # <= 1
            "loss_diff": (None if j.get("loss") is None or t.get("loss") is None
                          else j["loss"] - t["loss"]),
        })
    return rows


def remat_label(remat: str) -> str:
    return "selective" if remat == SELECTIVE else remat


def _order(r: dict):
    s = r["spec"]
    remats = ["none", "full", SELECTIVE]
    return (MODES.index(s["mode"]), remats.index(s["remat"]) if s["remat"] in remats else 9,
            s["remat"], FRAMEWORKS.index(s["framework"]))


def _mib(x):
    return "-" if x is None else f"{x / 2**20:.2f}"


def _f(x, fmt):
    return "-" if x is None else format(x, fmt)


def format_table(results: list[dict], rows: list[dict], markdown: bool = False) -> str:
    head = ["mode", "remat", "framework", "saved MiB", "peak est MiB", "peak MiB", "step ms",
            "tok/s", "loss", "MFU"]
    lines = []
    for r in sorted(results, key=_order):
        s = r["spec"]
        if "error" in r:
            lines.append([s["mode"], remat_label(s["remat"]), s["framework"], "error (see JSON)",
                          "", "", "", "", "", ""])
            continue
        lines.append([s["mode"], remat_label(s["remat"]), s["framework"], _mib(r["saved_bytes"]),
                      _mib(r.get("peak_est_bytes")), _mib(r.get("peak_bytes")),
                      _f(r["step_ms"], ".1f"), _f(r["tokens_per_s"], ",.0f"), _f(r["loss"], ".4f"),
                      _f(r.get("mfu"), ".1%")])
    ratio_head = ["mode", "remat", "saved jax/torch (<=1)", "tok/s jax/eager (>=1)",
                  "tok/s jax/compile (>=1)", "peak jax/compile (<=1)", "loss jax-torch"]
    ratio_lines = [[r["mode"], remat_label(r["remat"]), _f(r["saved_ratio"], ".3f"),
                    _f(r["tps_ratio_eager"], ".3f"), _f(r["tps_ratio_compile"], ".3f"),
                    _f(r["peak_ratio_compile"], ".3f"), _f(r["loss_diff"], "+.2e")] for r in rows]

    def render(h, ls):
        if markdown:
            out = ["| " + " | ".join(h) + " |", "|" + "---|" * len(h)]
            return "\n".join(out + ["| " + " | ".join(map(str, x)) + " |" for x in ls])
        w = [max(len(str(x[i])) for x in [h] + ls) for i in range(len(h))]
        fmt = lambda x: "  ".join(str(v).rjust(w[i]) for i, v in enumerate(x))  # noqa: E731
        return "\n".join([fmt(h), fmt(["-" * n for n in w])] + [fmt(x) for x in ls])

    return render(head, lines) + "\n\n" + render(ratio_head, ratio_lines)


def png_bar_chart(path: Path, groups: list[tuple[str, list[float | None]]], colors) -> None:
    """A dependency-free PNG: one cluster of bars per group (value / max of its panel).

    Two panels stacked: groups[i][1] holds [saved_jax, saved_torch, tps_jax, tps_torch,
    tps_compile]; the top panel draws the saved bytes, the bottom the tokens/s.
    """
    W, H, pad, panel_h = max(200, 8 + 44 * len(groups)), 260, 8, 120
    img = [[(255, 255, 255)] * W for _ in range(H)]

    def rect(x0, y0, x1, y1, c):
        for y in range(max(y0, 0), min(y1, H)):
            row = img[y]
            for x in range(max(x0, 0), min(x1, W)):
                row[x] = c

    for panel, idx in ((0, (0, 1)), (1, (2, 3, 4))):
        top = panel * (panel_h + 10) + 5
        vals = [g[1][i] for g in groups for i in idx if g[1][i] is not None]
        vmax = max(vals) if vals else 1.0
        rect(0, top + panel_h, W, top + panel_h + 1, (0, 0, 0))
        for gi, (_, v) in enumerate(groups):
            for k, i in enumerate(idx):
                if v[i] is None:
                    continue
                h = int(round((panel_h - 2) * v[i] / vmax))
                x0 = pad + gi * 44 + k * 12
                rect(x0, top + panel_h - h, x0 + 10, top + panel_h, colors[i])
    raw = b"".join(b"\x00" + bytes(c for px in row for c in px) for row in img)

    def chunk(kind, data):
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", W, H, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))
    path.write_bytes(png)


CHART_COLORS = [(31, 119, 180), (214, 39, 40), (31, 119, 180), (214, 39, 40), (255, 127, 14)]


def write_chart(path: Path, results: list[dict]) -> None:
    by = {(r["spec"]["framework"], r["spec"]["mode"], r["spec"]["remat"]): r
          for r in sorted(results, key=_order) if "error" not in r}
    groups = []
    for fw, mode, remat in by:
        if fw != "jax":
            continue
        get = lambda f, k: by.get((f, mode, remat), {}).get(k)  # noqa: E731
        groups.append((f"{mode}/{remat}", [get("jax", "saved_bytes"), get("torch", "saved_bytes"),
                                           get("jax", "tokens_per_s"), get("torch", "tokens_per_s"),
                                           get("torch-compile", "tokens_per_s")]))
    png_bar_chart(path, groups, CHART_COLORS)


# ---------------------------------------------------------------- CLI


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 2)[1])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--num-layers", type=int, default=None, help="override the preset's layers")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=12, help="train steps per run (loss after these)")
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the median time")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--remats", nargs="+", default=["none", "full", "selective"],
                   help="none, full, selective (= %s) or any jaxmem policy" % SELECTIVE)
    p.add_argument("--frameworks", nargs="+", default=list(FRAMEWORKS), choices=FRAMEWORKS)
    p.add_argument("--compile-modes", nargs="+", default=None,
                   help="modes that also run torch.compile (default: all)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU compute threads per process (1: XLA without its Eigen pool, "
                        "torch.set_num_threads(1)); default: each framework's own")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900, help="seconds per subprocess")
    p.add_argument("--quick", action="store_true",
                   help="CPU smoke: tiny preset, 2 layers, B=2, T=64, 8 steps, 1 thread, "
                        "torch.compile only for fp32 (a few minutes on 2 cores)")
    p.add_argument("--json", action="store_true", help="print only the JSON document")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default: results dir)")
    p.add_argument("--no-save", action="store_true", help="write no files")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.preset, args.num_layers, args.batch_size, args.seq_len = "tiny", 2, 2, 64
        args.steps, args.warmup = 8, 2
        # One thread each: on a 2-core machine shared with other jobs, torch's 2 OpenMP threads
        # made steps 10-100x slower and erratic (measured 15 ms -> 0.2-2 s per step).
        args.threads = args.threads or 1
        if args.compile_modes is None:
            args.compile_modes = ["fp32"]
    return args


def specs_from_args(args) -> list[dict]:
    remats = [SELECTIVE if r == "selective" else r for r in args.remats]
    base = {"preset": args.preset, "num_layers": args.num_layers, "batch_size": args.batch_size,
            "seq_len": args.seq_len, "steps": args.steps, "warmup": args.warmup, "lr": args.lr,
            "lr_warmup": 0, "seed": args.seed, "n_batches": 4, "threads": args.threads}
    out = []
    for mode in args.modes:
        for remat in remats:
            for fw in args.frameworks:
                if fw == "torch-compile" and args.compile_modes and mode not in args.compile_modes:
                    continue
                out.append({**base, "framework": fw, "mode": mode, "remat": remat})
    return out


def add_mfu(results: list[dict]) -> None:
    for r in results:
        if "error" in r:
            continue
        s, dev = r["spec"], r.get("device", "")
        peak = next((v for k, v in PEAK_FLOPS.items() if k in dev), None)
        r["mfu"] = None
        if peak and s["mode"] != "fp32":  # bf16/fp16 peak; fp32 runs are not MFU runs
            r["mfu"] = flops_per_token(model_config(s), s["seq_len"]) * r["tokens_per_s"] / peak


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    specs = specs_from_args(args)
    results = []
    for spec in specs:
        r = run_in_subprocess(spec, args.timeout)
        results.append(r)
        if not args.json:
            msg = r.get("error") or (f"saved {_mib(r.get('saved_bytes'))} MiB, "
                                     f"{r['tokens_per_s']:,.0f} tok/s, loss {r['loss']:.4f}")
            print(f"[{spec['framework']:>13s} {spec['mode']:>8s} {remat_label(spec['remat']):>9s}] "
                  f"{msg}",
                  file=sys.stderr, flush=True)
    add_mfu(results)
    rows = add_ratios(results)
    dev = next((r["device"] for r in results if r.get("spec", {}).get("framework") == "jax"
                and "device" in r), None)
    doc = {"date": datetime.date.today().isoformat(), "device": dev,
           "host": f"{platform.machine()} {os.cpu_count()} cores", "versions": versions(),
           "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                    if k != "worker"},
           "selective_policy": {"jax": SELECTIVE, "torch": "SelectiveCheckpoint (mm + attention)"},
           "results": results, "ratios": rows}
    if not args.no_save:
        RESULTS.mkdir(parents=True, exist_ok=True)
        stem = f"compare-{'quick' if args.quick else args.preset}-{(dev or 'x').split(':')[0]}"
        out = args.out or RESULTS / f"{stem}.json"
        out.write_text(json.dumps(doc, indent=1) + "\n")
        write_chart(out.with_suffix(".png"), results)
        doc["written"] = [str(out), str(out.with_suffix(".png"))]
    if args.json:
        print(json.dumps(doc))
    else:
        print(f"date {doc['date']}  device {dev}  host {doc['host']}  versions {doc['versions']}")
        print(format_table(results, rows))
        for w in doc.get("written", []):
            print("wrote", w)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
