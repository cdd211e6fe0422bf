"""Optimizers and loss scaling for any JAX model: plain pytrees in, optax-compatible out.

    adamw_8bit(lr, ...)                       AdamW with 8-bit moments (optax transformation)
    AdamW8bitInPlace(lr, ...)                 the same AdamW as an Optimizer that updates and
                                              applies in place (its state is adamw_8bit's)
    apply_updates_sr(params, updates, key)    bf16 params without an fp32 master copy
    pieces(key, x, leaf=i)                    the stochastic-rounding keys of a leaf's pieces
    split(tx, state, params) -> Parts         one step part by part (a leaf, a layer of a
                                              stack); AdamW8bitInPlace.split the same
    DynamicLossScale.create()                 torch.amp.GradScaler's dynamic loss scale
    loss_scaled(skip_nonfinite(as_optimizer(tx)), scale)
                                              unscale, skip non-finite steps, adjust the scale

Nothing here imports jaxmem's model, trainer or CLIs (the package order is dtypes, config ->
model -> optim -> ...: docs/architecture.md).
"""

# 8-bit AdamW (Dettmers et al. 2022) and its block-wise quantization
from jaxmem.optim._blockwise import (
    BLOCK,
    SIGNED_MAP,
    UNSIGNED_MAP,
    Quantized,
    block_axes,
    block_view,
    create_dynamic_map,
    dequantize,
    quantize,
    step_salt,
)
from jaxmem.optim._adamw8bit import (
    MIN_8BIT_SIZE,
    ScaleByAdam8bitState,
    adamw_8bit,
    as_rows,
    keep_small_fp32,
    moment_pieces,
    scale_by_adam_8bit,
)

# bf16 stochastic rounding
from jaxmem.optim._stochastic import (RoundingPieces, apply_leaf_sr, apply_updates_sr, pieces,
                                      round_bf16, round_bf16_bits, rounding_chunk, row_chunks)

# Loss scaling (torch.amp.GradScaler semantics)
from jaxmem.optim._loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    all_finite,
    select_tree,
)

# Optimizers that apply their own update, and the skip / loss-scale wrappers
from jaxmem.optim._apply import (
    LossScaledState,
    Optimizer,
    SkipNonFiniteState,
    as_optimizer,
    loss_scaled,
    skip_nonfinite,
)

# One step applied part by part (optax chains of element-wise links; AdamW8bitInPlace.split)
from jaxmem.optim._partwise import NotSplittable, Parts, split

# 8-bit AdamW updated and applied in place (the same kernel and state as adamw_8bit)
from jaxmem.optim._fused import AdamW8bitInPlace
from jaxmem.optim._inplace import apply_leaf_in_place
from jaxmem.optim._cuts import cols, in_host_memory, slab_at, to_device

__all__ = [
    # 8-bit AdamW
    "BLOCK", "MIN_8BIT_SIZE", "SIGNED_MAP", "UNSIGNED_MAP", "Quantized", "ScaleByAdam8bitState",
    "adamw_8bit", "as_rows", "block_axes", "block_view", "create_dynamic_map", "dequantize",
    "keep_small_fp32", "moment_pieces", "quantize", "scale_by_adam_8bit",
    "step_salt", "AdamW8bitInPlace", "apply_leaf_in_place",
    # stochastic rounding
    "RoundingPieces", "apply_leaf_sr", "apply_updates_sr", "pieces", "round_bf16",
    "round_bf16_bits", "rounding_chunk", "row_chunks",
    # one step part by part, and how a part is cut out and moved (the trainer's in-backward
    # step and the model's host-resident layers cut and move the same way)
    "NotSplittable", "Parts", "split", "cols", "in_host_memory", "slab_at", "to_device",
    # loss scaling
    "DynamicLossScale", "LossScale", "NoOpLossScale", "StaticLossScale", "all_finite",
    "select_tree",
    # update_and_apply optimizers and wrappers
    "LossScaledState", "Optimizer", "SkipNonFiniteState", "as_optimizer", "loss_scaled",
    "skip_nonfinite",
]
