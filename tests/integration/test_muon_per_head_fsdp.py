"""Per-head Muon under FSDP2 and tensor parallelism (2 real gloo processes) against one
process: dist_workers/muon_per_head_worker.py runs both layouts in one torchrun launch."""

import json

import pytest
from launch import WORKERS, torchrun

pytestmark = pytest.mark.slow
LAYOUTS = ["dp2", "tp2"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("muon_per_head") / "results.json"
    torchrun(2, WORKERS / "muon_per_head_worker.py", out, *LAYOUTS, timeout=240)
    return json.loads(out.read_text())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sharded_per_head_muon_equals_one_process(results, layout):
    """FSDP2 rows that cut a head in two, and TP's split by whole heads: the owner holds
    each q/k/v matrix whole and orthogonalizes it head by head, as one process does."""
    got = results[layout]
    assert got["same_names"]
    assert got["max_abs_diff"] <= 1e-6, got
    assert got["bitwise"], got  # same NS kernel on the same heads: equal bit for bit


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_head_is_orthogonalized_once_per_step(results, layout):
    got = results[layout]
    assert got["ns_matrices"] == got["expected_ns"]
