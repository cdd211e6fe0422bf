"""Runs on 2 simulated CPU devices in a subprocess of tests/test_offload_optimizer.py: the tiny
preset (bf16-sr, adamw8bit, clipping) for 10 steps on fsdp=2 with the optimizer state on the
device and in pinned host memory (--offload-optimizer host), with the 8-bit update streaming
each device's shard:

    python tests/offload_mesh_worker.py OUT.json

writes {"losses": {run: [...]}, "same_state": bool, "kinds": {run: [memory kinds of the
optimizer state's arrays after each step]}, "specs_equal": bool, "local_host": [shapes the
update's shard_map bodies saw in host memory]}. The test asserts; this script only measures.
"""

import json
import sys

from testenv import worker_jax

jax = worker_jax(2)
import numpy as np  # noqa: E402

import jaxmem.optim._inplace as fused  # noqa: E402  (where a leaf is walked in place)
from jaxmem.families import get_preset  # noqa: E402
from jaxmem.model.precision import get_precision  # noqa: E402
from jaxmem.model.remat import RematPolicy  # noqa: E402
from jaxmem.parallel import run_mesh  # noqa: E402
from jaxmem.train.loss import synthetic_batch  # noqa: E402
from jaxmem.train.optim import OptimConfig  # noqa: E402
from jaxmem.train.placement import Placement  # noqa: E402
from jaxmem.train.step import StepConfig  # noqa: E402

seen, in_host = [], fused.in_host_memory


def spy(x):  # which arrays the update sees in host memory, at their (per-shard) shapes
    on = in_host(x)
    if on:
        seen.append(list(jax.typeof(x).shape))
    return on


fused.in_host_memory = spy
cfg = StepConfig(get_preset("tiny"), get_precision("bf16-sr"), RematPolicy("full"),
                 OptimConfig(optimizer="adamw8bit", clip=1.0, lr=1e-2, warmup_steps=2,
                             total_steps=20))
mesh = run_mesh("fsdp=2", cfg.model, 2)
out, states = {"losses": {}, "kinds": {}}, {}
for name in ("device", "host"):
    par = Placement.on(mesh, offload_optimizer="none" if name == "device" else "host")
    s = par.init_state(cfg, None, 1)
    step, losses, kinds = par.train_step(cfg, s), [], []
    for k in range(10):
        one = synthetic_batch(jax.random.PRNGKey(k), 2, 16, cfg.model.vocab_size)
        s, m = step(s, par.batch(jax.tree.map(lambda x: np.asarray(x)[None], one)))
        losses.append(float(m["loss"]))
        kinds.append(sorted({x.sharding.memory_kind for x in jax.tree.leaves(s.opt_state)
                             if x.ndim}))
    out["losses"][name], out["kinds"][name], states[name] = losses, kinds, s
out["local_host"] = seen
a, b = states["device"], states["host"]
bits = lambda x: np.asarray(x).reshape(-1).view(np.uint8)  # noqa: E731
out["same_state"] = all(np.array_equal(bits(x), bits(y))
                        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
out["specs_equal"] = all(x.sharding.spec == y.sharding.spec
                         for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
out["counters"] = sorted({x.sharding.memory_kind for x in jax.tree.leaves(b.opt_state)
                          if not x.ndim})
with open(sys.argv[1], "w") as f:
    json.dump(out, f)
