"""What one process of experiments.compare runs: a spec dict in, one framework's numbers out.

A spec names the preset, shape, precision mode, remat policy and framework of one run; the
driver (experiments.compare) starts one process per spec, because a process's peak-memory
counters never go down. Both frameworks start from jaxmem's init for the spec's seed and see the
same numpy batches, so the losses of the same step can be compared.

Heavy imports (jax, torch) happen inside the functions: the driver imports this module for the
names below without loading either framework.
"""

from __future__ import annotations

import statistics
import time

MODES = ("fp32", "bf16", "amp-bf16", "amp-fp16")
SELECTIVE = "names:query,key,value,attn_context,mlp_gate,mlp_up"
FRAMEWORKS = ("jax", "torch", "torch-compile")


def run_config(spec: dict):
    """The jaxmem RunConfig of one run: the driver puts it in the spec (`config`), so jaxmem's
    side is built exactly as `jaxmem.train` builds a run (jaxmem.train.run.build_step_config)."""
    from jaxmem.config.run import RunConfig
    return RunConfig.from_dict(spec["config"])


def model_config(spec: dict):
    if "config" not in spec:  # a results file written before specs carried their RunConfig
        from jaxmem.families import get_preset
        return get_preset(spec["preset"], num_layers=spec.get("num_layers"))
    return run_config(spec).model_config()


def make_batches(config, n: int, batch_size: int, seq_len: int, seed: int) -> list[dict]:
    """n random int32 batches {inputs, targets} [B, T], identical in every process."""
    import numpy as np
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        tok = rng.integers(0, config.vocab_size, (batch_size, seq_len + 1), dtype=np.int32)
        out.append({"inputs": tok[:, :-1], "targets": tok[:, 1:]})
    return out


def jax_params(spec: dict):
    """jaxmem's init for the spec (storage dtype of the mode): the weights both sides start from."""
    from jaxmem.train.run import build_step_config
    from jaxmem.train.step import create_train_state
    cfg = run_config(spec)
    if spec["framework"] != "jax":  # the torch side only needs the weights, never a remat'd step
        cfg = cfg.replace({"remat.policy": "none"})
    _, step_cfg, loss_scale = build_step_config(cfg)
    return step_cfg, create_train_state(step_cfg, loss_scale, seed=cfg.data.seed)


def initial_params(spec: dict):
    """The params `jax_params` starts from, without building an optimizer state (the torch
    process only needs the weights): the same key split as jaxmem.train.step.create_train_state."""
    import jax
    from jaxmem.families.params import init_params
    from jaxmem.model.precision import cast_floating, get_precision
    cfg = run_config(spec)
    init_key, _ = jax.random.split(jax.random.PRNGKey(cfg.data.seed))
    return cast_floating(init_params(cfg.model_config(), init_key),
                         get_precision(cfg.precision.mode).param_dtype)


def _median_after(times: list[float], warmup: int) -> float:
    rest = times[warmup:] or times[-1:]
    return statistics.median(rest)


# ---------------------------------------------------------------- jax


def jax_saved_bytes(model, abstract_compute_params, batch, loss_chunk=0) -> tuple[int, int]:
    """(bytes, count) of the residuals of the loss w.r.t. the compute-dtype params, params excluded.

    The loss is the train step's (`token_loss`, causal-only attention, with the step's
    `loss_chunk`: the fused LM head + loss when it is on). Only the `params` argument is left
    out: the token ids and targets count when they are saved, as on the torch side
    (saved_tensors_hooks see them too)."""
    import numpy as np
    from jaxmem.xla.residuals import saved_residual_bytes
    from jaxmem.train.loss import token_loss

    def loss_of(params, batch):
        mb = {**batch, "mask": np.ones(batch["targets"].shape, np.int32)}
        total, count = token_loss(model, params, mb, loss_chunk=loss_chunk)
        return total / count

    res = saved_residual_bytes(loss_of, abstract_compute_params, batch,
                               exclude_arguments=("params",))
    if res is None:  # pragma: no cover - future jax without it
        raise RuntimeError("this jax has no saved_residuals (jax.ad_checkpoint)")
    if not res.excluded:  # the weights are always among the residuals: the names changed
        raise RuntimeError("saved_residuals descriptions no longer name 'the argument params'")
    return res.bytes, res.count


def run_jax(spec: dict) -> dict:
    import jax
    import jax.numpy as jnp
    from jaxmem.memory.compiled import compiled_stats
    from jaxmem.model.precision import cast_params
    from jaxmem.train.step import jit_train_step

    cfg, state = jax_params(spec)
    c, B, T = cfg.model, spec["batch_size"], spec["seq_len"]
    compute = jax.eval_shape(lambda p: cast_params(p, cfg.precision.compute_dtype), state.params)
    batches = make_batches(c, spec["n_batches"], B, T, spec["seed"] + 1)
    try:  # a jax without saved_residuals (or with new descriptions) still gets timed
        saved, n_res, saved_error = *jax_saved_bytes(cfg.build_model(), compute, batches[0],
                                                     cfg.loss_chunk), None
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
    from experiments.compare import torch_train as tt
    from experiments.compare.convert import jax_to_torch_state_dict

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
    o = run_config(spec).optim
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
