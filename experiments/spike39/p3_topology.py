# Part 3: what memories does the deviceless H100 topology report?
import jax, jax.numpy as jnp
from jaxmem import target
target.prepare()
print("jax", jax.__version__)
print("Space members:", [m for m in dir(jax.memory) if not m.startswith("_")])
with target.compiling_for("h100") as t:
    d = t.devices[0]
    print("device:", d, type(d).__name__, getattr(d, "device_kind", None))
    for name in ("addressable_memories", "default_memory"):
        try:
            r = getattr(d, name)()
            print(f"{name}():", r, [getattr(m, "kind", None) for m in (r if isinstance(r, (list, tuple)) else [r])])
        except Exception as e:
            print(f"{name}() FAILED: {type(e).__name__}: {e}")
    for kind in ("device", "pinned_host", "unpinned_host"):
        try:
            print(f"memory({kind!r}):", d.memory(kind))
        except Exception as e:
            print(f"memory({kind!r}) FAILED: {type(e).__name__}: {str(e).splitlines()[0]}")
    for kind in ("pinned_host", "device"):
        try:
            s = jax.sharding.SingleDeviceSharding(d, memory_kind=kind)
            print(f"SingleDeviceSharding(memory_kind={kind!r}) ->", s.memory_kind)
        except Exception as e:
            print(f"SingleDeviceSharding({kind}) FAILED: {type(e).__name__}: {str(e).splitlines()[0]}")
        try:
            import numpy as np
            mesh = jax.sharding.Mesh(np.array([d]), ("one",))
            s = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(), memory_kind=kind)
            print(f"NamedSharding(memory_kind={kind!r}) ->", s.memory_kind)
        except Exception as e:
            print(f"NamedSharding({kind}) FAILED: {type(e).__name__}: {str(e).splitlines()[0]}")
    # topology-level
    from jax.experimental import topologies
    try:
        topo = topologies.get_topology_desc(platform="cuda", target_config=target.target_config(t.card), topology="1x1x1")
        print("topology attrs:", [a for a in dir(topo) if not a.startswith("_")])
    except Exception as e:
        print("topology FAILED", type(e).__name__, e)
cpu = jax.devices("cpu")[0]
print("CPU addressable_memories:", cpu.addressable_memories())
