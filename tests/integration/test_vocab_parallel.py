"""The vocab-parallel LM head under tensor parallelism (parallel/tensor.py, diffusion/loss.py).

The head and the embedding split by vocabulary rows give the replicated head's losses, logits
and gradients within float32 rounding (2 gloo processes, dist_workers/vocab_worker.py), for
untied and tied embeddings and a vocabulary tp does not divide; and a tp=2 run with tied
embeddings trains with the one-process run's losses for 20 steps. (Untied heads train under
tp=4 and dp_shard=2 x tp=2 in test_tensor_parallel.py, which also resumes their DCP
checkpoints on one process.)
"""

import json

import pytest
from conftest import losses, train_in_process, write_run_config
from launch import WORKERS, torchrun, train_in_ranks

pytestmark = pytest.mark.slow


def test_vocab_parallel_head_equals_replicated_head(tmp_path):
    out = tmp_path / "vocab.json"
    torchrun(2, WORKERS / "vocab_worker.py", out, timeout=300)
    results = json.loads(out.read_text())
    assert sorted(results) == ["tied", "uneven vocab", "untied"]
    for case, got in results.items():
        for quantity in ("token losses", "weighted sum", "logits", "token-loss gradients",
                         "weighted gradients"):  # fmt: skip
            assert got[quantity] < 1e-6, (case, quantity, got[quantity])
        assert got["parameters"] and got["head is a DTensor"], case
    # DTensor's split: ceil(V / 2) rows on rank 0, the rest on rank 1
    assert results["untied"]["head rows per rank"] == [64, 64]
    assert results["uneven vocab"]["head rows per rank"] == [66, 65]
    assert results["tied"]["tied"] and not results["untied"]["tied"]


def test_tied_embeddings_under_tp2_train_as_one_process(tmp_path):
    base = {"model": {"num_attention_heads": 4, "num_key_value_heads": 4,
                      "tie_word_embeddings": True},
            "train": {"split_batches": True, "eval_steps": 0, "save_steps": 0,
                      "logging_steps": 1, "max_steps": 20}}  # fmt: skip
    cfg = write_run_config(tmp_path, "tied-tp2", base, {"train": {"tensor_parallel": 2}})
    results = train_in_ranks(2, tmp_path / "results.json", cfg, timeout=300)
    assert results["tied-tp2"]["rc"] == 0, results["tied-tp2"]["stderr"][-2000:]
    single = losses(train_in_process(cfg, tmp_path / "tied-1", tensor_parallel=1, dp_shard=-1))
    split = losses(tmp_path / "tied-tp2")
    assert sorted(single) == sorted(split) == list(range(1, 21))
    for step in single:
        assert split[step] == pytest.approx(single[step], rel=1e-5), step
