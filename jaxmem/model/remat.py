"""Rematerialization (activation checkpointing) policies, chosen by name.

A policy decides which intermediate values of a decoder block are kept for the backward pass;
everything else is recomputed. The block's input is always kept: `nn.scan` carries it from layer
to layer, so `full` means "keep only the block inputs".

    none            no remat: keep every residual the backward pass needs (most memory, least FLOPs)
    full            keep nothing inside the block (least memory, one extra forward per block)
    dots            keep every matmul output (jax.checkpoint_policies.checkpoint_dots)
    dots_no_batch   keep matmul outputs without batch dims, i.e. the projections, not attention's
                    QK^T / PV (jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    names:a,b       keep only the activations tagged a, b (tags below)
    offload         keep the default offload tags in pinned host memory instead of device memory
    offload:a,b     the same for chosen tags
    full+untiled    full, with the MLP never run in sequence tiles (`+untiled` on any policy
                    under which it would tile: more memory, less time; RematPolicy.mlp_tiles)

Whether a policy saves memory is a measurement, not a belief: `python -m jaxmem.memory` compiles
the gradient step and reports XLA's temp bytes per policy (docs/remat.md).

The grammar is the public jaxmem.remat's (`RematPolicy.parse`, `DEFAULT_OFFLOAD_TAGS`, the same
names for any function with its own tags); this module adds jaxmem's decoder: its tags and the check
that the device can offload.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax

import jaxmem.remat
from jaxmem import target
from jaxmem.model.tiled import tiles_under
from jaxmem.remat import RematError

# Activation tags placed in jaxmem.families.decoder with `checkpoint_name`, in the order they occur.
TAGS = (
    "block_input",  # the decoder block's input (the scan carry the backward needs) [B, T, D]
    "attn_norm",    # RMSNorm output feeding q/k/v         [B, T, D]
    "query",        # q projection after RoPE               [B, T, N, H]
    "key",          # k projection after RoPE               [B, T, K, H]
    "value",        # v projection                          [B, T, K, H]
    "attn_context", # attention output before o_proj        [B, T, N, H]
    "attn_out",     # o_proj output                         [B, T, D]
    "mlp_norm",     # RMSNorm output feeding the MLP        [B, T, D]
    "mlp_gate",     # gate projection                       [B, T, F]
    "mlp_up",       # up projection                         [B, T, F]
    "mlp_hidden",   # silu(gate) * up                       [B, T, F]
    "mlp_out",      # down projection                       [B, T, D]
)


UNTILED = "+untiled"  # the suffix that keeps the MLP whole (RematPolicy.mlp_tiles False)


@dataclass(frozen=True)
class RematPolicy(jaxmem.remat.RematPolicy):
    """jaxmem.remat's policy (one grammar, `parse`) on jaxmem's decoder: `names:` / `offload:`
    accept only its TAGS, and `jax_policy` is what `nn.remat` takes for a decoder block.

    mlp_tiles: under a policy that lets the MLP run in sequence tiles (`full`, or a `names:` /
        `offload:` policy naming no MLP tag: jaxmem.model.tiled.tiles_under), whether it does
        where that saves memory (True, the default). The name's suffix `+untiled` (`full+untiled`)
        sets it False: the MLP's [B, T, F] activations are held whole in its backward, which
        costs memory and saves the tiles' loop and fp32 weight-gradient sums (llama-3-8b
        bf16-sr 8 x 2048 on the H100's compiled step: 54.18 GiB and 46.1% MFU predicted
        untiled, against the tiled step's 34.8%). `--fit` tries both where a card is given.
    """

    known_tags = TAGS
    mlp_tiles: bool = True

    @classmethod
    def parse(cls, spec):
        """The policy called `spec` (jaxmem.remat's grammar, plus the `+untiled` suffix on a
        policy whose MLP could tile); raises RematError naming it."""
        text = spec.value if isinstance(spec, jaxmem.remat.Remat) else str(spec).strip()
        if isinstance(spec, cls) or not text.endswith(UNTILED):
            return super().parse(spec)
        base = super().parse(text[:-len(UNTILED)])
        if not tiles_under(base):
            raise RematError(f"remat policy {text!r}: {str(base)!r} never runs the MLP in "
                             f"sequence tiles (only full, or names: / offload: naming no mlp_ "
                             f"tag, do), so '{UNTILED}' changes nothing; drop it")
        return dataclasses.replace(base, mlp_tiles=False)

    def __str__(self) -> str:
        return super().__str__() + ("" if self.mlp_tiles else UNTILED)

    def jax_policy(self):
        """The `jax.checkpoint` policy, or None for `full` (nn.remat's default saves nothing)
        and `none` (no remat); `offload` raises RematError where the device cannot offload."""
        if self.kind in ("none", "full"):
            return None
        if self.kind == "offload":
            check_offload_supported()
        return self.checkpoint_policy()


def check_offload_supported(device=None) -> None:
    """Raise RematError unless the device has a pinned host memory space to offload into.

    Compiling for a `--target` GPU (jaxmem.target) passes: the card has pinned host memory, even
    where the deviceless compile cannot place buffers there (docs/memory.md)."""
    if device is None and target.active() is not None:
        return
    device = device or jax.devices()[0]
    try:
        kinds = {m.kind for m in device.addressable_memories()}
    except Exception:  # very old runtimes: no memories API at all
        kinds = set()
    if "pinned_host" not in kinds or device.platform == "cpu":
        raise RematError(
            f"remat policy 'offload' needs a device with pinned host memory; "
            f"{device.platform} device {device} has memory kinds {sorted(kinds) or 'unknown'} "
            f"(use 'full' or 'names:...' here)")
