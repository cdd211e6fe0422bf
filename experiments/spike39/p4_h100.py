# Parts 1-3 for the deviceless H100: (A) jit under compiling_for with pinned_host shardings;
# (B) lower on CPU devices for "cuda" (memory kinds kept) and hand that StableHLO to the
#     deviceless H100 compiler (the CompileOnlyPyClient of the target's devices).
import re, sys, functools, jax, jax.numpy as jnp, numpy as np
from jaxmem import target
target.prepare()
from common import *
from jax._src import compiler as jcompiler
from jax._src.lib import xla_client as xc

WHICH = sys.argv[1] if len(sys.argv) > 1 else "single"

def key_lines(txt, n=40):
    pats = [r"entry_computation_layout", r"copy-start|copy-done", r"S\(5\)", r"dynamic-update-slice\(",
            r"dynamic-slice\(", r"while\(", r"MoveToHost|MoveToDevice|annotate"]
    out = [l.strip() for l in txt.splitlines() if any(re.search(p, l) for p in pats)]
    return [re.sub(r", metadata=\{[^}]*\}", "", l)[:260] for l in out][:n]

def make(which, cpu_dev):
    mesh = jax.sharding.Mesh(np.array([cpu_dev]), ("one",))
    hs = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(), memory_kind="pinned_host")
    ds = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    sds = lambda dt, s: jax.ShapeDtypeStruct((L, D, D), dt, sharding=s)
    if which == "single":
        f = jax.jit(functools.partial(step_single, offload=True), donate_argnums=0, out_shardings=hs)
        args = (sds(jnp.bfloat16, hs), sds(jnp.float32, ds))
    else:
        f = jax.jit(functools.partial(step_adam, offload=True, prefetch=(which == "adam_prefetch")),
                    donate_argnums=(0, 1, 2), out_shardings=(hs,) * 3)
        args = (sds(jnp.bfloat16, hs), sds(jnp.float32, hs), sds(jnp.float32, hs), sds(jnp.float32, ds))
    return f, args, hs

print(f"##### {WHICH}")
with target.compiling_for("h100") as t:
    d = t.devices[0]
    # (A) straight under the target
    try:
        f, args, hs = make(WHICH, d)
        print("(A) sharding memory_kind on the target device:", hs.memory_kind, "| arg aval:", args[0])
        comp = f.trace(*args).lower().compile()
        txt = comp.as_text()
        print("(A) compiled OK. memory_analysis:", comp.memory_analysis())
        for l in key_lines(txt, 12): print("   A|", l)
    except Exception as e:
        print("(A) FAILED:", type(e).__name__, str(e).strip().splitlines()[0][:500])

    # (B) lower with CPU devices for cuda, compile that module with the H100 compile-only client
    cpu = jax.devices("cpu")[0]
    f, args, hs = make(WHICH, cpu)
    lowered = f.trace(*args).lower(lowering_platforms=("cuda",))
    st = lowered.as_text()
    main = st[st.find("func.func public @main"):]
    print("(B) StableHLO main signature:", re.sub(r"\s+", " ", main[:main.find("{\n")])[:900])
    print("(B) annotate_device_placement:", [(m.group(1), st.count(m.group(0))) for m in
          re.finditer(r'_xla_buffer_placement = "(\w+)"', st)][:1],
          {k: len(re.findall(rf'_xla_buffer_placement = "{k}"', st)) for k in ("device", "pinned_host")})
    with open(f"/tmp/spike39/{WHICH}.stablehlo.mlir", "w") as fh: fh.write(st)
    mod = lowered.compiler_ir("stablehlo")
    client = d.client
    print("(B) target client:", type(client).__name__, client.platform)
    opts = jcompiler.get_compile_options(num_replicas=1, num_partitions=1,
                                         device_assignment=np.array([[d.id]]))
    try:
        exe = client.compile(mod, executable_devices=xc.DeviceList((d,)), compile_options=opts)
        txt = exe.hlo_modules()[0].to_string()
        with open(f"/tmp/spike39/{WHICH}.h100.hlo.txt", "w") as fh: fh.write(txt)
        print("(B) H100 compile OK. memory stats:", exe.get_compiled_memory_stats())
        for l in key_lines(txt): print("   B|", l)
    except Exception as e:
        print("(B) H100 compile FAILED:", type(e).__name__, str(e).strip()[:1500])
