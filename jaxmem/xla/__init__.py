"""Readers of XLA's own answers, for any jittable function: a block under the model (it imports
no model, trainer or app; jaxmem.memory, the planner, is built on it). analysis: `analyze`
(public as `jaxmem.memory.analyze`); residuals: what jax saves for a backward; hlo: HLO module
text; collectives: bytes sent between devices; verdict: does a peak fit (docs/architecture.md).
"""
