"""An old commit's planner, one with no `--target`, compiling for a deviceless card.

    JAXMEM_CARD_CONFIG=<target config file> PYTHONPATH=<the old commit's tree> \
        python experiments/tables/old_planner_on_card.py <that planner's flags>

time_calibration's `--at COMMIT` runs this for a commit older than 4a55a87 (the first with
`--target`): the rows of the first GPU session ran 25ec38c. It is the prototype of
shared/gpu-aot/planner_h100.py, which became `--target`: the old `python -m jaxmem.memory`
(its parser and phases unchanged) inside `jax.default_device(<a deviceless GPU of the CUDA
plugin's topology>)`, so every `jit(...).lower(...).compile()` is compiled by the card's XLA;
and the model's backend checks answer "gpu" (cuDNN attention, no CPU upcasts), as they do on the
card. It imports only the old tree's jaxmem, never today's. Not covered: host offload, meshes
(that commit's rows had neither).
"""

import importlib
import os
import runpy
import sys


def main(argv: list[str]) -> int:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # the flag today's jaxmem.target.prepare sets (XLA's sort needs no device to size its
    # scratch); set before jax starts, so importing this module changes nothing
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_gpu_enable_cub_radix_sort=false").strip()
    import jax  # noqa: PLC0415
    from jax.experimental import topologies  # noqa: PLC0415

    config = open(os.environ["JAXMEM_CARD_CONFIG"]).read()
    gpu = topologies.get_topology_desc(platform="cuda", target_config=config,
                                       topology="1x1x1").devices[0]
    importlib.import_module("jaxmem.model.attention")._on_gpu = lambda: True
    for name in ("jaxmem.model.layers", "jaxmem.model.attention", "jaxmem.model.projection"):
        module = importlib.import_module(name)
        if hasattr(module, "cpu_lacks"):
            module.cpu_lacks = lambda dtype: False
    jax.config.update("jax_enable_compilation_cache", False)
    print(f"old_planner_on_card: compiling for {gpu.device_kind} (deviceless, jax "
          f"{jax.__version__})", file=sys.stderr)
    sys.argv = ["python -m jaxmem.memory", *argv]
    with jax.default_device(gpu):  # `python -m jaxmem.memory ARGV` of the old tree
        runpy.run_module("jaxmem.memory", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
