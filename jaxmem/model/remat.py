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

Whether a policy saves memory is a measurement, not a belief: `python -m jaxmem.memory` compiles
the gradient step and reports XLA's temp bytes per policy (docs/remat.md).

The grammar is the public jaxmem.remat's (`RematPolicy.parse`, `DEFAULT_OFFLOAD_TAGS`, the same
names for any function with its own tags); this module adds jaxmem's decoder: its tags and the check
that the device can offload.
"""

from __future__ import annotations

import jax

import jaxmem.remat
from jaxmem import target
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


class RematPolicy(jaxmem.remat.RematPolicy):
    """jaxmem.remat's policy (one grammar, `parse`) on jaxmem's decoder: `names:` / `offload:`
    accept only its TAGS, and `jax_policy` is what `nn.remat` takes for a decoder block."""

    known_tags = TAGS

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
