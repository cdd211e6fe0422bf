"""The LM head and the cross-entropy fused, in chunks: no [B, T, V] array, forward or backward.

    chunked_cross_entropy(x, w, targets, weights, chunk)  (sum of token losses, token count)
    resolve_loss_chunk(loss_chunk, B, T, config)           the chunk a step uses (0: unfused)

The public entry point is `jaxmem.loss.fused_cross_entropy` (jaxmem/loss/fused.py), which
checks its arguments and picks the chunk; this module is the kernel the train step calls.

With Llama 3's 128,256-token vocabulary the logits group (fp32 logits, exp(logits - max) kept
for the backward, dlogits: about 3 x B x T x V x 4 bytes) is larger than everything else a
remat'd step keeps. Here the final hidden states x [B, T, D] are cut along the SEQUENCE axis into
chunks [B, Tc, D] (the batch axis stays whole in every chunk, so a batch sharded over devices
stays sharded, and each chunk's logits pass the `constrain(.., "logits")` hook); a `lax.scan`
computes each chunk's fp32 logits, logsumexp and target logit and keeps only the logsumexp
[B, T] for the backward. The backward (a custom VJP) recomputes the logits a slice at a time,
forms dlogits = (softmax - onehot) * weight * g and accumulates d(x) and d(head): over
vocabulary slices [B, T, Vc] when the vocabulary has a suitable divisor (each slice of d(head)
is then written once: measured, summing a full [D, V] d(head) per sequence chunk into an fp32
accumulator held two more head-sized buffers), else over the same sequence chunks, summing
d(head) in fp32. The largest logits-shaped buffer is one chunk; the price is the head matmul
once more in the backward (the approach of Liger's
fused linear cross-entropy, Apple's Cut Cross-Entropy and Levanter's blockwise loss).

The head is multiplied with `jaxmem.model.projection.project`, so a weight object (a quantized
head; LoRA never targets the head) works as in the model; its floating leaves get gradients.
Padding: `weights` is the loss mask; a sequence not divisible by the chunk is padded with
zero-weight positions, which contribute nothing to the value or the gradients.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxmem.einsum import cpu_lacks, logits_einsum, project
from jaxmem.sharding import constrain

# `--loss-chunk` unset (auto): the fused loss is used when the head is wider than its input
# (V > D: keeping x [B, T, D] instead of logits [B, T, V] is then smaller), with chunks of the
# most sequence positions whose fp32 logits [B, Tc, V] fit in this many bytes.
AUTO_CHUNK_BYTES = 256 * 2**20


def resolve_loss_chunk(loss_chunk: int | None, batch_size: int, seq_len: int, config) -> int:
    """Sequence positions per chunk of the fused loss for this step; 0 means the unfused loss.

    loss_chunk: None (auto, the default: see AUTO_CHUNK_BYTES), 0 (off) or N > 0 (N positions).
    """
    if loss_chunk is not None:
        return min(int(loss_chunk), seq_len)
    V, D = config.vocab_size, config.hidden_size
    if V <= D:
        return 0
    return max(1, min(seq_len, AUTO_CHUNK_BYTES // (batch_size * V * 4)))


def _chunks(a: jax.Array, chunk: int) -> jax.Array:
    """[B, T, ...] -> [n, B, chunk, ...], zero-padded at the end of T to n * chunk."""
    B, T = a.shape[:2]
    n = -(-T // chunk)
    if n * chunk != T:
        a = jnp.pad(a, [(0, 0), (0, n * chunk - T)] + [(0, 0)] * (a.ndim - 2))
    return jnp.moveaxis(a.reshape(B, n, chunk, *a.shape[2:]), 1, 0)


def _unchunk(a: jax.Array, T: int) -> jax.Array:
    """[n, B, chunk, ...] -> [B, T, ...] (the padding dropped)."""
    n, B, chunk = a.shape[:3]
    return jnp.moveaxis(a, 0, 1).reshape(B, n * chunk, *a.shape[3:])[:, :T]


def _subscripts(layout: str) -> str:
    return "BTD,VD->BTV" if layout == "VD" else "BTD,DV->BTV"


def _chunk_logits(einsum, layout, xc, w):
    """One chunk's fp32 logits [B, Tc, V] (w: [D, V] or, layout "VD", [V, D])."""
    logits = project(_subscripts(layout), xc, w, einsum)  # [B, Tc, V]
    return constrain(logits, "logits").astype(jnp.float32)


def _logsumexp(logits: jax.Array) -> jax.Array:
    """log(sum(exp(logits))) over the last axis in one pass over the logits: a reduction of
    (running max, sum of exp(x - max)) pairs, each pair rescaled to the larger max when two
    meet (the online softmax's rule). jax.nn.logsumexp reads the chunk's fp32 logits twice,
    once for the max and once for the sum: at Llama 3's vocabulary that second pass over
    [B, Tc, V] fp32 is ~1% of a 1B step on an H100 (the time model, docs/results.md). Equal to
    it up to fp32 rounding (-inf entries add nothing, as there)."""
    def merge(a, b):
        (m1, s1), (m2, s2) = a, b
        m = jnp.maximum(m1, m2)
        shift = jnp.where(m == -jnp.inf, 0.0, m)  # two empty pairs (the init) give (-inf, 0)
        return m, s1 * jnp.exp(m1 - shift) + s2 * jnp.exp(m2 - shift)

    ones = jnp.ones_like(logits)
    m, total = jax.lax.reduce((logits, ones), (jnp.float32(-jnp.inf), jnp.float32(0.0)), merge,
                              (logits.ndim - 1,))
    return m + jnp.log(total)


def _head_grads(einsum, layout, x, w, dlogits):
    """(d(x) fp32, d(head) in the head's dtype) of one chunk's or slice's logits, given their
    fp32 cotangent `dlogits` [B, T, V']: the head's two backward GEMMs.

    With the library's head einsum (`logits_einsum`) and an array head, both GEMMs take
    dlogits rounded to the compute dtype, as the forward's operands are, and accumulate in
    fp32. Autodiff's transpose of that fp32-output dot instead upcasts its bf16 operand, so
    both backward GEMMs ran in fp32 (TF32 on a GPU: half the bf16 rate; jaxmem.xla.kernels),
    and d(x) was rounded to bf16 before the fp32 sum over slices; here d(x) leaves its GEMM in
    fp32 and the caller's sum becomes that GEMM's epilogue. In an fp32 policy nothing is
    rounded. Any other einsum, a weight object, or fp16 on XLA:CPU: jax.vjp of the forward."""
    if einsum is logits_einsum and isinstance(w, jax.Array) and not cpu_lacks(x.dtype):
        dl, wc = dlogits.astype(x.dtype), w.astype(x.dtype)
        head = "VD" if layout == "VD" else "DV"
        dx = jnp.einsum(f"BTV,{head}->BTD", dl, wc, preferred_element_type=jnp.float32)
        dw = jnp.einsum(f"BTV,BTD->{head}", dl, x, preferred_element_type=jnp.float32)
        # d(head) as autodiff gives it: the cotangent of w.astype(x.dtype), in the compute dtype
        return dx, dw.astype(x.dtype).astype(w.dtype)
    _, vjp = jax.vjp(lambda x, w: _chunk_logits(einsum, layout, x, w), x, w)
    dx, dw = vjp(dlogits)
    return dx.astype(jnp.float32), dw


def forward(chunk, einsum, layout, x, w, targets, weights):
    """(sum of weighted token losses, logsumexp [n, B, Tc]): the fused loss's forward, with
    what `over_vocab` needs (weights fp32)."""
    xs, ts, ws = _chunks(x, chunk), _chunks(targets, chunk), _chunks(weights, chunk)

    def body(total, c):
        xc, tc, wc = c  # [B, Tc, D], [B, Tc], [B, Tc]
        logits = _chunk_logits(einsum, layout, xc, w)  # [B, Tc, V]
        lse = _logsumexp(logits)  # [B, Tc]
        picked = jnp.take_along_axis(logits, tc[..., None], axis=-1)[..., 0]  # [B, Tc]
        return total + jnp.sum((lse - picked) * wc), lse

    return jax.lax.scan(body, jnp.zeros((), jnp.float32), (xs, ts, ws))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _fused_sum(chunk, einsum, layout, x, w, targets, weights):
    return forward(chunk, einsum, layout, x, w, targets, weights)[0]


def _fused_sum_fwd(chunk, einsum, layout, x, w, targets, weights):
    total, lse = forward(chunk, einsum, layout, x, w, targets, weights)
    return total, (x, w, targets, weights, lse)  # nothing [B, T, V]


def vocab_chunk(vocab: int, tokens: int) -> int:
    """The backward's vocabulary slice: the largest divisor of `vocab` whose fp32 [B, T, Vc]
    fits in AUTO_CHUNK_BYTES, or 0 when only small divisors do (then the backward runs over
    sequence chunks and sums d(head) over them instead)."""
    target = max(1, AUTO_CHUNK_BYTES // (tokens * 4))
    best = max((d for d in range(1, min(vocab, target) + 1) if vocab % d == 0), default=0)
    return best if best * 8 >= min(vocab, target) else 0


def over_vocab(einsum, layout, x, targets, weights, lse, g, vc: int, vocab: int, read, write,
               carry):
    """The fused loss's backward over vocabulary slices [start, start + vc) of the head, with
    the head's gradient handed over a slice at a time: (d(x) [B, T, D], carry).

    read(carry, start) -> the head's slice ([D, vc] or, layout "VD", [vc, D]: the head's own
    layout); write(carry, start, d slice) -> carry, the slice's gradient in the slice's dtype.
    `lse` is the forward's logsumexp ([n, B, Tc] chunks), `g` the cotangent of the loss sum.
    d(x) is summed in fp32 over the slices. Reading each slice from the carry lets `write`
    update the head in place: the slices not yet written still hold the weights as they were."""
    T = x.shape[1]
    lse = _unchunk(lse, T)  # [B, T]
    wg = weights * g  # [B, T]

    def body(state, start):
        dx, carry = state
        wc = read(carry, start)
        probs = jnp.exp(_chunk_logits(einsum, layout, x, wc) - lse[..., None])  # [B, T, Vc]
        onehot = (targets[..., None] == start + jnp.arange(vc)).astype(jnp.float32)
        dxc, dwc = _head_grads(einsum, layout, x, wc, (probs - onehot) * wg[..., None])
        return (dx + dxc, write(carry, start, dwc)), None  # [B, T, D] fp32, like the slice

    init = (jnp.zeros(x.shape, jnp.float32), carry)
    (dx, carry), _ = jax.lax.scan(body, init, jnp.arange(0, vocab, vc))
    return dx.astype(x.dtype), carry


def _bwd_over_vocab(einsum, layout, x, w, targets, weights, lse, g, vc):
    """(dx, dw) scanning vocabulary slices of w ([D, Vc] or [Vc, D], in w's own layout: a
    slice of a transposed view made XLA materialize the transpose, a head-sized copy): each
    slice of d(head) is written once into its place (an in-place dynamic_update_slice of the
    loop carry, in w's dtype), d(x) [B, T, D] is summed in fp32. No head-sized accumulator and
    no per-chunk head-sized product."""
    vaxis = 0 if layout == "VD" else 1
    return over_vocab(
        einsum, layout, x, targets, weights, lse, g, vc, w.shape[vaxis],
        lambda dw, start: jax.lax.dynamic_slice_in_dim(w, start, vc, axis=vaxis),
        lambda dw, start, dwc: jax.lax.dynamic_update_slice_in_dim(
            dw, dwc.astype(w.dtype), start, axis=vaxis),
        jnp.zeros(w.shape, w.dtype))


def _fused_sum_bwd(chunk, einsum, layout, res, g):
    x, w, targets, weights, lse = res
    T = x.shape[1]
    is_array = isinstance(w, jax.Array)
    vc = vocab_chunk(w.shape[0 if layout == "VD" else 1], x.shape[0] * T) if is_array else 0
    if vc:
        return (*_bwd_over_vocab(einsum, layout, x, w, targets, weights, lse, g, vc), None, None)
    xs, ts, ws = _chunks(x, chunk), _chunks(targets, chunk), _chunks(weights, chunk)
    w_float = jax.tree_util.tree_map(lambda a: jnp.issubdtype(a.dtype, jnp.floating), w)

    def body(dw, c):
        xc, tc, wc, lc = c  # [B, Tc, D], [B, Tc], [B, Tc], [B, Tc]
        logits = _chunk_logits(einsum, layout, xc, w)  # [B, Tc, V]
        probs = jnp.exp(logits - lc[..., None])  # softmax [B, Tc, V]
        onehot = jax.nn.one_hot(tc, logits.shape[-1], dtype=jnp.float32)  # [B, Tc, V]
        dlogits = (probs - onehot) * (wc * g)[..., None]  # [B, Tc, V]
        dxc, dwc = _head_grads(einsum, layout, xc, w, dlogits)
        dw = jax.tree_util.tree_map(lambda acc, d, f: acc + d.astype(jnp.float32) if f else acc,
                                    dw, dwc, w_float)
        return dw, dxc.astype(xc.dtype)

    dw0 = jax.tree_util.tree_map(lambda a, f: jnp.zeros(a.shape, jnp.float32 if f else a.dtype),
                                 w, w_float)
    dw, dxs = jax.lax.scan(body, dw0, (xs, ts, ws, lse))
    dw = jax.tree_util.tree_map(
        lambda d, a, f: d.astype(a.dtype) if f else jnp.zeros(a.shape, jax.dtypes.float0),
        dw, w, w_float)
    return _unchunk(dxs, T).astype(x.dtype), dw, None, None


_fused_sum.defvjp(_fused_sum_fwd, _fused_sum_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _fused_tokens(chunk, einsum, layout, x, w, targets):
    return _fused_tokens_fwd(chunk, einsum, layout, x, w, targets)[0]


def _fused_tokens_fwd(chunk, einsum, layout, x, w, targets):
    xs, ts = _chunks(x, chunk), _chunks(targets, chunk)

    def body(_, c):
        xc, tc = c  # [B, Tc, D], [B, Tc]
        logits = _chunk_logits(einsum, layout, xc, w)  # [B, Tc, V]
        lse = _logsumexp(logits)  # [B, Tc]
        picked = jnp.take_along_axis(logits, tc[..., None], axis=-1)[..., 0]  # [B, Tc]
        return None, (picked - lse, lse)

    _, (logps, lse) = jax.lax.scan(body, None, (xs, ts))
    return _unchunk(logps, x.shape[1]), (x, w, targets, lse)


def _fused_tokens_bwd(chunk, einsum, layout, res, g):
    # d(-logp)/d(logits) is the cross-entropy's (softmax - onehot): the sum's backward with the
    # per-token cotangent -g [B, T] as the weights and a unit cotangent
    x, w, targets, lse = res
    dx, dw, _, _ = _fused_sum_bwd(chunk, einsum, layout, (x, w, targets, -g, lse),
                                  jnp.ones((), jnp.float32))
    return dx, dw, None


_fused_tokens.defvjp(_fused_tokens_fwd, _fused_tokens_bwd)


def chunked_token_logps(x: jax.Array, w, targets: jax.Array, chunk: int,
                        einsum=logits_einsum, layout: str = "DV") -> jax.Array:
    """Each target's log-probability [B, T] (fp32) under the head, without [B, T, V] logits:
    the per-token form of `chunked_cross_entropy` (same arguments, no weights: the caller
    weighs and sums, e.g. a preference objective's per-sequence sums, jaxmem.objective).
    Equal to `take_along_axis(log_softmax(project('BTD,DV->BTV', x, W)), targets)`."""
    if chunk <= 0:
        raise ValueError(f"chunked_token_logps: chunk must be positive, got {chunk}")
    if layout not in ("DV", "VD"):
        raise ValueError(f"chunked_token_logps: layout must be 'DV' or 'VD', got {layout!r}")
    return _fused_tokens(int(chunk), einsum, layout, x, w, targets)


def chunked_cross_entropy(x: jax.Array, w, targets: jax.Array, weights: jax.Array, chunk: int,
                          einsum=logits_einsum, layout: str = "DV"):
    """(sum of token losses, number of weighted tokens), both fp32, without [B, T, V] logits.

    x [B, T, D] final hidden states (after the final norm), w the head: layout "DV", [D, V] (an
    array or a weight object, e.g. the untied lm_head), or "VD", [V, D] (an array: the tied
    embedding itself, not its transpose); targets [B, T] int, weights [B, T] in {0, 1}; chunk:
    sequence positions per chunk (the last chunk is padded with zero weights).
    Equal to `cross_entropy(project('BTD,DV->BTV', x, W, einsum), targets, weights)`, W = [D, V].
    """
    if chunk <= 0:
        raise ValueError(f"chunked_cross_entropy: chunk must be positive, got {chunk}")
    if layout not in ("DV", "VD"):
        raise ValueError(f"chunked_cross_entropy: layout must be 'DV' or 'VD', got {layout!r}")
    w32 = weights.astype(jnp.float32)
    return _fused_sum(int(chunk), einsum, layout, x, w, targets, w32), jnp.sum(w32)
