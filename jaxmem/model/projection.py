"""The projection layer: the one module that owns a weight matrix and multiplies by it.

Every matmul by a parameter goes through `Projection` (q/k/v/o_proj, gate/up/down_proj, the
untied LM head), so a change to how weights are stored or multiplied is made here, not in the
model: fp8 matmuls are an `einsum` (jaxmem.model.fp8.fp8_einsum), and LoRA adapters or int8 / NF4
quantized bases are weight objects (below) put in the params tree in place of the array.

Parameter layout. A Projection shares its parent's Flax scope (`nn.share_scope`), so its weight
is the parent's parameter `weight_name`, e.g. params['layers']['self_attn']['q_proj'] of shape
[L, D, N, H], exactly as a plain `self.param("q_proj", ...)` in the parent would declare it.
Flax derives a parameter's init RNG from its scope path and the order of creation in that scope,
so the names, shapes and init values are those of the model before this layer existed (bitwise;
tests/test_projection.py). A child module with its own scope would have moved every weight to
['q_proj']['kernel'] and changed its init values.

Weight objects (the seam itself, `project` and the `ProjectedWeight` protocol, lives in
jaxmem.einsum, below the model: jaxmem.loss and jaxmem.lora call it too). The stored weight is either a plain array of the declared shape, or any object
with a method

    project(subscripts: str, x: jax.Array, einsum: Einsum) -> jax.Array

that computes `einsum(subscripts, x, W)` for the W it stands for (a quantized base dequantizes
and multiplies, or calls a fused kernel; LoRA adds `x A B` to the base's result). Such an object
lives in the params tree as a registered pytree; `nn.scan` slices its leaves over the layer axis
like any other param, and jaxmem.model.precision.cast_params casts only its floating leaves. Its
leaves may have any shapes (packed int4 has half the elements): the stored value is read as it
is, without Flax's check of leaf shapes against the init's, and a plain array of the wrong shape
gets an error naming the parameter and both shapes.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxmem.einsum import Einsum, ProjectedWeight, default_einsum, project
from jaxmem.sharding import constrain_weight
from jaxmem.model.layers import scaled_normal

class Projection(nn.Module):
    """y = einsum(subscripts, x, W) for the parent's parameter W named `weight_name`.

    weight_name: the parameter's name in the parent module (Hugging Face's, e.g. "q_proj").
    subscripts: the einsum, activation first, e.g. 'BTD,DNH->BTNH'.
    shape: W's shape, e.g. (D, N, H) (per layer, without the scan's leading L).
    fan_in: W is initialized N(0, fan_in^-1/2).
    einsum: how to multiply (default_einsum, fp8_einsum, logits_einsum).
    """

    weight_name: str
    subscripts: str
    shape: tuple[int, ...]
    fan_in: int
    einsum: Einsum = default_einsum

    def setup(self):
        # Use the parent's scope: the weight is the parent's param (see the module docstring).
        nn.share_scope(self.parent, self)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return project(self.subscripts, x, self.weight(), self.einsum)

    def weight(self):
        """The stored weight (created on init), read without Flax's init-shape comparison."""
        if not self.has_variable("params", self.weight_name):
            return self.param(self.weight_name, scaled_normal(self.fan_in), self.shape,
                              jnp.float32)
        w = self.get_variable("params", self.weight_name)
        if isinstance(w, nn.meta.AxisMetadata):
            w = w.unbox()
        if isinstance(w, ProjectedWeight):
            return w
        path = "/".join(str(p) for p in (*self.scope.path, self.weight_name))
        if not isinstance(w, (jax.Array, np.ndarray)):
            raise TypeError(f"param {path} is a {type(w).__name__}: neither an array nor a weight "
                            f"object with project(subscripts, x, einsum)")
        if tuple(w.shape) != tuple(self.shape):
            stacked = " (one layer's slice; stored with a leading layer axis)" if (
                "layers" in self.scope.path) else ""
            raise ValueError(f"param {path} has shape {tuple(w.shape)}, the model expects "
                             f"{tuple(self.shape)}{stacked}")
        return constrain_weight(w, path)  # its gradient placed like the weight on a mesh
