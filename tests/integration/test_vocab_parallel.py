"""The vocab-parallel LM head and sequence parallelism under tensor parallelism
(parallel/tensor.py, diffusion/loss.py).

The head and the embedding split by vocabulary rows give the replicated head's losses, logits
and gradients within float32 rounding (2 gloo processes, dist_workers/vocab_worker.py), for
untied and tied embeddings and a vocabulary tp does not divide; sequence parallelism gives
plain TP's, with rows tp divides and rows padded inside the model. Then, in one 2-process
launch, a tp=2 run with tied embeddings and a tp=2 run with parallel.sequence_parallel (rows
cut to random lengths, so some are padded) train with the one-process run's losses for 20
steps, and the tied run's DCP checkpoint resumes on one process with the uninterrupted
run's losses. (Untied vocab-parallel heads train under tp=4 and dp_shard=2 x tp=2 in
test_tensor_parallel.py, which also resumes their DCP checkpoints on one process.)
"""

import json

import pytest
from conftest import losses, train_in_process, write_run_config
from launch import WORKERS, torchrun, train_in_ranks

from unmask.config import load_config
from unmask.train.trainer import Trainer

pytestmark = pytest.mark.slow
BASE = {
    "model": {"num_attention_heads": 4, "num_key_value_heads": 4},
    "train": {"split_batches": True, "eval_steps": 0, "save_steps": 0, "logging_steps": 1,
              "max_steps": 20, "tensor_parallel": 2},
}  # fmt: skip
RUNS = {
    # its checkpoint-10 (a DCP folder of the split tied matrix) resumes on one process
    "tied-tp2": {"model": {"tie_word_embeddings": True}, "train": {"save_steps": 10}},
    # half the steps cut their rows to a random length: odd lengths are padded to even
    "sp-tp2": {
        "train": {"sequence_parallel": True},
        "diffusion": {"random_length_prob": 0.5},
    },  # fmt: skip
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vp")
    cfg = {name: write_run_config(root, name, BASE, extra) for name, extra in RUNS.items()}
    results = train_in_ranks(2, root / "results.json", *cfg.values(), timeout=400)
    return {"root": root, "cfg": cfg, "results": results}


def test_vocab_parallel_head_and_sequence_parallel_equal_the_plain_layouts(tmp_path):
    out = tmp_path / "vocab.json"
    torchrun(2, WORKERS / "vocab_worker.py", out, timeout=300)
    results = json.loads(out.read_text())
    assert sorted(results) == ["sequence parallel, 15 tokens", "sequence parallel, 16 tokens",
                               "tied", "uneven vocab", "untied"]  # fmt: skip
    for case, got in results.items():
        for quantity in ("token losses", "weighted sum", "logits", "token-loss gradients",
                         "weighted gradients"):  # fmt: skip
            assert got[quantity] < 1e-6, (case, quantity, got[quantity])
        assert got["parameters"] and got["head is a DTensor"], case
    # DTensor's split: ceil(V / 2) rows on rank 0, the rest on rank 1
    assert results["untied"]["head rows per rank"] == [64, 64]
    assert results["uneven vocab"]["head rows per rank"] == [66, 65]
    assert results["tied"]["tied"] and not results["untied"]["tied"]
    # sharding the norms over the sequence changes no forward value (rows tp divides)
    same = results["sequence parallel, 16 tokens"]
    assert same["token losses"] == same["weighted sum"] == same["logits"] == 0.0


@pytest.mark.parametrize("name", list(RUNS))
def test_losses_match_one_process_for_20_steps(runs, name):
    result = runs["results"][name]
    assert result["rc"] == 0, result["stderr"][-2000:]
    single = losses(train_in_process(runs["cfg"][name], runs["root"] / f"{name}-1",
                                     tensor_parallel=1, sequence_parallel=False,
                                     dp_shard=-1))  # fmt: skip
    split = losses(runs["root"] / name)
    assert sorted(single) == sorted(split) == list(range(1, 21))
    for step in single:
        assert split[step] == pytest.approx(single[step], rel=1e-5), step


def test_tied_vocab_parallel_checkpoint_resumes_on_one_process(runs):
    root = runs["root"]
    assert runs["results"]["tied-tp2"]["rc"] == 0
    uninterrupted = losses(train_in_process(runs["cfg"]["tied-tp2"], root / "tied-tp2-1",
                                            tensor_parallel=1, dp_shard=-1))  # fmt: skip
    cfg = load_config(runs["cfg"]["tied-tp2"])
    cfg.train = cfg.train.model_copy(update={
        "output_dir": str(root / "tied-resumed-1"),
        "resume_from_checkpoint": str(root / "tied-tp2" / "checkpoint-10")})  # fmt: skip
    cfg.parallel = cfg.parallel.model_copy(update={"tensor_parallel": 1, "dp_shard": -1})
    trainer = Trainer(cfg)
    assert trainer.step == 10
    trainer.train()
    resumed = losses(root / "tied-resumed-1")
    assert sorted(resumed) == list(range(11, 21))
    for step in resumed:
        assert resumed[step] == pytest.approx(uninterrupted[step], rel=1e-5), step
