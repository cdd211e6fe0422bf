"""Remat (activation checkpointing) policies by name, for `jax.checkpoint` and Flax's `nn.remat`.

    f = jax.checkpoint(f, policy=jaxmem.remat.policy("dots"))
    Block = nn.remat(Block, policy=jaxmem.remat.policy("names:attn_out,mlp_out"))

The names are the ones `python -m jaxmem.train --remat` and `python -m jaxmem.memory` take (the
trainer's parser, with jaxmem's own activation tags, is jaxmem.model.remat); here they work on
any function, with the user's own tags (`checkpoint_name(x, "attn_out")` inside it):

    none            save every residual (jax.checkpoint_policies.everything_saveable): the
                    backward recomputes nothing, as without remat; most memory, fewest FLOPs
    full            save nothing inside (nothing_saveable): only the checkpointed function's
                    inputs; the backward runs the forward once more; least memory
    dots            save every matmul output (checkpoint_dots)
    dots_no_batch   save matmul outputs without batch dimensions, i.e. the projections but not
                    attention's QK^T / PV (dots_with_no_batch_dims_saveable)
    names:a,b       save only the values tagged a, b (save_only_these_names)
    offload:a,b     keep the values tagged a, b in pinned host memory instead of device memory
                    (save_and_offload_only_these_names); needs a device with a `pinned_host`
                    memory space (GPU/TPU, not the CPU backend)
    offload         offload jaxmem's default tags (jaxmem.model.remat.DEFAULT_OFFLOAD_TAGS:
                    block_input, query, key, value, attn_context, mlp_gate, mlp_up)

Whether a policy saves memory is a measurement: compile the gradient and read
`compiled.memory_analysis().temp_size_in_bytes` (docs/remat.md measures jaxmem's Llama).
"""

from __future__ import annotations

import enum
from typing import Callable

import jax
from jax.ad_checkpoint import checkpoint_name

from jaxmem.model.remat import DEFAULT_OFFLOAD_TAGS

__all__ = ["POLICIES", "Remat", "checkpoint_name", "policy"]


class Remat(str, enum.Enum):
    """The policies without arguments (a `str` enum: `Remat.DOTS == "dots"`)."""

    NONE = "none"
    FULL = "full"
    DOTS = "dots"
    DOTS_NO_BATCH = "dots_no_batch"
    OFFLOAD = "offload"


# name -> what it keeps for the backward (the table of the module docstring)
POLICIES = {
    "none": "every residual (no recomputation)",
    "full": "nothing but the function's inputs",
    "dots": "every matmul output",
    "dots_no_batch": "matmul outputs without batch dimensions (projections, not QK^T / PV)",
    "names:<tag>[,<tag>...]": "only the values tagged with checkpoint_name(x, tag)",
    "offload:<tag>[,<tag>...]": "the tagged values, in pinned host memory",
    "offload": "jaxmem's default offload tags, in pinned host memory",
}


def policy(name: Remat | str) -> Callable[..., bool]:
    """The `jax.checkpoint` policy called `name` (see the module docstring for each name).

    Args:
      name: a `Remat` member or its string ("none", "full", "dots", "dots_no_batch",
        "offload"), or "names:<tag>[,<tag>...]" / "offload:<tag>[,<tag>...]" with the tags
        given to `jax.ad_checkpoint.checkpoint_name` inside the checkpointed function.

    Returns:
      A policy for `jax.checkpoint(fn, policy=...)` / `flax.linen.remat(..., policy=...)`
      (always a callable: "none" is everything_saveable, "full" nothing_saveable).

    Raises:
      ValueError naming `name`: an unknown policy, or "names:" / "offload:" without tags.

    Example:
      >>> import jax, jax.numpy as jnp, jaxmem
      >>> f = jax.checkpoint(lambda x, w: jnp.sum(jnp.tanh(x @ w) @ w),
      ...                    policy=jaxmem.remat.policy("dots"))
      >>> jax.grad(f, 1)(jnp.ones((2, 3)), jnp.eye(3)).shape
      (3, 3)
    """
    cp = jax.checkpoint_policies
    text = name.value if isinstance(name, Remat) else str(name).strip()
    head, sep, tail = text.partition(":")
    if not sep:
        simple = {"none": cp.everything_saveable, "full": cp.nothing_saveable,
                  "dots": cp.checkpoint_dots,
                  "dots_no_batch": cp.dots_with_no_batch_dims_saveable}
        if head in simple:
            return simple[head]
        if head == "offload":
            return _offload(DEFAULT_OFFLOAD_TAGS)
    elif head in ("names", "offload"):
        tags = tuple(t.strip() for t in tail.split(",") if t.strip())
        if not tags:
            raise ValueError(f"remat policy: name {text!r} gives no tags after '{head}:'")
        return cp.save_only_these_names(*tags) if head == "names" else _offload(tags)
    raise ValueError(f"remat policy: unknown name {text!r}; valid: {', '.join(POLICIES)}")


def _offload(tags: tuple[str, ...]):
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=list(tags),
        offload_src="device", offload_dst="pinned_host")
