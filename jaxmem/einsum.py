"""The einsums and the weight-object seam, below the model: every matmul by a stored weight goes
through `project`, so a weight may be a plain array or an object that multiplies itself (a
LoRA-wrapped or a quantized weight: jaxmem.lora, jaxmem.quant). jaxmem.model's Projection layer,
the fused loss (jaxmem.loss) and LoRA's base call it; it imports nothing of theirs.

    project(subscripts, x, w, einsum)   einsum(subscripts, x, w), or w.project(subscripts, x, einsum)
    ProjectedWeight                     the protocol of such an object
    default_einsum / logits_einsum      the model's plain einsum, and the LM head's (fp32 logits)
    cpu_lacks(dtype)                    XLA:CPU has no fp16 x fp16 -> fp32 dot: upcast there
"""

from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from jaxmem import target


def cpu_lacks(dtype) -> bool:
    """XLA:CPU has no fp16 x fp16 -> fp32 dot (attention, LM head); there we upcast operands.

    Only programs for the CPU take this path (`jaxmem.target.platform()`: a compile for a GPU
    target does not), where fp16 is emulated anyway and makes no memory claim.
    """
    return jnp.dtype(dtype) == jnp.float16 and target.platform() == "cpu"


Einsum = Callable[[str, jax.Array, jax.Array], jax.Array]


def default_einsum(subscripts: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """Plain einsum in the activation dtype; jaxmem.model.fp8 supplies a drop-in fp8 version."""
    return jnp.einsum(subscripts, x, w.astype(x.dtype))


def logits_einsum(subscripts: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """The LM head's einsum: fp32 accumulation and fp32 logits whatever the compute dtype."""
    if cpu_lacks(x.dtype):
        x = x.astype(jnp.float32)
    return jnp.einsum(subscripts, x, w.astype(x.dtype), preferred_element_type=jnp.float32)


@runtime_checkable
class ProjectedWeight(Protocol):
    """A stored weight that is not a plain array (a LoRA-wrapped or quantized weight).

    `project` returns what `einsum(subscripts, x, W)` would for the dense W it represents; it
    receives the model's einsum (plain or fp8) to use for its own matmuls. It must be a
    registered pytree whose leaves carry the layer axis first, as every stacked param does.
    """

    def project(self, subscripts: str, x: jax.Array, einsum: Einsum) -> jax.Array: ...


def project(subscripts: str, x: jax.Array, w, einsum: Einsum = default_einsum) -> jax.Array:
    """`einsum(subscripts, x, w)`, or `w.project(...)` for a weight object."""
    if isinstance(w, ProjectedWeight):
        return w.project(subscripts, x, einsum)
    return einsum(subscripts, x, w)
