# Part 1+2 on CPU: actually run; bitwise compare with an all-device version; inspect HLO.
import re, functools, jax, jax.numpy as jnp, numpy as np
from common import *
dev = jax.devices()[0]
print("jax", jax.__version__, dev, dev.addressable_memories())
host_s = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
mesh = jax.sharding.Mesh(np.array([dev]), ("one",))
host_n = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(), memory_kind="pinned_host")
dev_n = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

def hlo_lines(text, pats):
    return [l.strip()[:220] for l in text.splitlines() if any(re.search(p, l) for p in pats)]

w, m, v, g = data()
ref1 = jax.jit(functools.partial(step_single, offload=False))(w, g)
refA = jax.jit(functools.partial(step_adam, offload=False, prefetch=False))(w, m, v, g)

for sname, hs in (("SingleDeviceSharding", host_s), ("NamedSharding", host_n)):
    print(f"\n=== {sname}(memory_kind='pinned_host') ===")
    wh = jax.device_put(w, hs)
    print("input aval memory space:", jax.typeof(wh), "| sharding.memory_kind:", wh.sharding.memory_kind)
    # --- single stack
    try:
        f = jax.jit(functools.partial(step_single, offload=True), donate_argnums=0,
                    out_shardings=hs)
        comp = f.lower(wh, g).compile()
        out = comp(wh, g)
        print("single: out memory_kind:", out.sharding.memory_kind, "| aval:", jax.typeof(out),
              "| donated input deleted:", wh.is_deleted(),
              "| bitwise equal:", bool(np.array_equal(np.asarray(out).view(np.uint16), np.asarray(ref1).view(np.uint16))))
        txt = comp.as_text()
        print("  entry layout:", hlo_lines(txt, [r"HloModule .*entry_computation_layout"])[0][:220])
        print("  ma:", comp.memory_analysis())
    except Exception as e:
        print("single FAILED:", type(e).__name__, str(e).splitlines()[0][:400])
    # --- no out_shardings: does the host placement propagate to the output?
    try:
        wh2 = jax.device_put(w, hs)
        out = jax.jit(functools.partial(step_single, offload=True), donate_argnums=0)(wh2, g)
        print("single (no out_shardings): out memory_kind:", out.sharding.memory_kind, jax.typeof(out))
    except Exception as e:
        print("single (no out_shardings) FAILED:", type(e).__name__, str(e).splitlines()[0][:400])
    # --- adam, two moment stacks + bf16 weights, with/without prefetch
    for pf in (False, True):
        try:
            wh, mh, vh = (jax.device_put(x, hs) for x in (w, m, v))
            f = jax.jit(functools.partial(step_adam, offload=True, prefetch=pf),
                        donate_argnums=(0, 1, 2), out_shardings=(hs, hs, hs))
            comp = f.lower(wh, mh, vh, g).compile()
            outs = comp(wh, mh, vh, g)
            eq = [bool(np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)))
                  for a, b in zip(outs, refA)]
            print(f"adam prefetch={pf}: out kinds:", [o.sharding.memory_kind for o in outs],
                  "| donated:", [x.is_deleted() for x in (wh, mh, vh)], "| bitwise equal (w,m,v):", eq)
        except Exception as e:
            print(f"adam prefetch={pf} FAILED:", type(e).__name__, str(e).splitlines()[0][:400])

# CPU HLO of the adam prefetch version, for the record
wh, mh, vh = (jax.device_put(x, host_n) for x in (w, m, v))
f = jax.jit(functools.partial(step_adam, offload=True, prefetch=True), donate_argnums=(0, 1, 2),
            out_shardings=(host_n,) * 3)
low = f.lower(wh, mh, vh, g)
txt = low.compile().as_text()
print("\nCPU compiled HLO (adam prefetch), key lines:")
for l in hlo_lines(txt, [r"entry_computation_layout", r"copy-start|copy-done|S\(5\)|dynamic-update-slice|while\("])[:25]:
    print("  ", l)
print("input_output_alias:", re.findall(r"input_output_alias=\{[^}]*\}", txt))
