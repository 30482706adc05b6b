"""MuonAdamW on FSDP2 / HSDP DTensors (real gloo processes) against one process.

One torchrun launch per world size runs every mesh shape (dist_workers/muon_worker.py); the
reference is MuonAdamW on a plain module fed the same gradients, in this process with one
thread (torchrun's workers use one thread too, so both use the same GEMM kernels).
"""

import sys

import pytest
import torch
from launch import WORKERS, torchrun

from unmask.optim import MuonAdamW

sys.path.insert(0, str(WORKERS))
import muon_worker as worker  # noqa: E402

pytestmark = pytest.mark.slow
#: mesh shapes (2 and 4 processes, 2 x 2 HSDP), and the bf16 NS whose inputs travel as bf16
SPECS = ["2", "4", "2x2", "4:bfloat16"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("muon")
    torchrun(2, WORKERS / "muon_worker.py", out, "2", timeout=240)
    torchrun(4, WORKERS / "muon_worker.py", out, *SPECS[1:], timeout=240)
    return {spec: torch.load(out / f"{spec}.pt") for spec in SPECS}


def one_process(ns_dtype: str) -> dict[str, torch.Tensor]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        net = worker.make_net()
        opt = MuonAdamW(net, **{**worker.OPTIM, "ns_dtype": ns_dtype})
        for step in range(worker.STEPS):
            grads = worker.full_grads(net, step)
            for name, p in net.named_parameters():
                p.grad = grads[name].clone()
            opt.step()
            opt.zero_grad()
    finally:
        torch.set_num_threads(threads)
    return {n: p.detach() for n, p in net.named_parameters()}


@pytest.fixture(scope="module")
def reference():
    return {dtype: one_process(dtype) for dtype in ("float32", "bfloat16")}


@pytest.mark.parametrize("spec", SPECS)
def test_sharded_muon_equals_one_process_bitwise(results, reference, spec):
    reference = reference[spec.partition(":")[2] or "float32"]
    got = results[spec]["params"]
    assert set(got) == set(reference)
    moved = 0
    for name, value in reference.items():
        assert torch.equal(got[name], value), f"{spec}: {name} differs"
        moved += not torch.equal(value, worker.make_net().state_dict()[name])
    assert moved == len(reference)  # every parameter was updated


@pytest.mark.parametrize("spec", SPECS)
def test_newton_schulz_runs_once_per_matrix_per_step(results, spec):
    # every 2-D matrix once, plus each expert of the 3-D stack once
    per_step = len(worker.SHAPES) + worker.EXPERTS[0]
    assert results[spec]["ns_matrices"] == per_step * worker.STEPS
