"""Remat (activation checkpointing) policies by name, for `jax.checkpoint` and Flax's `nn.remat`.

    f = jax.checkpoint(f, policy=jaxmem.remat.policy("dots"))
    Block = nn.remat(Block, policy=jaxmem.remat.policy("names:attn_out,mlp_out"))

The names are the ones `python -m jaxmem.train --remat` and `python -m jaxmem.memory` take, parsed
here once (`RematPolicy.parse`; the trainer's jaxmem.model.remat.RematPolicy accepts only jaxmem's
own activation tags); here they work on any function, with the user's own tags
(`checkpoint_name(x, "attn_out")` inside it):

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
    offload         offload jaxmem's default tags (DEFAULT_OFFLOAD_TAGS: block_input, query,
                    key, value, attn_context, mlp_gate, mlp_up)

Whether a policy saves memory is a measurement: compile the gradient and read
`compiled.memory_analysis().temp_size_in_bytes` (docs/remat.md measures jaxmem's decoder).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, ClassVar

import jax
from jax.ad_checkpoint import checkpoint_name

__all__ = ["DEFAULT_OFFLOAD_TAGS", "POLICIES", "Remat", "RematError", "RematPolicy",
           "checkpoint_name", "policy"]

# What `offload` moves to host when no tags are given: the big per-token matmul outputs of a
# decoder block, by the tags jaxmem's decoder gives them (jaxmem.model.remat.TAGS).
DEFAULT_OFFLOAD_TAGS = ("block_input", "query", "key", "value", "attn_context", "mlp_gate",
                        "mlp_up")


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
    "offload": "jaxmem's default offload tags, in pinned host memory",
    "names:<tag>[,<tag>...]": "only the values tagged with checkpoint_name(x, tag)",
    "offload:<tag>[,<tag>...]": "the tagged values, in pinned host memory",
}


class RematError(ValueError):
    """An unknown or unsupported remat policy."""


@dataclass(frozen=True)
class RematPolicy:
    """A remat policy parsed from its name (the grammar of the module docstring).

    kind: one of none, full, dots, dots_no_batch, names, offload.
    names: the tags saved on the device (kind `names`) or offloaded to pinned host memory (kind
        `offload`; `DEFAULT_OFFLOAD_TAGS` when the name gives none).

    `str(policy)` is its name again (`offload` for the default tags), so
    `RematPolicy.parse(str(p)) == p`. `known_tags` is the tags `parse` accepts (None: any); a
    subclass narrows it to a model's own (jaxmem.model.remat.RematPolicy).
    """

    kind: str = "none"
    names: tuple[str, ...] = ()
    known_tags: ClassVar[tuple[str, ...] | None] = None

    @classmethod
    def parse(cls, spec: "str | Remat | RematPolicy") -> "RematPolicy":
        """The policy called `spec`; raises RematError naming it (an unknown name, no tags after
        `names:` / `offload:`, or a tag outside `known_tags`)."""
        if isinstance(spec, cls):
            return spec
        text = spec.value if isinstance(spec, Remat) else str(spec).strip()
        head, sep, tail = text.partition(":")
        if not sep and head in {m.value for m in Remat}:
            return cls(head, DEFAULT_OFFLOAD_TAGS if head == "offload" else ())
        if sep and head in ("names", "offload"):
            names = tuple(n.strip() for n in tail.split(",") if n.strip())
            if not names:
                raise RematError(f"remat policy {text!r} gives no tags after '{head}:'")
            known = cls.known_tags
            unknown = [n for n in names if known is not None and n not in known]
            if unknown:
                raise RematError(f"remat policy {text!r}: unknown tag(s) {unknown}; "
                                 f"valid tags: {', '.join(known)}")
            return cls(head, names)
        raise RematError(f"unknown remat policy {text!r}; valid: {', '.join(POLICIES)}")

    def __str__(self) -> str:
        if self.kind == "names" or (self.kind == "offload" and self.names != DEFAULT_OFFLOAD_TAGS):
            return f"{self.kind}:{','.join(self.names)}"
        return self.kind

    @property
    def enabled(self) -> bool:
        return self.kind != "none"

    @property
    def saves_dots(self) -> bool:
        """Whether the policy keeps what the matmuls read (`none`: everything; `dots`,
        `dots_no_batch`), so a weight object's own inputs (LoRA's x A) are kept too."""
        return self.kind in ("none", "dots", "dots_no_batch")

    @property
    def saves_batched_dots(self) -> bool:
        """Whether the dots with batch dimensions (attention's) are kept too (`none`, `dots`)."""
        return self.kind in ("none", "dots")

    @property
    def recomputes_all(self) -> bool:
        """`full`: nothing inside the function is kept; its backward recomputes all of it."""
        return self.kind == "full"

    @property
    def kept_tags(self) -> tuple[str, ...]:
        """The tags a `names:` policy keeps on the device (other kinds name none)."""
        return self.names if self.kind == "names" else ()

    @property
    def offloaded_tags(self) -> tuple[str, ...]:
        """The tags an `offload` policy moves to pinned host memory (other kinds: none)."""
        return self.names if self.kind == "offload" else ()

    def checkpoint_policy(self) -> Callable[..., bool]:
        """The `jax.checkpoint` policy: always a callable ("none" is everything_saveable,
        "full" nothing_saveable); an offload policy compiles only where the device has a
        `pinned_host` memory space."""
        cp = jax.checkpoint_policies
        if self.kind == "names":
            return cp.save_only_these_names(*self.names)
        if self.kind == "offload":
            return cp.save_and_offload_only_these_names(
                names_which_can_be_saved=[], names_which_can_be_offloaded=list(self.names),
                offload_src="device", offload_dst="pinned_host")
        return {"none": cp.everything_saveable, "full": cp.nothing_saveable,
                "dots": cp.checkpoint_dots,
                "dots_no_batch": cp.dots_with_no_batch_dims_saveable}[self.kind]


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
      RematError (a ValueError) naming `name`: an unknown policy, or "names:" / "offload:"
      without tags.

    Example:
      >>> import jax, jax.numpy as jnp, jaxmem
      >>> f = jax.checkpoint(lambda x, w: jnp.sum(jnp.tanh(x @ w) @ w),
      ...                    policy=jaxmem.remat.policy("dots"))
      >>> jax.grad(f, 1)(jnp.ones((2, 3)), jnp.eye(3)).shape
      (3, 3)
      >>> str(jaxmem.remat.RematPolicy.parse(" names: up , act "))
      'names:up,act'
    """
    return RematPolicy.parse(name).checkpoint_policy()
