"""What XLA's GPU compiler must be told so that jaxmem.model.fp8's einsums become fp8 GEMMs:
`XLA_FLAGS_FP8` (XLA_FLAGS, set before JAX starts: `set_xla_flags`) and `COMPILER_OPTIONS_FP8`
(`jax.jit(..., compiler_options=...)`: `compiler_options(precision)`).

The graph jaxmem.model.fp8 writes (`dot_general(dequant(A), dequant(B))`) alone does not give
fp8 GEMMs on an H100. The optimized HLO of the 1B step compiled for an H100
(jaxmem.target, jax 0.10.2; `python -m experiments.fp8_diag --target h100`) shows:
- with Triton GEMMs on (XLA's default), the projections become bf16 Triton GEMM fusions and no
  f8 array is left in the program: the dequantization is split from the dot, and the
  convert-to-f8-and-back pair is then removed as excess precision. The step pays the amax
  reductions and gets no fp8 GEMM;
- with `--xla_gpu_enable_triton_gemm=false` the gemm rewriter makes `__cublas$lt$matmul$f8`
  calls, but at small batches (a GEMM's operands and result under 32 MiB) XLA's dot merger first
  concatenates the dequantized q/k/v weights (and gate/up on small models) sharing the quantized
  input into one dot, which stays bf16 (the concatenation of differently scaled operands is no
  longer convert(f8) * scale);
- with both flags every projection GEMM (7 forward, the remat recompute, 2 x 7 backward) is an
  fp8 cuBLASLt call; the only bf16 GEMMs left are the LM head's.
A change here cannot avoid both: Triton's split happens to any dot of this form, and keeping the
merger off q/k/v would need one weight per merged group (different scales, different numbers).
The flags change which kernels run, not what they compute (the rewriter's GEMM computes the
graph's dot of dequantized values), and are set for fp8 runs only: jaxmem.train's CLI puts them
in XLA_FLAGS before JAX starts (`set_xla_flags`), AOT compiles pass `COMPILER_OPTIONS_FP8`.
"""

from __future__ import annotations

import os

XLA_FLAGS_FP8 = ("--xla_gpu_enable_triton_gemm=false", "--xla_gpu_dot_merger_threshold_mb=0")
COMPILER_OPTIONS_FP8 = {"xla_gpu_enable_triton_gemm": False, "xla_gpu_dot_merger_threshold_mb": 0}


def set_xla_flags(environ=None) -> bool:
    """Add `XLA_FLAGS_FP8` to XLA_FLAGS (flags already named there are left as given). XLA
    reads the variable once, when JAX's backend starts: returns False, changing nothing, when
    it has started already (then compile with `compiler_options=COMPILER_OPTIONS_FP8`)."""
    from jax._src import xla_bridge  # noqa: PLC0415  (no public probe in jax 0.10 / 0.11)
    environ = os.environ if environ is None else environ
    if getattr(xla_bridge, "_backends", None):
        return False
    flags = environ.get("XLA_FLAGS", "").split()
    names = {f.split("=")[0] for f in flags}
    environ["XLA_FLAGS"] = " ".join(flags + [f for f in XLA_FLAGS_FP8
                                             if f.split("=")[0] not in names])
    return True


def compiler_options(precision) -> dict | None:
    """`jax.jit(..., compiler_options=...)` for a program of `precision` (a Precision): under
    fp8 compiled for a GPU (a real one, or `jaxmem.target`'s), `COMPILER_OPTIONS_FP8`, so a
    library user's `jit_train_step` gets the fp8 GEMMs the CLI's XLA_FLAGS give; else None."""
    from jaxmem import target  # noqa: PLC0415
    if getattr(precision, "fp8", False) and target.platform() == "gpu":
        return dict(COMPILER_OPTIONS_FP8)
    return None
