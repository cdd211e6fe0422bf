"""Beyond one device: the mesh, sharding rules by parameter role, placement of the state and
the batch, multi-process start-up (docs/distributed.md). The state placed on a mesh
(Placement) is jaxmem.train.placement; per-device memory is jaxmem.memory.mesh.

    mesh.py         --mesh data=D,fsdp=F,tensor=T parsed, checked, built (AxisType.Auto)
    rules.py        PartitionSpecs of the state, the batch and the activations
    distributed.py  jax.distributed start-up flags (--coordinator ...), heartbeat, errors

`python -m jaxmem.launch` (jaxmem/launch.py) starts N local processes for trying multi-host on CPU.
"""

from jaxmem.parallel.mesh import AXES, MeshError, MeshSpec, build_mesh, run_mesh

__all__ = ["AXES", "MeshError", "MeshSpec", "build_mesh", "run_mesh"]
