"""Beyond one device: the mesh, sharding rules by parameter role, placement of the state and
the batch, multi-process start-up (docs/distributed.md).

    mesh.py         --mesh data=D,fsdp=F,tensor=T parsed, checked, built (AxisType.Auto)
    rules.py        PartitionSpecs of the state, the batch and the activations
    placement.py    Placement: sharded init, the jitted step with in/out shardings, batches
    distributed.py  jax.distributed start-up flags (--coordinator ...), heartbeat, errors
    memory.py       per-device memory: analytic split by the rules, compiled, mesh search
    launch.py       `python -m jaxmem.launch`: N local processes for trying multi-host on CPU
"""

from jaxmem.parallel.mesh import AXES, MeshError, MeshSpec, build_mesh, run_mesh
from jaxmem.parallel.placement import Placement

__all__ = ["AXES", "MeshError", "MeshSpec", "build_mesh", "run_mesh", "Placement"]
