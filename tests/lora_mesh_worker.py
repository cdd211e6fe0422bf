"""Runs on 8 simulated CPU devices in a subprocess of tests/test_lora_mesh.py (the test process's
JAX has already initialized with one device). One process runs every check, so the test pays
for one JAX start-up:

    python tests/lora_mesh_worker.py OUT_DIR [train] [hlo] [memory] [packed] [reshard]

train:   LoRA (fp32 base) and QLoRA (NF4 + double quantization) on the tiny preset, fp32, 5
         steps on one device and on fsdp=4, data=2,fsdp=2, tensor=2,fsdp=2 (the first 4
         devices): OUT_DIR/<kind>_<mesh>.npz with the per-step losses, the adapters flattened and
         whether every base leaf came back bitwise unchanged after training; and
         qlora_resumed.npz: 2 steps on fsdp=4, an Orbax checkpoint, restored onto
         data=2,fsdp=2's shardings, 3 more steps.
hlo:     the QLoRA step compiled on fsdp=4 and on tensor=2,fsdp=2: OUT_DIR/hlo.json lists the
         result shapes of every all-gather in the optimized HLO, split into those inside a while
         loop's body (the layer scans) and those outside, and the stacked base leaves' shapes.
memory:  compile only: per-device argument bytes of the QLoRA base (a jit taking the base with
         its shardings; with --step also the whole train step's argument and temp bytes), one
         device and fsdp=2, 4, 8: OUT_DIR/memory.json.
packed:  compile only: the QLoRA step (4 layers of width 512, amp-bf16, full remat) on fsdp=2
         with the packed layer gather (jaxmem.quant.gather_packed) and without:
         OUT_DIR/packed.json with each one's per-device temp bytes and the int8/uint8 results
         computed outside the layer loops (a relayout copy of a stacked packed leaf shows here).
reshard: the quantized base placed for fsdp=4, moved to tensor=2,fsdp=2's shardings and on to
         fsdp=8's, each leaf compared bitwise with the one-device base: OUT_DIR/reshard.json.

The test asserts; this script only measures.
"""

import json
import os
import re
import sys

from testenv import worker_jax

jax = worker_jax(8)  # 8 simulated CPU devices, precision highest, the suite's compile cache
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxmem.config.run import RunConfig  # noqa: E402
import jaxmem.parallel.rules as R  # noqa: E402
from jaxmem.parallel import run_mesh  # noqa: E402
from jaxmem.peft.base import base_on_device, base_on_host  # noqa: E402
from jaxmem.train.loss import synthetic_batch  # noqa: E402
from jaxmem.train.placement import Placement  # noqa: E402
from jaxmem.train.run import build_step_config  # noqa: E402

MESHES = {"fsdp4": "fsdp=4", "data2_fsdp2": "data=2,fsdp=2", "tensor2_fsdp2": "tensor=2,fsdp=2"}
BATCH, SEQ, STEPS = 8, 32, 5
KINDS = {"lora": {"peft.lora_rank": 4},
         "qlora": {"peft.lora_rank": 4, "peft.quantize_base": "nf4", "peft.double_quant": True}}


def config(kind: str) -> RunConfig:
    # warmup 1: full-size updates from step 2 on, so the adapters really move. Adam's eps 1e-6
    # (default 1e-8): a near-zero gradient's reduction-order noise is not blown up to an
    # lr-sized step (tests/test_lora_mesh.py), so the comparison measures the sharding.
    return RunConfig().replace({"data.batch_size": BATCH, "data.seq_len": SEQ,
                                "optim.warmup_steps": 1, "optim.eps": 1e-6, **KINDS[kind]})


def placement(mesh_text, model_cfg, n_devices=4):
    mesh = None if mesh_text is None else run_mesh(mesh_text, model_cfg, BATCH,
                                                   devices=jax.devices()[:n_devices])
    return Placement.single() if mesh is None else Placement.on(mesh)


def host_leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def run(cfg: RunConfig, mesh_text, batches, host_base, resume_on=None, ckpt_dir=None):
    """Train on `mesh_text`; with `resume_on`: 2 steps there, a checkpoint, then the rest on
    the `resume_on` mesh from the checkpoint restored with that mesh's shardings."""
    from jaxmem.io.checkpoint import Checkpointer
    from jaxmem.train.run import abstract_train_state
    model_cfg, step_cfg, loss_scale = build_step_config(cfg)
    par = placement(mesh_text, model_cfg)
    frozen = base_on_device(host_base, step_cfg.trainable, step_cfg.precision.compute_dtype,
                            par.base_shardings(step_cfg))
    before = host_leaves(frozen)
    state = par.init_state(step_cfg, loss_scale, 0)
    step = par.train_step(step_cfg, state)
    losses = []
    for i, b in enumerate(batches):
        if resume_on is not None and i == 2:
            with Checkpointer(ckpt_dir) as ckpt:
                ckpt.save(2, state, {"step": 2})
                par = placement(resume_on, model_cfg)
                target = par.abstract(abstract_train_state(step_cfg, loss_scale, 0))
                state, _ = ckpt.restore(2, target)
            frozen = base_on_device(host_base, step_cfg.trainable, step_cfg.precision.compute_dtype,
                                    par.base_shardings(step_cfg))
            step = par.train_step(step_cfg, state)
        state, metrics = step(state, par.batch(b), frozen)
        losses.append(float(par.host(metrics)["loss"]))
    after = host_leaves(frozen)
    unchanged = len(before) == len(after) and all(
        a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
        for a, b in zip(before, after))
    adapters = np.concatenate([np.asarray(x, np.float32).ravel()
                               for x in jax.tree.leaves(state.params)])
    return dict(losses=np.array(losses), adapters=adapters, base_unchanged=unchanged,
                base=np.concatenate([a.view(np.uint8).ravel() for a in before]),
                applied=int(par.host(state.applied)))


def batches_for(cfg):
    vocab = cfg.model_config().vocab_size
    out = []
    for i in range(STEPS):
        b = synthetic_batch(jax.random.PRNGKey(100 + i), BATCH, SEQ, vocab, pad_fraction=0.25)
        out.append({k: np.asarray(v)[None] for k, v in b.items()})  # [K=1, B, T]
    return out


def train(out):
    for kind in KINDS:
        cfg = config(kind)
        _, host = base_on_host(cfg.model_config(), cfg.data.seed)
        batches = batches_for(cfg)
        np.savez(os.path.join(out, f"{kind}_single.npz"), **run(cfg, None, batches, host))
        for key, text in MESHES.items():
            np.savez(os.path.join(out, f"{kind}_{key}.npz"), **run(cfg, text, batches, host))
    # a QLoRA run saved on fsdp=4 after 2 steps, restored onto data=2,fsdp=2 for the other 3
    cfg = config("qlora")
    _, host = base_on_host(cfg.model_config(), cfg.data.seed)
    np.savez(os.path.join(out, "qlora_resumed.npz"),
             **run(cfg, "fsdp=4", batches_for(cfg), host, resume_on="data=2,fsdp=2",
                   ckpt_dir=os.path.join(out, "ckpt")))


def _abstract_step_args(cfg, par):
    from jaxmem.peft.base import abstract_base
    from jaxmem.train.run import abstract_train_state
    model_cfg, step_cfg, loss_scale = build_step_config(cfg)
    state = abstract_train_state(step_cfg, loss_scale, 0)
    base = abstract_base(model_cfg, step_cfg.trainable, step_cfg.precision.compute_dtype)
    batch = {k: jax.ShapeDtypeStruct((1, BATCH, SEQ), jnp.int32)
             for k in batches_for(cfg)[0]}
    return step_cfg, state, batch, base


def _computations(text):
    """{computation name: its lines} of an optimized HLO text, and the set of computations
    called (transitively) as a while loop's body."""
    bodies = set(re.findall(r"\bbody=%?([\w.\-]+)", text))
    comps, current = {}, None
    for line in text.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) ", line)
        if m and line.rstrip().endswith("{"):
            current = m.group(1)
            comps[current] = []
        elif current is not None:
            comps[current].append(line)
    calls = {c: set(re.findall(r"(?:calls|to_apply|body|condition|branch_computations)="
                               r"\{?%?([\w.\-]+)", "\n".join(lines))) for c, lines in comps.items()}
    inside, todo = set(), list(bodies)
    while todo:
        c = todo.pop()
        if c not in inside:
            inside.add(c)
            todo.extend(calls.get(c, ()))
    return comps, inside, bodies


def _gathers(text):
    """{"inside": [...], "outside": [...]}: result shapes of the all-gathers in computations
    called (transitively) as a while loop's body, and of all others; the while bodies."""
    comps, inside, bodies = _computations(text)
    gathers = {"inside": [], "outside": []}
    for c, lines in comps.items():
        for line in lines:
            if re.search(r"= \S.*? all-gather(-start)?\(", line):
                shape = line.split("=", 1)[1].strip().split(" all-gather")[0]
                gathers["inside" if c in inside else "outside"].append(shape)
    return gathers, sorted(bodies)


def hlo(out):
    cfg = config("qlora")
    report = {}
    for text in ("fsdp=4", "tensor=2,fsdp=2"):
        par = placement(text, cfg.model_config())
        step_cfg, state, batch, base = _abstract_step_args(cfg, par)
        compiled = par.train_step(step_cfg, state).lower(state, batch, base).compile()
        gathers, bodies = _gathers(compiled.as_text())
        report[text] = {"gathers": gathers, "while_bodies": bodies}
    report["base_leaves"] = [f"{x.dtype}[{','.join(map(str, x.shape))}]"
                             for x in jax.tree.leaves(base) if x.ndim > 1]
    with open(os.path.join(out, "hlo.json"), "w") as f:
        json.dump(report, f)


def memory(out):
    cfg = config("qlora")
    report = {}
    for n in (1, 2, 4, 8):
        par = placement(None if n == 1 else f"fsdp={n}", cfg.model_config(), n)
        step_cfg, state, batch, base = _abstract_step_args(cfg, par)
        shardings = par.base_shardings(step_cfg)
        # the base alone: a program whose arguments are exactly the base, with its shardings
        fn = jax.jit(lambda b: sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(b)),
                     in_shardings=None if shardings is None else (shardings,))
        report[n] = {"base_argument_bytes": int(
            fn.lower(base).compile().memory_analysis().argument_size_in_bytes)}
        if "--step" in sys.argv:  # the whole step too (for docs; not asserted: 4 more compiles)
            m = par.train_step(step_cfg, state).lower(state, batch, base).compile()
            m = m.memory_analysis()
            report[n].update(step_argument_bytes=int(m.argument_size_in_bytes),
                             step_temp_bytes=int(m.temp_size_in_bytes))
    with open(os.path.join(out, "memory.json"), "w") as f:
        json.dump(report, f)


def packed(out):
    # wide enough that a copy of the stacked packed leaves is a visible part of the step's temp
    cfg = config("qlora").replace({"model.num_layers": 4, "model.hidden_size": 512,
                                   "model.intermediate_size": 1536, "model.num_heads": 8,
                                   "model.num_kv_heads": 4, "model.vocab_size": 512,
                                   "precision.mode": "amp-bf16", "remat.policy": "full"})
    par = placement("fsdp=2", cfg.model_config(), 2)
    step_cfg, state, batch, base = _abstract_step_args(cfg, par)
    report, gather = {}, R.lora_packed_gather
    for name, table in (("gather", gather), ("no_gather", lambda step_cfg, mesh: None)):
        R.lora_packed_gather = table  # what Placement.train_step installs (None: XLA's choice)
        try:
            compiled = par.train_step(step_cfg, state).lower(state, batch, base).compile()
        finally:
            R.lora_packed_gather = gather
        comps, inside, _ = _computations(compiled.as_text())
        ints = [line.split("=", 1)[1].strip().split(" ", 1)
                for c, lines in comps.items() if c not in inside for line in lines
                if re.search(r"= [us]8\[", line) and " parameter(" not in line]
        report[name] = {"temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
                        "int8_outside_loops": [f"{shape} {op.split('(')[0]}" for shape, op in ints]}
    report["stacked_packed_bytes_per_device"] = int(sum(
        x.size * x.dtype.itemsize for x in jax.tree.leaves(base) if x.dtype in (jnp.uint8, jnp.int8)
    ) // 2)
    with open(os.path.join(out, "packed.json"), "w") as f:
        json.dump(report, f)


def reshard(out):
    cfg = config("qlora")
    model_cfg, step_cfg, _ = build_step_config(cfg)
    _, host = base_on_host(model_cfg, cfg.data.seed)
    dtype = step_cfg.precision.compute_dtype
    one = host_leaves(base_on_device(host, step_cfg.trainable, dtype))
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(
        base_on_device(host, step_cfg.trainable, dtype))]
    first = placement("fsdp=4", model_cfg)
    placed = base_on_device(host, step_cfg.trainable, dtype, first.base_shardings(step_cfg))
    report = {"leaves": names, "meshes": {}}
    for text, n in (("fsdp=4", 4), ("tensor=2,fsdp=2", 4), ("fsdp=8", 8)):
        par = placement(text, model_cfg, n)
        placed = jax.device_put(placed, par.base_shardings(step_cfg))
        got = host_leaves(placed)
        report["meshes"][text] = {
            "bitwise": [a.dtype == b.dtype and a.tobytes() == b.tobytes() for a, b in zip(one, got)],
            "specs": [str(x.sharding.spec) for x in jax.tree.leaves(placed)]}
    with open(os.path.join(out, "reshard.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    target = sys.argv[1]
    parts = [a for a in sys.argv[2:] if not a.startswith("--")] or ["train", "hlo", "memory",
                                                                     "packed", "reshard"]
    for part in parts:
        {"train": train, "hlo": hlo, "memory": memory, "packed": packed,
         "reshard": reshard}[part](target)
