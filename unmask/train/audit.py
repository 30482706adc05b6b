"""Audits of what a training step asks of the hardware, for tests and the GPU benchmark:
the matmul FLOPs it runs in each dtype (`MatmulAudit`) and the operations that make the
host wait for a CUDA device (`SyncAudit`).

Both are `TorchDispatchMode`s: they see every aten call below autocast (so a matmul's
dtype is the one it really ran in) and record without changing anything. They run the same
on a CPU, so a test can find on a laptop what a GPU run would pay for: a float32 GEMM runs
on CUDA cores at a fifteenth of the bf16 tensor-core rate, and a sync drains the launch
queue, leaving the GPU idle while the host enqueues the next kernels.

A sync counted here is an operation that, on a CUDA tensor, returns a value the host must
wait for (`.item()`, a data-dependent shape such as `nonzero` or boolean indexing) or
copies to the host. On a CPU run every tensor is a host tensor, so the audit cannot tell
the step's device tensors from its host ones by their device; reads the code makes of
host memory on purpose (a pinned copy made earlier in the stream, unmask/host.py, or a
count kept on the CPU) are wrapped in `host_read()` and not counted.
"""

from __future__ import annotations

import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from unmask.host import in_host_read as _in_host_read

aten = torch.ops.aten
_PACKAGE = str(Path(__file__).resolve().parents[1])


def call_site() -> str:
    """The innermost unmask frame of the current Python stack: "unmask/x.py:123 func"."""
    for frame in reversed(traceback.extract_stack()):
        if frame.filename.startswith(_PACKAGE) and not frame.filename.endswith("audit.py"):
            where = Path(frame.filename).relative_to(Path(_PACKAGE).parent)
            return f"{where}:{frame.lineno} {frame.name}"
    return "(outside unmask)"


# ------------------------------------------------------------------------ matmul FLOPs


def _grouped_mm_flops(a: torch.Tensor, b: torch.Tensor) -> int:
    """torch._grouped_mm: 2-D x 3-D (rows split into groups by offsets, one weight each),
    2-D x 2-D (the reduced dim split into groups: a weight gradient per group), 3-D x 3-D
    (a batch). 2 x the multiply-adds in every case."""
    if a.dim() == 2 and b.dim() == 3:
        return 2 * a.shape[0] * a.shape[1] * b.shape[2]
    if a.dim() == 2 and b.dim() == 2:
        return 2 * a.shape[0] * a.shape[1] * b.shape[1]
    if a.dim() == 3 and b.dim() == 2:
        return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[1] // max(1, b.shape[0])
    return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]


def _matmul(func, args, out) -> tuple[int, torch.dtype] | None:
    """(FLOPs, input dtype) of a matmul-like aten call, None for anything else: 2 x the
    multiply-adds of mm / addmm / bmm / baddbmm (their in-place and out_dtype forms too)
    and of grouped GEMMs; torch's flop_counter formulas for attention kernels, float8
    scaled GEMMs and flex attention, mapped onto the CPU attention kernels it lacks."""
    packet = func._overloadpacket
    if packet in (aten.mm, aten.addmm, aten.addmm_):
        a, b = args[-2], args[-1]
        return 2 * a.shape[0] * a.shape[1] * b.shape[1], a.dtype
    if packet in (aten.bmm, aten.baddbmm, aten.baddbmm_):
        a, b = args[-2], args[-1]
        return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2], a.dtype
    if packet is aten._grouped_mm:
        return _grouped_mm_flops(args[0], args[1]), args[0].dtype
    if packet is aten._scaled_dot_product_flash_attention_for_cpu:
        q, k, v = args[:3]
        return sdpa_flop_count(q.shape, k.shape, v.shape), q.dtype
    if packet is aten._scaled_dot_product_flash_attention_for_cpu_backward:
        grad, q, k, v = args[:4]
        return sdpa_backward_flop_count(grad.shape, q.shape, k.shape, v.shape), q.dtype
    if packet in flop_registry:  # CUDA attention kernels, _scaled_mm (float8), flex
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        dtype = tensors[0].dtype if tensors else torch.float32
        return int(flop_registry[packet](*args, out_val=out)), dtype
    return None


@dataclass
class MatmulRecord:
    op: str
    dtype: torch.dtype
    shapes: tuple
    flops: int
    site: str


class MatmulAudit(TorchDispatchMode):
    """Every matmul-like call (mm, addmm, bmm, baddbmm, grouped GEMMs, attention kernels,
    float8 scaled GEMMs) with its input dtype, shapes, FLOPs and the unmask line that made
    it (sites only when `sites`, which costs a stack walk per call)."""

    def __init__(self, sites: bool = False):
        super().__init__()
        self.records: list[MatmulRecord] = []
        self.sites = sites

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        found = _matmul(func, args, out)
        if found is not None:
            flops, dtype = found
            shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
            site = call_site() if self.sites else ""
            self.records.append(MatmulRecord(func._overloadpacket.__name__, dtype, shapes,
                                             flops, site))  # fmt: skip
        return out

    def flops_by_dtype(self) -> dict[torch.dtype, int]:
        by: Counter = Counter()
        for record in self.records:
            by[record.dtype] += record.flops
        return dict(by)

    @property
    def total(self) -> int:
        return sum(record.flops for record in self.records)

    def share(self, dtype: torch.dtype) -> float:
        """The share of all matmul FLOPs that ran in `dtype`."""
        return self.flops_by_dtype().get(dtype, 0) / max(1, self.total)

    def largest(self, dtype: torch.dtype, count: int = 5) -> list[MatmulRecord]:
        """The `count` biggest calls in `dtype` (what to fix first)."""
        mine = [r for r in self.records if r.dtype == dtype]
        return sorted(mine, key=lambda r: -r.flops)[:count]


# ------------------------------------------------------------------------------- syncs

#: aten ops whose CUDA kernels return data-dependent shapes or host values: the host waits
SYNCING = {
    aten.nonzero, aten._local_scalar_dense, aten.masked_select, aten.bincount, aten._unique,
    aten._unique2, aten.unique_dim, aten.unique_consecutive, aten.unique_dim_consecutive,
    aten.histogram, aten.equal, aten.is_nonzero, aten.item,
}  # fmt: skip


def _syncs(func, args, kwargs) -> str | None:
    """Why this aten call makes the host wait for a CUDA device, or None."""
    packet = func._overloadpacket
    if packet in SYNCING:
        return packet.__name__
    if packet is aten.repeat_interleave and kwargs.get("output_size") is None:
        if len(args) > 1 and isinstance(args[1], torch.Tensor):
            return "repeat_interleave without output_size"
    if packet in (aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_):
        indices = args[1] if len(args) > 1 else []
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or []):
            return f"{packet.__name__} with a boolean mask"
    if packet in (aten._to_copy, aten.copy_, aten.to):
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cpu":
            source = args[0]
            if isinstance(source, torch.Tensor) and source.device.type != "cpu":
                return "copy to the host"
    return None


class SyncAudit(TorchDispatchMode):
    """The calls that would make the host wait for a CUDA device: syncing aten ops (see
    `SYNCING`, boolean indexing, repeat_interleave without output_size, copies to the host)
    and `Tensor.tolist` / `.cpu()` / `.numpy()` (which on a CPU tensor dispatch nothing),
    each with the unmask line that made it (`found`: (why, where)); reads inside
    `host_read()` left out."""

    def __init__(self):
        super().__init__()
        self.found: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        why = None if _in_host_read() else _syncs(func, args, kwargs)
        if why is not None:
            self.found.append((why, call_site()))
        return func(*args, **kwargs)

    def __enter__(self):
        self._patched = []
        for name in ("tolist", "cpu", "numpy"):
            original = getattr(torch.Tensor, name)

            def counting(tensor, *args, _name=name, _original=original, **kwargs):
                if not _in_host_read():
                    self.found.append((f"Tensor.{_name}", call_site()))
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, counting)
            self._patched.append((name, original))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._patched:
            setattr(torch.Tensor, name, original)
        return super().__exit__(*exc)

    def summary(self) -> Counter:
        """(why, where) -> count."""
        return Counter(self.found)
