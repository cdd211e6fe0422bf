"""The suite's one policy for comparing fp32 results of two computations (imported by name, like
testenv.py: pytest puts tests/ on sys.path).

Two programs that compute one function in fp32 but add in a different order agree only to
rounding: jit vs eager, fused vs unfused, remat vs none, chunked vs whole, sharded vs one device,
and jaxmem vs torch / transformers / peft (another library's kernels). How far apart they land
depends on the machine: XLA:CPU picks its fusions and vector width by CPU, torch's fp32 matmuls
run in MKL, whose kernels depend on the CPU's vendor and ISA, and its reductions in ATen's
per-ISA kernels. An Intel Xeon with AMX and an AMD EPYC therefore give two different fp32 logits
for one torch model (issue 36: 1.37e-5 apart on logits reaching ~10, which failed an absolute
1e-5 that held on AMD). `tests/kernel_sweep.sh` runs every comparison under other kernels on the
developer's own machine, so a tolerance that holds on one CPU only fails there first.

The policy:

1. Where the claim is that two results are the same (a bitwise resume, a no-op wrapper, a frozen
   base that does not move), compare like with like: both jitted, the same program, and assert
   equality (`np.testing.assert_array_equal`) or the tolerance the test states for that case.
   This module does not loosen those.
2. Where the claim is that two different programs compute the same fp32 function, compare with
   `assert_reordered_fp32(got, want, terms=N)`: per array (pytrees leaf by leaf)

       |got - want| <= rtol * (|want| + max|want|),   rtol = fp32_rtol(N) = 8 * sqrt(N) * eps

   with eps = 2**-23 (fp32's machine epsilon) and N the reduction length: the number of fp32
   additions on the longest path into one compared element (`model_terms` counts it for a
   Llama-shaped config: the norms, projections, attention and MLP of every layer, the head).
   The argument: each fp32 addition rounds with a relative error of at most eps/2. Summing N
   terms in one order accumulates N such errors, each relative to a partial sum no larger (for
   the suite's normalised models) than the tensor's largest element, so a second order lands
   within N * eps * max|want| in the worst case, and within about sqrt(N/6) * eps * max|want|
   (one standard deviation) when the roundings are independent, which is what is seen. 8 *
   sqrt(N) * eps is about 20 standard deviations of that model: no machine's order should reach
   it, and it stays far below what the bugs these tests guard against give (a mixed-up norm,
   RoPE layout, mask or scale changes logits by O(1); one token's loss term dropped from a mean
   over 64 moves it ~1.5%). Because it is relative to the tensor's largest element, the small
   entries of a tensor whose rounding comes from its large summands do not fail it.
   Without `terms`, N = DEFAULT_TERMS (128, the widest single reduction of the suite's tiny
   blocks), which gives 1.08e-5.
   Measured worst cases (ratio of the difference to what the policy allows; 2-core AMD EPYC,
   jax 0.10.2, torch 2.13 with MKL, and under tests/kernel_sweep.sh's other kernels): see
   docs/testing.md.
3. What this does not cover, with its own stated tolerance in its test: comparisons after
   optimizer steps (Adam divides by sqrt(v): a near-zero gradient's rounding becomes a whole
   lr-sized step), and bf16/fp16/fp8 (their own rounding, far above fp32's).

Set JAXMEM_TEST_NUMERICS_LOG=FILE to append, for every `assert_reordered_fp32` array, the test,
the largest |got - want| and that divided by the allowed difference (how close to the tolerance a
machine comes); `python -m pytest ... ; sort -k3 -g FILE | tail` shows the closest.
"""

from __future__ import annotations

import math
import os

import numpy as np

FP32_EPS = float(np.finfo(np.float32).eps)  # 2**-23
# How many times sqrt(N) * eps the policy allows (about 20 standard deviations of independent
# roundings: see the module docstring).
SAFETY = 8.0
# N for a comparison that does not state its own: the widest single reduction in the suite's
# tiny blocks (intermediate size 128, or hidden 64 plus a 64-long attention row).
DEFAULT_TERMS = 128


def fp32_rtol(terms: int) -> float:
    """The relative tolerance (of the compared tensor's largest element) for two fp32
    computations of one function whose longest chain of additions into one element is `terms`
    long: SAFETY * sqrt(terms) * eps."""
    if terms < 1:
        raise ValueError(f"terms must be >= 1, got {terms}")
    return SAFETY * math.sqrt(terms) * FP32_EPS


FP32_REORDERED_RTOL = fp32_rtol(DEFAULT_TERMS)


def model_terms(config, seq_len: int, loss: bool = False, backward: bool = False) -> int:
    """N for a Llama-shaped model's output (logits; with `loss`, the mean token loss; with
    `backward`, its gradients): per layer the two RMSNorms (mean of hidden squares), q/k/v
    (hidden), the scores (head_dim), softmax's sum and the weighted values (seq_len each), o_proj
    (heads x head_dim), gate/up (hidden) and down (intermediate); then the final norm and the
    head (hidden each); the loss adds logsumexp over the vocabulary and the mean over tokens.
    The backward pass runs the same chain in reverse, so `backward` doubles it.

    `config` needs hidden_size, intermediate_size, num_layers, num_heads and a head dim
    (`resolved_head_dim`, `head_dim`, or hidden_size // num_heads); a transformers config's
    names (num_hidden_layers, num_attention_heads) are read too."""
    hidden = config.hidden_size
    inter = config.intermediate_size
    layers = getattr(config, "num_layers", None) or config.num_hidden_layers
    heads = getattr(config, "num_heads", None) or config.num_attention_heads
    head_dim = (getattr(config, "resolved_head_dim", None) or getattr(config, "head_dim", None)
                or hidden // heads)
    block = 2 * hidden + hidden + head_dim + 2 * seq_len + heads * head_dim + hidden + inter
    n = layers * block + 2 * hidden
    if loss:
        n += config.vocab_size + seq_len
    return 2 * n if backward else n


def largest_allowed(want, terms: int = DEFAULT_TERMS) -> float:
    """The largest difference the policy allows against `want` (rtol * 2 * max|want|): what a
    negative control must exceed, by a margin it states, to show the tolerance can fail."""
    return fp32_rtol(terms) * 2 * float(np.abs(np.asarray(want, np.float64)).max())


def _leaves(tree):
    import jax  # noqa: PLC0415 (conftest sets the environment before jax starts)
    return jax.tree_util.tree_leaves_with_path(tree), jax.tree_util.keystr


def assert_reordered_fp32(got, want, terms: int = DEFAULT_TERMS, err_msg: str = "",
                          rtol: float | None = None):
    """Assert that `got` equals `want` up to fp32 summation order: per array (leaf by leaf for
    pytrees of one structure; scalars too) |got - want| <= rtol * |want| + rtol * max|want|,
    rtol = fp32_rtol(terms).

    `rtol` overrides the policy only where a test states why its case needs another."""
    rtol = fp32_rtol(terms) if rtol is None else rtol
    got_leaves, keystr = _leaves(got)
    want_leaves, _ = _leaves(want)
    got_paths = [keystr(p) for p, _ in got_leaves]
    want_paths = [keystr(p) for p, _ in want_leaves]
    assert got_paths == want_paths, f"{err_msg}: arrays at {got_paths} vs {want_paths}"
    for (path, g), (_, w) in zip(got_leaves, want_leaves):
        g, w = np.asarray(g), np.asarray(w)
        where = (err_msg + " " + keystr(path)).strip()
        assert g.shape == w.shape, f"{where}: shape {g.shape} vs {w.shape}"
        w64 = w.astype(np.float64)
        atol = rtol * float(np.abs(w64).max()) if w.size else 0.0
        _log(g, w64, rtol, atol, where)
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=where)


def _log(g, w64, rtol, atol, where):
    path = os.environ.get("JAXMEM_TEST_NUMERICS_LOG")
    if not path or not w64.size:
        return
    diff = np.abs(g.astype(np.float64) - w64)
    allowed = rtol * np.abs(w64) + atol
    ratio = float(np.max(np.where(allowed > 0, diff / np.where(allowed > 0, allowed, 1),
                                  np.where(diff > 0, np.inf, 0.0))))
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
    with open(path, "a") as f:
        f.write(f"{test}[{where}] {float(diff.max()):.3g} {ratio:.3g}\n")


def assert_after_adam(got, want, steps: int, lr: float, tol: float = 1e-4,
                      few: float = 1e-4) -> None:
    """Two fp32 programs' weights after `steps` Adam-style updates of learning rate `lr` (item
    3 above): every leaf's elements within `tol` (rtol and atol) but a `few` (a share of its
    elements: 1e-4, so none in a leaf under 10,000), and those within what Adam can move an
    element in `steps` steps, steps x lr. Such an element's gradient sits at rounding level,
    where m / (sqrt(v) + eps) turns the two programs' rounding into +-lr. Seen: the in-backward
    step against the ordinary one, 1 of 65,536 head elements 1.4e-4 apart after 5 steps at lr
    1e-2 (d(x) summed over vocabulary slices in another order)."""
    (got, keystr), (want, _) = _leaves(got), _leaves(want)
    assert len(got) == len(want), (len(got), len(want))
    for (path, g), (_, w) in zip(got, want):
        g, w = np.asarray(g), np.asarray(w)
        off = ~np.isclose(g, w, rtol=tol, atol=tol)
        where = keystr(path)
        assert off.sum() <= int(g.size * few), (where, int(off.sum()), g.size)
        np.testing.assert_allclose(g[off], w[off], rtol=0, atol=steps * lr, err_msg=where)
