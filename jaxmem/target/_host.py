"""A target's programs with values in host memory (`--offload-optimizer host`,
`--offload-params host`, `--offload-base host`), compiled without the card.

The deviceless devices of `compiling_for` have no memories (jax 0.10.2: `addressable_memories()`
is empty), so a sharding there cannot say `pinned_host`: its memory kind is dropped and a program
that moves values between host and device does not trace. What works (experiments/spike39):
place the abstract arguments on this machine's CPU device, whose shardings do carry memory kinds
(`host_device`), lower the traced program for CUDA (`lowering_platforms=("cuda",)`: the
StableHLO keeps `mhlo.memory_kind = "pinned_host"` and the annotate_device_placement calls),
and compile that module with the target's own compiler. The executable is the card's: its
`memory_analysis()` reports the host arguments apart and its HLO holds the host <-> device copies.

    lowered = jaxmem.target.lower(jitted, *args)  # inside compiling_for, host-resident args
    compiled = lowered.compile()                  # memory_analysis(), cost_analysis(), as_text()

This module holds the lowered program and the card's executable (`Lowered`, `Compiled`); the
entry points, `host_device` and `lower`, are jaxmem.target's.
"""

from __future__ import annotations


class Lowered:
    """A program lowered for CUDA on the CPU stand-in; `compile()` runs the card's compiler."""

    def __init__(self, lowered, device, compiler_options):
        self._lowered, self._device, self._options = lowered, device, compiler_options

    def as_text(self) -> str:
        return self._lowered.as_text()

    def compile(self) -> "Compiled":
        from jax._src import compiler  # noqa: PLC0415  (no public API for this in 0.10 / 0.11)
        from jax._src.lib import xla_client as xc  # noqa: PLC0415
        d = self._device
        options = compiler.get_compile_options(
            num_replicas=1, num_partitions=1, device_assignment=[[d.id]],
            env_options_overrides={k: str(v) for k, v in (self._options or {}).items()} or None)
        module = self._lowered.compiler_ir("stablehlo")
        return Compiled(d.client.compile(module, executable_devices=xc.DeviceList((d,)),
                                          compile_options=options), d.client)


class Compiled:
    """The card's executable, read as a `jax.stages.Compiled` is (what the planner reads)."""

    def __init__(self, executable, client):
        self._exe, self._client = executable, client

    def memory_analysis(self):
        return self._exe.get_compiled_memory_stats()

    def cost_analysis(self) -> dict:
        """XLA's cost analysis of the optimized module (the executable itself has none here),
        {} where the client cannot give one."""
        from jax._src.lib import _jax  # noqa: PLC0415
        try:
            return _jax.hlo_module_cost_analysis(self._client, self._exe.hlo_modules()[0])
        except Exception:  # noqa: BLE001  (an UNIMPLEMENTED of this jaxlib: no FLOPs, not fatal)
            return {}

    def as_text(self) -> str:
        return self._exe.hlo_modules()[0].to_string()
