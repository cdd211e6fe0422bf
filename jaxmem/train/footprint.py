"""What one train step holds and moves beyond its program's arguments, as the step states it: the
trainer's own rules, asked by the planner's memory and time models instead of re-derived there
(jaxmem.memory adds the bytes, jaxmem.xla.timing the seconds).

    fp = footprint(step_cfg, batch_size, seq_len)
    fp.mlp_tile        sequence positions per MLP tile, 0: the MLP whole (jaxmem.model.tiled)
    fp.mlp_slab        --optimizer-in-backward: the width of the slabs of F each layer's MLP
                       runs and updates in, 0: whole (jaxmem.train.inbackward_slabs)
    fp.streamed        --optimizer-in-backward: the top-level params whose gradients are made
                       and applied in pieces, never held whole (the embedding, an untied head)
    fp.crossings       per host-resident part: how many times it crosses the host link per
                       optimizer step, and why (the step's transfers per layer, summed)
    fp.piece_bytes     the largest piece the state program makes at a time (jaxmem.train.host_state)
    fp.eval_remat      the remat policy of the eval forward (it differentiates nothing)

A new offload or in-backward feature states its footprint here, in train/; the planner only
counts bytes and reads programs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxmem.model.remat import RematPolicy
from jaxmem.model.tiled import mlp_tile, tiles_under
from jaxmem.train.host_state import PIECE_BYTES
from jaxmem.train.inbackward_rules import mlp_slabs, streamed_gradients
from jaxmem.train.step import EVAL_REMAT, StepConfig

# How many times a host-resident part crosses the link per optimizer step: "params", the
# trained weights (in for the forward, in again for the backward's recompute, out after the
# update); "optimizer", its state (in for its update, out after); per micro-batch: "frozen", a
# LoRA base on the host (in for the forward and the backward), "activations" (--remat
# offload: out in the forward, in for the backward).
CROSSINGS = {"params": (3, "weights: in for the forward and the backward, out once"),
             "optimizer": (2, "optimizer state: in and out once"),
             "frozen": (2, "frozen base: in for the forward and the backward, per micro-batch"),
             "activations": (2, "activations: out in the forward, in for the backward, per "
                                "micro-batch")}
PER_MICRO_BATCH = frozenset({"frozen", "activations"})


@dataclass(frozen=True)
class Footprint:
    """One step's footprint beyond its arguments (the module docstring)."""

    mlp_tile: int
    mlp_slab: int
    streamed: frozenset
    grad_accum: int
    piece_bytes: int = PIECE_BYTES
    eval_remat: RematPolicy = field(default=EVAL_REMAT)

    def crossings(self, part: str) -> tuple[int, str]:
        """(times over the host link per optimizer step, why) of a host-resident `part`:
        "params", "optimizer", "frozen" or "activations"."""
        times, why = CROSSINGS[part]
        return times * (self.grad_accum if part in PER_MICRO_BATCH else 1), why


def _mlp_tile(cfg: StepConfig, batch_size: int, seq_len: int) -> int:
    """The MLP's sequence tile where the step runs it tiled (jaxmem.families.decoder's rule:
    `tiles_under` the policy and the plain einsum, not fp8's, above 3 D tokens:
    `jaxmem.model.tiled.tiling_pays`, the in-backward step's rule too; LoRA's own tile,
    `Trainable.mlp_tile`), else 0."""
    if not tiles_under(cfg.remat) or cfg.precision.fp8:
        return 0
    c = cfg.model
    tile = cfg.trainable.mlp_tile(mlp_tile(batch_size, seq_len, c.intermediate_size,
                                           c.hidden_size))
    return tile if tile < seq_len else 0


def footprint(cfg: StepConfig, batch_size: int, seq_len: int) -> Footprint:
    """The footprint of `cfg`'s step at micro-batch `batch_size` x `seq_len`."""
    tokens = batch_size * seq_len
    in_backward = cfg.optim.in_backward
    return Footprint(
        mlp_tile=_mlp_tile(cfg, batch_size, seq_len),
        mlp_slab=mlp_slabs(cfg, tokens, cfg.optim.params_on_host) if in_backward else 0,
        streamed=frozenset(streamed_gradients(cfg, tokens)) if in_backward else frozenset(),
        grad_accum=cfg.grad_accum)
