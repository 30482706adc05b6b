"""The devices a plan can be priced on: datasheet peaks, memory and interconnect bandwidths.

One table (`DEVICES`), each number from the vendor's datasheet (docs/scaling.md, Sources,
names the document of each row). Bandwidths are per GPU and per direction, in bytes/s:
`nvlink` inside a node (NVLink through NVSwitch; the datasheets quote the bidirectional
total, halved here), `network` between nodes (one InfiniBand / RoCE NIC per GPU, as in the
DGX / HGX reference systems). The `cpu` row describes this machine: its peak is measured by
train/mfu.py's matmul probe when a plan asks for it, its memory is the host's RAM, and its
"links" are the loopback (a nominal figure: nothing of a CPU run is network bound).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from unmask.errors import InputError, did_you_mean

GB = 1e9
TB = 1e12


@dataclass(frozen=True)
class Device:
    """One accelerator's numbers; FLOP/s are dense (no structured sparsity)."""

    name: str
    label: str
    """What the numbers are for (the SKU)."""
    bf16_flops: float
    """Dense bfloat16 tensor-core peak, FLOP/s."""
    fp32_flops: float
    """float32 peak without TF32 (CUDA cores), FLOP/s."""
    memory_bytes: float
    """Device memory (HBM), bytes."""
    memory_bandwidth: float
    """HBM bandwidth, bytes/s."""
    nvlink: float
    """Bandwidth to a GPU of the same node, per direction, bytes/s."""
    network: float
    """Bandwidth to a GPU of another node, per direction, bytes/s."""
    per_node: int
    """GPUs in one node of the reference system."""

    def peak(self, bf16: bool) -> float:
        return self.bf16_flops if bf16 else self.fp32_flops


DEVICES: dict[str, Device] = {
    d.name: d
    for d in (
        # NVIDIA H100 Tensor Core GPU datasheet (SXM5): 989 TFLOP/s bf16 dense (1979 sparse),
        # 67 TFLOP/s fp32, 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s; DGX H100: 8 GPUs,
        # 8x ConnectX-7 400 Gb/s (50 GB/s) for the compute fabric
        Device("h100", "H100 SXM5 80GB", 989e12, 67e12, 80 * GB, 3.35 * TB, 450 * GB, 50 * GB, 8),
        # NVIDIA A100 datasheet (SXM4 80GB): 312 TFLOP/s bf16 dense, 19.5 fp32, 2.039 TB/s,
        # NVLink 600 GB/s; DGX A100: 8x ConnectX-6 200 Gb/s (25 GB/s)
        Device(
            "a100", "A100 SXM4 80GB", 312e12, 19.5e12, 80 * GB, 2.039 * TB, 300 * GB, 25 * GB, 8
        ),
        # NVIDIA H200 datasheet (SXM): 989 TFLOP/s bf16 dense, 67 fp32, 141 GB HBM3e at
        # 4.8 TB/s, NVLink 900 GB/s; DGX H200: 8x ConnectX-7 400 Gb/s
        Device("h200", "H200 SXM 141GB", 989e12, 67e12, 141 * GB, 4.8 * TB, 450 * GB, 50 * GB, 8),
        # NVIDIA DGX B200 datasheet: 1,440 GB HBM3e over 8 GPUs (180 GB each), 64 TB/s in
        # all (8 TB/s each), NVLink 5 1.8 TB/s per GPU, 8x ConnectX-7 400 Gb/s; HGX B200:
        # 2.25 PFLOP/s bf16 dense per GPU (4.5 sparse), 75 TFLOP/s fp32
        Device(
            "b200", "B200 (HGX/DGX) 180GB", 2.25e15, 75e12, 180 * GB, 8 * TB, 900 * GB, 50 * GB, 8
        ),
        # this machine: peak measured when asked (see cpu_device), RAM read from the OS
        Device("cpu", "this machine's CPU", 0.0, 0.0, 0.0, 20 * GB, 10 * GB, 1.25 * GB, 1),
    )
}


def host_memory_bytes() -> float:
    """Physical RAM of this machine, bytes."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0.0


def resolve_device(name: str, measured_peak=None) -> Device:
    """The table's row for `name` (case-insensitive), or a one-line InputError naming the
    known ones. `cpu`: `measured_peak(bf16: bool) -> FLOP/s` fills the peaks (the caller
    passes train/mfu.py's probe), and the memory is this machine's RAM."""
    key = name.lower()
    if key not in DEVICES:
        hint = did_you_mean(key, list(DEVICES))
        raise InputError(
            f"--device {name!r} is not a device the planner knows{hint}; use one of "
            f"{', '.join(DEVICES)}"
        )
    device = DEVICES[key]
    if key == "cpu":
        bf16 = measured_peak(True) if measured_peak else 1e11
        fp32 = measured_peak(False) if measured_peak else 1e11
        device = replace(device, bf16_flops=bf16, fp32_flops=fp32,
                         memory_bytes=host_memory_bytes())  # fmt: skip
    return device
