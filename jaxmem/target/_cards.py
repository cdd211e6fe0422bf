"""The GPUs jaxmem can compile for without having one: each card's published facts, and the
device description (XLA's `stream_executor.GpuTargetConfigProto`, text format) made from them.

Sources: NVIDIA's data sheets (streaming multiprocessors, memory, bandwidth, boost clock, L2,
shared memory per SM and per block for the compute capability); `memory_bytes` is the total
memory CUDA reports for the card (cudaGetDeviceProperties' totalGlobalMem), a little under the
marketed size. For every card but the RTX 4090 the figures were checked against XLA's own target
configs (openxla/xla, xla/backends/gpu/target_config/specs/, commit 4336d12e: h100_sxm,
h100_pcie, h200, a100_sxm_80, a100_pcie_80, a6000); XLA publishes none for consumer cards or
the L40S. Their memory is what CUDA reported on such a card in published listings: the RTX
4090's 25,393,692,672 bytes in several (torch.cuda's total_memory), the L40S's 47,576,711,168 in
a deviceQuery run with ECC enabled, its default (alvarobartt/cuda-device-query's README, which
also gives its 142 SMs, 2.52 GHz and 96 MiB of L2); their other figures are NVIDIA's data
sheets and the sm_89 limits of the CUDA programming guide.

`host_link` is the PCIe link between the card and its host, with the bandwidth one transfer
direction can expect (usable, not the signalling rate): about 25 GB/s for PCIe 4.0 x16 and
50 GB/s for 5.0 x16. It bounds what offloading to pinned host memory costs per step; it is an
assumption about the host (an H100 SXM board's host link is PCIe 5.0 x16; a card in a slot of
fewer lanes or an older generation gets less), stated wherever a target is described.

What the compile takes from a card: the compute capability (which kernels exist: wgmma and TMA
on sm_90a, cuDNN flash attention on sm_80 and newer, fp8 GEMMs on sm_89 and newer), the memory
size (XLA's GPU rematerialization pass works under it), and the SM and cache figures that its
fusion and tiling heuristics read. Nothing is autotuned, so the clock and bandwidth affect no
buffer.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HostLink:
    """The card's link to its host: PCIe `gen`.0 x`lanes`, `bandwidth` bytes/s usable in one
    direction (host to device, or back)."""

    gen: int
    lanes: int
    bandwidth: float

    def describe(self) -> str:
        return f"PCIe {self.gen}.0 x{self.lanes}, ~{self.bandwidth / 1e9:g} GB/s each way"


PCIE4_X16 = HostLink(4, 16, 25e9)  # 32 GB/s raw per direction (16 GT/s x 16, 128b/130b)
PCIE5_X16 = HostLink(5, 16, 50e9)  # 64 GB/s raw per direction


@dataclass(frozen=True)
class Card:
    """One GPU model's facts, as the compiler needs them.

    name: what `--target` takes.
    device_name: the name CUDA reports (`jax.Device.device_kind` on that card).
    major, minor: compute capability; accelerated: sm_90a features (wgmma, TMA) on Hopper.
    sms: streaming multiprocessors; fp32_per_sm: fp32 lanes per SM.
    memory_bytes: total device memory as CUDA reports it.
    bandwidth: memory bandwidth, bytes/s; clock_ghz: boost clock.
    l2_bytes, smem_per_sm, smem_per_block_optin: caches and shared memory, bytes.
    threads_per_sm: resident threads per SM.
    peak_tflops: dense bf16 tensor-core TFLOP/s and fp8 (0 where the card has no fp8), for
        roofline estimates; published figures, without sparsity. The Ada cards' bf16 figure is
        with FP32 accumulation (what an XLA GEMM does): the RTX 4090's data sheet gives 330
        with FP16 accumulation and half that with FP32; the L40S's 362 (733 with sparsity) is
        its data sheet's one BF16 figure, which NVIDIA does not split by accumulator.
    host_link: the PCIe link to the host (HostLink): assumed, not read from a card.
    nvlink: NVLink bandwidth between two cards of one board, bytes/s each way per card (0: the
        cards talk over PCIe, as the PCIe and consumer models do): NVLink 4 on the H100 / H200
        SXM 450 GB/s, NVLink 3 on the A100 SXM 300 GB/s (NVIDIA's data sheets).
    """

    name: str
    device_name: str
    major: int
    minor: int
    sms: int
    fp32_per_sm: int
    memory_bytes: int
    bandwidth: float
    clock_ghz: float
    l2_bytes: int
    smem_per_sm: int
    smem_per_block_optin: int
    threads_per_sm: int
    peak_tflops: tuple[float, float]
    host_link: HostLink
    accelerated: bool = False
    nvlink: float = 0.0

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / 2**30

    def describe(self) -> str:
        """The card and the host link assumed for it, in words (the planner prints this)."""
        return (f"{self.device_name} ({self.memory_gib:.1f} GiB; host link "
                f"{self.host_link.describe()})")


CARDS: dict[str, Card] = {c.name: c for c in (
    Card("h100", "NVIDIA H100 80GB HBM3", 9, 0, 132, 128, 84_942_979_072, 3.35e12, 1.98,
         50 * 2**20, 233_472, 232_448, 2048, (989.0, 1979.0), PCIE5_X16, accelerated=True,
         nvlink=450e9),
    Card("h100-pcie", "NVIDIA H100 PCIe", 9, 0, 114, 128, 84_942_979_072, 2.04e12, 1.755,
         50 * 2**20, 233_472, 232_448, 2048, (756.0, 1513.0), PCIE5_X16, accelerated=True),
    Card("h200", "NVIDIA H200", 9, 0, 132, 128, 150_754_820_096, 4.8e12, 1.98,
         50 * 2**20, 233_472, 232_448, 2048, (989.0, 1979.0), PCIE5_X16, accelerated=True,
         nvlink=450e9),
    Card("a100", "NVIDIA A100-SXM4-80GB", 8, 0, 108, 64, 85_100_068_864, 2.04e12, 1.41,
         40 * 2**20, 167_936, 166_912, 2048, (312.0, 0.0), PCIE4_X16, nvlink=300e9),
    Card("a100-pcie", "NVIDIA A100 80GB PCIe", 8, 0, 108, 64, 85_100_068_864, 1.94e12, 1.41,
         40 * 2**20, 167_936, 166_912, 2048, (312.0, 0.0), PCIE4_X16),
    Card("a6000", "NVIDIA RTX A6000", 8, 6, 84, 128, 51_041_271_808, 7.68e11, 1.8,
         6 * 2**20, 102_400, 101_376, 1536, (155.0, 0.0), PCIE4_X16),
    Card("rtx4090", "NVIDIA GeForce RTX 4090", 8, 9, 128, 128, 25_393_692_672, 1.008e12, 2.52,
         72 * 2**20, 102_400, 101_376, 1536, (165.0, 330.0), PCIE4_X16),
    # 48 GB GDDR6 with ECC; 47,576,711,168 bytes is deviceQuery's total with ECC enabled (46068
    # MiB in nvidia-smi); 864 GB/s; 362 dense bf16 / 733 fp8 TFLOP/s (NVIDIA L40S data sheet)
    Card("l40s", "NVIDIA L40S", 8, 9, 142, 128, 47_576_711_168, 8.64e11, 2.52,
         96 * 2**20, 102_400, 101_376, 1536, (362.0, 733.0), PCIE4_X16),
)}

# The cuDNN version the description states (XLA reads it for its own cuDNN fusions); jax checks
# cuDNN attention against the cuDNN library installed with the CUDA plugin, not this.
_DNN = (9, 10, 0)
# The CUDA driver and runtime the description states. XLA enables features by them: without a
# runtime version its GEMM rewriter has no fp8 cuBLASLt GEMM and float normalization turns every
# fp8 tensor into bf16, so an fp8 step would compile with no fp8 in it.
_CUDA = ("13.0.0", "12.8.0")


def target_config(card: Card) -> str:
    """The card as `GpuTargetConfigProto` text, with only fields every supported jax parses
    (jax 0.10.2's parser rejects fields that XLA added later, e.g. collective_memory_granularity).
    """  # noqa: D401
    feature = "ACCELERATED_FEATURES" if card.accelerated else "NONE"
    dnn = ".".join(map(str, _DNN))
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {card.smem_per_sm}
  threads_per_core_limit: {card.threads_per_sm}
  core_count: {card.sms}
  fpus_per_core: {card.fp32_per_sm}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(card.bandwidth)}
  l2_cache_size: {card.l2_bytes}
  clock_rate_ghz: {card.clock_ghz}
  device_memory_size: {card.memory_bytes}
  shared_memory_per_block_optin: {card.smem_per_block_optin}
  cuda_compute_capability {{
    major: {card.major}
    minor: {card.minor}
    feature_extension: {feature}
  }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  thread_dim_limit_x: 1024
  thread_dim_limit_y: 1024
  thread_dim_limit_z: 64
  device_vendor: "NVIDIA Corporation"
  name: "{card.device_name}"
  device_address_bits: 64
  driver_version: "{_CUDA[0]}"
  runtime_version: "{_CUDA[1]}"
  compile_time_toolkit_version: "{_CUDA[1]}"
  dnn_version: "{dnn}"
}}
platform_name: "CUDA"
dnn_version_info {{
  major: {_DNN[0]}
  minor: {_DNN[1]}
  patch: {_DNN[2]}
}}
device_description_str: "{card.device_name}"
"""
