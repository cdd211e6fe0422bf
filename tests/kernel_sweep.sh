#!/usr/bin/env bash
# See other machines' kernels from your own: run every test that compares fp32 results of two
# summation orders, or runs torch (the `reordered` marker, tests/conftest.py), under kernels that
# add in another order than this machine's defaults, so that a tolerance that holds on one CPU
# only fails here first (issue 36: torch's fp32 logits on an Intel Xeon with AMX differed from
# an AMD EPYC's by more than an absolute 1e-5). Each variant changes both libraries at once:
#
#   a: torch: ONEDNN_MAX_CPU_ISA=AVX2, MKL_CBWR=COMPATIBLE (MKL's vendor-neutral sgemm instead
#      of the CPU's own) and ATEN_CPU_CAPABILITY=default (ATen's scalar reductions, softmax,
#      norms); XLA:CPU: --xla_cpu_max_isa=SSE4_2 (128-bit vectors).
#   b: torch: ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 (what tests/testenv.py sets on an AMX CPU) and
#      ATEN_CPU_CAPABILITY=avx2; XLA:CPU: LLVM's default optimization (JAXMEM_TEST_LLVM_OPT=1,
#      vectorized reductions) instead of the suite's -O0.
#
# Measured on a 2-core AMD EPYC (2026-11-26, torch 2.13 CPU with MKL, jax 0.10.2; a 64x1000 @
# 1000x300 fp32 matmul and row sums of 4096): MKL_CBWR=COMPATIBLE, ATEN_CPU_CAPABILITY=default,
# --xla_cpu_max_isa=SSE4_2 and JAXMEM_TEST_LLVM_OPT=1 each change the results' low bits (another
# order); ONEDNN_MAX_CPU_ISA changes no fp32 result (torch's fp32 matmul is MKL's, not oneDNN's),
# and is swept because the issue names it and it decides torch's bf16 kernels.
#
# Run by .ci/run after the main suite (the fast tests: 1:50 to 2:05 on 2 cores, both variants),
# and by hand: `bash tests/kernel_sweep.sh [extra pytest args]` in the project's
# venv. Each variant writes how close every comparison came to tests/numerics.py's tolerance
# (JAXMEM_TEST_NUMERICS_LOG) and prints the five closest.
set -euo pipefail
cd "$(dirname "$0")/.."

log_dir=$(mktemp -d)
status=0
xla_isa=()
if [ "$(uname -m)" = "x86_64" ]; then
    xla_isa=(XLA_FLAGS="${XLA_FLAGS:-} --xla_cpu_max_isa=SSE4_2")
fi

variant() {
    local name=$1; shift
    echo "kernel sweep $name: $*"
    if ! env "$@" JAXMEM_TEST_NUMERICS_LOG="$log_dir/$name.log" \
            python -m pytest -q -m reordered -p no:cacheprovider "${extra[@]}"; then
        status=1
    fi
    if [ -s "$log_dir/$name.log" ]; then
        echo "kernel sweep $name: the closest comparisons (test, largest |got - want|, its share of the tolerance):"
        sort -k3 -g "$log_dir/$name.log" | tail -5
    fi
}

extra=("$@")
variant a ONEDNN_MAX_CPU_ISA=AVX2 MKL_CBWR=COMPATIBLE ATEN_CPU_CAPABILITY=default "${xla_isa[@]}"
variant b ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 ATEN_CPU_CAPABILITY=avx2 JAXMEM_TEST_LLVM_OPT=1
rm -rf "$log_dir"
exit $status
