"""Readers of XLA's own answers, for any jittable function: a block under the model (it imports
no model, trainer or app; jaxmem.memory, the planner, is built on it).

    analysis     analyze(fn, *args): XLA's memory plan of a function and the residuals of its
                 backward (`MemoryAnalysis`, `jaxmem.memory.analyze` is this function)
    residuals    the residuals jax saves for a backward, from jax's own list
    hlo          HLO module text read on any machine: computations, instructions in schedule
                 order, shape bytes, the entry layout's host-memory arguments
    collectives  a compiled program's collectives: bytes each device sends per kind and step
    verdict      does a peak fit the common GPU sizes, with the headroom assumed
"""
