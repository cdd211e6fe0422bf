"""Packed rows' causal attention on GPUs without a [T, T] mask: jax's Pallas flash attention.

    packed_flash_attention(q, k, v, segment_ids)   q [B, T, N, H], k, v [B, T, K, H], ids [B, T]
    pallas_unsupported(q_shape, kv_shape)          "" where it applies, else why not

cuDNN through `jax.nn.dot_product_attention` takes no segment ids (jax 0.10.2: only
query/key-value sequence lengths, one prefix per row; the packed q/kv-offset layout is in the
private `jax._src.cudnn.fused_attention_stablehlo`), so packed rows handed to cuDNN a dense
[B, 1, T, T] mask, which jax turns into a bf16 bias: quadratic in T (measured on the deviceless
H100 compiler, forward + backward of one layer's attention, B=1, N=32, H=128: temp 0.38 GiB at
T=8192, 1.25 GiB at 16,384, with pred/bf16 [T, T] buffers in the optimized HLO).
`jax.experimental.pallas.ops.gpu.attention.mha` (jax 0.10.2 and 0.11) is a flash kernel with
segment ids, a causal mask and its own backward (custom_vjp, Triton kernels): the same measure
gives 0.127 GiB at 8192 and 0.254 GiB at 16,384, no [T, T] buffer. It is taken for packed rows
on GPUs; unpacked rows keep cuDNN (faster, and already flash). Not taken: tokamax 0.0.12 (on
the package index, jax >= 0.9.2): its public `dot_product_attention` takes a dense [.., T, S]
`mask`, no segment ids, and it would add pydantic, qwix, jaxtyping and einshape.

Semantics: the kernel's mask is causal AND seg_q == seg_kv, without jaxmem's seg_kv != 0: padding
queries (id 0) attend to earlier padding keys instead of to nothing. Real tokens never attend to
another segment or to padding, and padding outputs are masked out of the loss, so losses and
gradients are those of `layers.segment_mask`. GQA: k, v are repeated to N heads (head n reads
kv head n // G, as the XLA path's [K, G] split), [B, T, N, H] each: linear in T.
"""

from __future__ import annotations

import jax.numpy as jnp

try:  # jax.experimental: guarded, a jax without it falls back to the dense mask
    from jax.experimental.pallas.ops.gpu import attention as _pallas
except ImportError:  # pragma: no cover
    _pallas = None

BLOCK = 128  # the kernel's default query/key block: T is padded up to a multiple of it


def pallas_unsupported(q_shape, kv_shape) -> str:
    """Why `packed_flash_attention` does not apply to q [B, T, N, H], k, v [B, S, K, H] ("" if
    it does)."""
    if _pallas is None or not hasattr(_pallas, "mha"):
        return "jax.experimental.pallas.ops.gpu.attention.mha is missing in this jax"
    T, S = q_shape[1], kv_shape[1]
    if T != S:
        return f"the Pallas path needs as many keys as queries (T={T}, S={S})"
    if q_shape[2] % kv_shape[2] or q_shape[3] != kv_shape[3]:
        return (f"heads {q_shape[2]} over {kv_shape[2]} kv heads, "
                f"head dims {q_shape[3]}/{kv_shape[3]}")
    return ""


def packed_flash_attention(q, k, v, segment_ids, interpret: bool = False):
    """Causal attention of packed rows, within each segment: [B, T, N, H] (see the module).

    interpret: run the kernel in Pallas' interpreter (CPU tests).
    T not a multiple of BLOCK: q, k, v are padded at the end with segment id 0 (padding), which
    no real query attends to (another segment, and later), and the padded rows are dropped."""
    T, N, H = q.shape[1:]
    pad = -T % BLOCK
    if pad:
        q, k, v = (jnp.pad(a, [(0, 0), (0, pad), (0, 0), (0, 0)]) for a in (q, k, v))
        segment_ids = jnp.pad(segment_ids, [(0, 0), (0, pad)])
    G = N // k.shape[2]
    if G > 1:
        k, v = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)  # [B, T, N, H]
    out = _pallas.mha(q, k, v, segment_ids.astype(jnp.int32), sm_scale=H ** -0.5, causal=True,
                      interpret=interpret)
    return out[:, :T]
