"""Context parallelism (Ulysses) on real gloo processes against one process.

One torchrun launch of 2 processes (dist_workers/context_worker.py) runs the native model's
forward and backward with each rank holding half of every row; the reference is the same
model on whole rows in this process.
"""

import sys

import pytest
import torch
from launch import WORKERS, torchrun

sys.path.insert(0, str(WORKERS))
import context_worker as worker  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def cp2(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp")
    torchrun(2, WORKERS / "context_worker.py", out, timeout=240)
    return torch.load(out / "cp2.pt")


def test_all_to_alls_move_heads_and_back(cp2):
    assert cp2["seq_to_heads"] == {"equal": True, "round_trip": True}


@pytest.mark.parametrize("case", list(worker.CASES))
def test_losses_and_gradients_match_one_process(cp2, case):
    """varlen (one sdpa call per document, no L x L mask) under cp=2 against one process
    with sdpa's dense document mask; the other backends against themselves."""
    heads, kv, packed, backend = worker.CASES[case]
    reference = "sdpa" if backend == "varlen" else backend
    ref = worker.run_case(worker.make_model(heads, kv, reference), worker.make_batch(packed), None)
    got = cp2[case]
    assert got["losses"].shape == ref["losses"].shape == (2, worker.LENGTH)
    torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-5, atol=1e-6)
    assert set(got["grads"]) == set(ref["grads"])
    for name, grad in ref["grads"].items():
        rel = ((got["grads"][name] - grad).norm() / grad.norm()).item()
        assert rel <= 1e-5, (name, rel)
