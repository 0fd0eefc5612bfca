"""Datasheet numbers of the GPUs the course talks about, with where each comes from.

Nothing here was measured by the course: these are the vendors' published figures
(NVIDIA's A100 and H100 architecture whitepapers, the H200 and T4 datasheets, and the
CUDA C++ Programming Guide's compute-capability tables).  One row is *derived*: the
aggregate shared-memory bandwidth, 32 banks x 4 bytes per clock per SM, times the SM
count and the boost clock.  Measured numbers live in ``flashlab/data/``.
"""
from __future__ import annotations

SOURCES = {
    "A100": "NVIDIA A100 Tensor Core GPU Architecture whitepaper (2020); A100 datasheet (40 GB and 80 GB SXM)",
    "H100": "NVIDIA H100 Tensor Core GPU Architecture whitepaper (2022); H100 datasheet (SXM5)",
    "H200": "NVIDIA H200 datasheet (SXM, 141 GB HBM3e); same GH100 chip as the H100 SXM5",
    "T4": "NVIDIA T4 datasheet; Turing architecture whitepaper (TU104)",
    "smem": "CUDA C++ Programming Guide: 32 banks of 4 bytes, one access per bank per clock",
}

# per GPU: SMs, boost clock (GHz), register file per SM (KiB), shared memory per SM usable by one
# block (KiB; L1 + shared combined in brackets), L2 (MB), HBM/GDDR size (GB) and bandwidth (GB/s),
# dense fp16 tensor-core and fp32 (non-tensor) TFLOP/s.
GPUS = {
    "A100 40GB": dict(sms=108, clock_ghz=1.41, regs_kib=256, smem_kib=164, l1_smem_kib=192, l2_mb=40,
                      mem_gb=40, mem_gbps=1555, fp16_tflops=312, fp32_tflops=19.5, src="A100"),
    "A100 80GB": dict(sms=108, clock_ghz=1.41, regs_kib=256, smem_kib=164, l1_smem_kib=192, l2_mb=40,
                      mem_gb=80, mem_gbps=2039, fp16_tflops=312, fp32_tflops=19.5, src="A100"),
    "H100 SXM": dict(sms=132, clock_ghz=1.98, regs_kib=256, smem_kib=228, l1_smem_kib=256, l2_mb=50,
                     mem_gb=80, mem_gbps=3350, fp16_tflops=989, fp32_tflops=67, src="H100"),
    "H200 SXM": dict(sms=132, clock_ghz=1.98, regs_kib=256, smem_kib=228, l1_smem_kib=256, l2_mb=50,
                     mem_gb=141, mem_gbps=4800, fp16_tflops=989, fp32_tflops=67, src="H200"),
    "T4": dict(sms=40, clock_ghz=1.59, regs_kib=256, smem_kib=64, l1_smem_kib=96, l2_mb=4,
               mem_gb=16, mem_gbps=320, fp16_tflops=65, fp32_tflops=8.1, src="T4"),
}


def smem_bandwidth_gbps(gpu: str) -> float:
    """Derived aggregate shared-memory bandwidth: 128 bytes per clock per SM x SMs x boost clock."""
    g = GPUS[gpu]
    return 128 * g["sms"] * g["clock_ghz"]


def hierarchy_rows(gpu: str) -> list:
    """(level, size, bandwidth) rows of the memory hierarchy table for one GPU."""
    g = GPUS[gpu]
    regs_mb = g["regs_kib"] * g["sms"] / 1024
    smem_mb = g["smem_kib"] * g["sms"] / 1024
    return [
        ("registers", f"{g['regs_kib']} KiB per SM = {regs_mb:.1f} MiB", "(feeds the cores every clock)"),
        ("shared memory (SRAM)", f"up to {g['smem_kib']} KiB per SM ({g['l1_smem_kib']} KiB with L1) "
                                 f"= {smem_mb:.1f} MiB", f"~{smem_bandwidth_gbps(gpu) / 1000:.1f} TB/s (derived)"),
        ("L2 cache", f"{g['l2_mb']} MB", "(not published as one number)"),
        ("HBM" if g["src"] != "T4" else "GDDR6", f"{g['mem_gb']} GB", f"{g['mem_gbps'] / 1000:.2f} TB/s"),
    ]


def peak_bandwidth(name: str, total_memory_bytes: float | None = None) -> float | None:
    """Datasheet memory bandwidth (bytes/s) for a device name as torch reports it; None if unknown."""
    n = name.upper()
    if "H200" in n:
        return GPUS["H200 SXM"]["mem_gbps"] * 1e9
    if "H100" in n:
        return (2000 if "PCIE" in n else GPUS["H100 SXM"]["mem_gbps"]) * 1e9
    if "A100" in n:
        big = total_memory_bytes is not None and total_memory_bytes > 50e9
        return GPUS["A100 80GB" if big else "A100 40GB"]["mem_gbps"] * 1e9
    if "T4" in n:
        return GPUS["T4"]["mem_gbps"] * 1e9
    if "L4" in n:
        return 300e9
    return None
