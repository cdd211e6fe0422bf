"""The suite's policy for comparing fp32 results of two computations (imported by name, like
testenv.py: pytest puts tests/ on sys.path).

Two programs that compute one function in fp32 but add in a different order (jit vs eager, fused
vs unfused, remat vs no remat, chunked vs whole, sharded vs one device, tiled vs untiled) agree
only to rounding, and how far depends on the machine: XLA:CPU picks its fusions and vector width
by CPU, so the same pair of programs adds in one order on one CPU and in another elsewhere.
Measured (jax 0.10.2, tests/test_remat_api.py, jit vs eager gradients of a 3-matmul MLP whose
gradients reach 7.2): on an AMD EPYC CI machine up to 2.3e-6 absolute / 4.1e-6 relative, which
failed the old element-wise rtol=atol=1e-6; on a 2-core AMD EPYC development machine 1.9e-6 with
the suite's -O0 code generation and 9.5e-7 with XLA's default (JAXMEM_TEST_LLVM_OPT=1). An
element-wise relative tolerance fails on the small elements of a tensor whose rounding error comes
from its large summands, so the tolerance is scaled to the tensor's magnitude instead.

The policy:

1. Where the claim is that two results are the same (a bitwise resume, a no-op wrapper, a frozen
   base that does not move), compare like with like: both jitted, the same program, and assert
   equality (`np.testing.assert_array_equal`) or the tolerance the test states for that case.
   This module does not loosen those.
2. Where the claim is that two different programs compute the same fp32 function, compare with
   `assert_reordered_fp32(got, want)`: per array (pytrees leaf by leaf)
   |got - want| <= FP32_REORDERED_RTOL * (|want| + max|want|), i.e. rtol = FP32_REORDERED_RTOL
   and atol = FP32_REORDERED_RTOL * max|want| of that array. 1e-5 is ~80 fp32 ulps of the
   tensor's largest element: 2.4x the worst measured difference above, and far below what the
   bugs these tests guard against give (one token's loss term dropped from a mean over 64
   tokens moves it ~1.5%; a key attended that should be masked, a chunk boundary off by one, a
   scale lost change whole rows of a result). A test whose case needs less than that says so.
3. What this does not cover, with its own stated tolerance in its test: comparisons after
   optimizer steps (Adam divides by sqrt(v): a near-zero gradient's rounding becomes a whole
   lr-sized step), bf16/fp16/fp8 (their own rounding), and parity with torch/transformers
   (another library's kernels; tests/test_torch_parity.py, test_hf_parity.py).

Set JAXMEM_TEST_NUMERICS_LOG=FILE to append, for every `assert_reordered_fp32` array, the test,
the largest |got - want| and that divided by the allowed difference (how close to the tolerance a
machine comes); `python -m pytest ... ; sort -k3 -g FILE | tail` shows the closest.
"""

from __future__ import annotations

import os

import numpy as np

# |got - want| <= FP32_REORDERED_RTOL * (|want| + max|want|) for two fp32 programs that add in a
# different order (see the module docstring for the measurements behind it).
FP32_REORDERED_RTOL = 1e-5


def _leaves(tree):
    import jax  # noqa: PLC0415 (conftest sets the environment before jax starts)
    return jax.tree_util.tree_leaves_with_path(tree), jax.tree_util.keystr


def assert_reordered_fp32(got, want, rtol: float = FP32_REORDERED_RTOL, err_msg: str = ""):
    """Assert that `got` equals `want` up to fp32 summation order: per array (leaf by leaf for
    pytrees of one structure) |got - want| <= rtol * |want| + rtol * max|want|.

    `rtol` is FP32_REORDERED_RTOL unless a test states why its case needs another."""
    got_leaves, keystr = _leaves(got)
    want_leaves, _ = _leaves(want)
    assert len(got_leaves) == len(want_leaves), (
        f"{err_msg}: {len(got_leaves)} arrays vs {len(want_leaves)}")
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
