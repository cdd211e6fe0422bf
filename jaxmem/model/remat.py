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

This parser knows jaxmem's Llama (its tags, the offload check); the same names for any other
function, with its own tags, are the public `jaxmem.remat.policy(name)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax

from jaxmem import target

# Activation tags placed in jaxmem.model.llama with `checkpoint_name`, in the order they occur.
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

# What `offload` moves to host when no tags are given: the big per-token matmul outputs.
DEFAULT_OFFLOAD_TAGS = ("block_input", "query", "key", "value", "attn_context", "mlp_gate",
                        "mlp_up")

_SIMPLE = ("none", "full", "dots", "dots_no_batch", "offload")
VALID_POLICIES = _SIMPLE + ("names:<tag>[,<tag>...]", "offload:<tag>[,<tag>...]")


class RematError(ValueError):
    """An unknown or unsupported remat policy."""


@dataclass(frozen=True)
class RematPolicy:
    """A parsed remat policy.

    kind: one of none, full, dots, dots_no_batch, names, offload.
    names: the tags saved on device (kind `names`) or offloaded to host (kind `offload`).
    """

    kind: str = "none"
    names: tuple[str, ...] = ()

    @classmethod
    def parse(cls, spec: "str | RematPolicy") -> "RematPolicy":
        if isinstance(spec, RematPolicy):
            return spec
        spec = spec.strip()
        head, sep, tail = spec.partition(":")
        if not sep and head in _SIMPLE:
            return cls(head, DEFAULT_OFFLOAD_TAGS if head == "offload" else ())
        if sep and head in ("names", "offload"):
            names = tuple(n.strip() for n in tail.split(",") if n.strip())
            unknown = [n for n in names if n not in TAGS]
            if not names or unknown:
                raise RematError(f"remat policy {spec!r}: unknown tag(s) {unknown or '(none given)'}; "
                                 f"valid tags: {', '.join(TAGS)}")
            return cls(head, names)
        raise RematError(f"unknown remat policy {spec!r}; valid: {', '.join(VALID_POLICIES)}")

    def __str__(self) -> str:
        if self.kind == "names" or (self.kind == "offload" and self.names != DEFAULT_OFFLOAD_TAGS):
            return f"{self.kind}:{','.join(self.names)}"
        return self.kind

    @property
    def enabled(self) -> bool:
        return self.kind != "none"

    def jax_policy(self):
        """The `jax.checkpoint` policy, or None for `full` (save nothing) and `none` (no remat)."""
        cp = jax.checkpoint_policies
        if self.kind in ("none", "full"):
            return None
        if self.kind == "dots":
            return cp.checkpoint_dots
        if self.kind == "dots_no_batch":
            return cp.dots_with_no_batch_dims_saveable
        if self.kind == "names":
            return cp.save_only_these_names(*self.names)
        check_offload_supported()
        return cp.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=list(self.names),
            offload_src="device", offload_dst="pinned_host")


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
