"""The step audit of tests/unit/test_step_audit.py under FSDP2 over 2 real gloo processes
(dist_workers/audit_worker.py): bf16 parameters all-gathered by FSDP2's mixed-precision
policy, every objective, dense and MoE: float32 matmul FLOPs <= 1% and no device sync but
the guard's (none with train.nonfinite_check logging)."""

import json

import pytest
import yaml
from conftest import AUDIT_CASES as CASES
from conftest import TINY, deep_update
from launch import WORKERS, torchrun

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def audits(tmp_path_factory):
    root = tmp_path_factory.mktemp("audit")
    configs = []
    for name, extra in CASES.items():
        tree = deep_update(TINY, {"train": {"output_dir": str(root / name), "bf16": True,
                                            "save_steps": 0, "eval_steps": 0},
                                  "model": {"attn_implementation": "sdpa"}})  # fmt: skip
        path = root / f"{name}.yaml"
        path.write_text(yaml.safe_dump(deep_update(tree, extra)))
        configs.append(path)
    torchrun(2, WORKERS / "audit_worker.py", root, *configs, timeout=900)
    return [json.loads((root / f"rank-{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.parametrize("name", list(CASES))
def test_an_fsdp2_bf16_step_runs_its_matmuls_in_bf16_and_waits_once(audits, name):
    for rank in audits:
        result = rank[name]
        assert result["sharded"]
        flops = result["flops"]
        router = result["float32_router"]  # float32 by design: the MoE routers' matmuls
        assert bool(router) == name.startswith("moe"), result["float32_largest"]
        total = sum(flops.values()) - router
        assert total > 0
        assert flops.get("torch.float32", 0) - router <= 0.01 * total, result["float32_largest"]
        syncs = result["syncs"]
        assert len(syncs) == 1 and syncs[0][0] == "Tensor.tolist", syncs
        assert "step.py" in syncs[0][1], syncs
        assert result["syncs_logging"] == []  # train.nonfinite_check logging: none
