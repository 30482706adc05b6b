"""Training from each kind of source: a token store made by `unmask preprocess`, a stream of
jsonl shards, and a blend; each run resumed from its step-4 checkpoint ends with the
uninterrupted run's losses and weights, with and without loader worker processes."""

import json
import shutil

import pytest
import torch
from conftest import losses
from launch import WORKERS, torchrun, train_in_ranks
from safetensors.torch import load_file

from unmask.cli import main
from unmask.config import load_config
from unmask.data.tokenizer import build_char_tokenizer, ensure_special_tokens
from unmask.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")
WORDS = "the quick brown fox jumps over a lazy dog while seven wise owls watch".split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two jsonl shards, a token store made from them, and the char tokenizer folder."""
    root = tmp_path_factory.mktemp("corpus")
    shards = root / "shards"
    shards.mkdir()
    for s in range(2):
        with open(shards / f"part-{s}.jsonl", "w") as f:
            for i in range(60):
                words = " ".join(WORDS[(i * 5 + j + s) % len(WORDS)] for j in range(6 + i % 5))
                text = f"{s}.{i} {words}"  # every document distinct
                f.write(json.dumps({"text": text}) + "\n")
    tok = build_char_tokenizer()
    ensure_special_tokens(tok)
    tok.save_pretrained(str(root / "tokenizer"))
    prefix = root / "store"
    files = [str(p) for p in sorted(shards.iterdir())]
    args = ["preprocess", "--output-prefix", str(prefix), "--tokenizer", str(root / "tokenizer"),
            "--append-eod"] + sum((["--input", f] for f in files), [])  # fmt: skip
    assert main(args) == 0
    return root


def _data(corpus, kind: str) -> dict:
    tokenizer = str(corpus / "tokenizer")
    if kind == "store":
        return {"dataset": str(corpus / "store"), "tokenizer": tokenizer, "eval_split": 4}
    if kind == "stream":
        return {"dataset": str(corpus / "shards"), "streaming": True, "tokenizer": tokenizer,
                "eval_split": 4}  # fmt: skip
    return {
        "sources": [{"path": str(corpus / "store"), "weight": 3},
                    {"path": str(corpus / "shards" / "part-1.jsonl"), "weight": 1}],
        "tokenizer": tokenizer, "eval_split": 4,
    }  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["store", "stream", "blend"])
@pytest.mark.parametrize("workers", [0, 2])
def test_resumed_run_equals_uninterrupted(tiny_config, tmp_path, corpus, kind, workers):
    extra = {
        "data": {**_data(corpus, kind), "packing": True, "packing_length": 24},
        "train": {"max_steps": 8, "save_steps": 4, "dataloader_num_workers": workers},
    }
    Trainer(load_config(tiny_config(extra))).train()
    full = losses(tmp_path / "run")
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    shutil.copytree(tmp_path / "run" / "checkpoint-4", stopped / "checkpoint-4")
    resume = {"output_dir": str(stopped), "resume_from_checkpoint": True}
    extra["train"] = {**extra["train"], **resume}
    trainer = Trainer(load_config(tiny_config(extra, name="resume.yaml")))
    assert trainer.step == 4
    trainer.train()
    assert losses(stopped) == {k: v for k, v in full.items() if k > 4}
    a = load_file(str(tmp_path / "run" / "final" / "model.safetensors"))
    b = load_file(str(stopped / "final" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_store_with_another_tokenizer_stops_before_anything_is_written(
    tiny_config, tmp_path, corpus, capsys
):
    meta = json.loads((corpus / "store.json").read_text())
    other = tmp_path / "other"
    shutil.copy(corpus / "store.bin", tmp_path / "other.bin")
    shutil.copy(corpus / "store.idx", tmp_path / "other.idx")
    (tmp_path / "other.json").write_text(json.dumps({**meta, "tokenizer_fingerprint": "f" * 64}))
    cfg = tiny_config({"data": {"dataset": str(other), "tokenizer": str(corpus / "tokenizer")}})
    assert main(["train", str(cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "was made with another tokenizer" in err[0]
    assert not (tmp_path / "run").exists()


def test_store_start_up_prints_the_missing_sidecar_notice(tiny_config, tmp_path, corpus, capsys):
    for suffix in (".bin", ".idx"):
        shutil.copy(corpus / f"store{suffix}", tmp_path / f"bare{suffix}")
    data = {"dataset": str(tmp_path / "bare"), "tokenizer": str(corpus / "tokenizer"),
            "eval_split": 2}  # fmt: skip
    assert main(["train", str(tiny_config({"data": data, "train": {"max_steps": 2}}))]) == 0
    assert "fingerprint check was skipped" in capsys.readouterr().out


def _read_as_ranks(tmp_path, config, world: int, batches: int) -> list[list]:
    out = tmp_path / f"rows-w{world}"
    torchrun(world, WORKERS / "loader_worker.py", config, out, batches, timeout=300)
    return [json.loads((tmp_path / f"rows-w{world}-{r}.json").read_text()) for r in range(world)]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["store", "stream"])
def test_torchrun_ranks_read_disjoint_shares_whose_union_is_one_rank_s(
    tiny_config, tmp_path, corpus, kind
):
    data = {**_data(corpus, kind), "packing": False, "packing_length": 48}
    one = tiny_config({"data": data, "train": {"per_device_train_batch_size": 4}}, name="one.yaml")
    two = tiny_config({"data": data, "train": {"per_device_train_batch_size": 2}}, name="two.yaml")
    single = _read_as_ranks(tmp_path, one, 1, 12)[0]
    ranks = _read_as_ranks(tmp_path, two, 2, 12 if kind == "store" else 28)
    if kind == "store":  # a rank's rows are its slice of the one-process global batch
        for step, batch in enumerate(single):
            assert ranks[0][step] + ranks[1][step] == batch
        return
    # a stream is split by shards: each rank reads its own shard's documents
    docs = [{tuple(row) for batch in r for row in batch} for r in ranks]
    assert docs[0].isdisjoint(docs[1])
    everything = {tuple(row) for batch in single for row in batch}
    assert docs[0] | docs[1] >= everything


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["store", "blend"])
def test_two_ranks_on_a_store_or_blend_log_the_one_process_losses(tiny_config, tmp_path,
                                                                   corpus, kind):  # fmt: skip
    """The 1-vs-2-rank agreement of test_distributed_train, with rows from a token store or
    a blend: each rank reads its slice of the global batch and draws its slice of the
    global noise, so the logged losses are the one-process run's."""
    train = {"max_steps": 6, "split_batches": True, "per_device_train_batch_size": 8,
             "eval_steps": 0, "save_steps": 0, "logging_steps": 1}  # fmt: skip
    data = {**_data(corpus, kind), "packing_length": 32}
    one = tiny_config({"data": data, "train": {**train, "output_dir": str(tmp_path / "one")}},
                      "one.yaml")  # fmt: skip
    two = tiny_config({"data": data, "train": {**train, "output_dir": str(tmp_path / "two")}},
                      "two.yaml")  # fmt: skip
    assert main(["train", str(one)]) == 0
    train_in_ranks(2, tmp_path / "results.json", two, timeout=300)
    single, double = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert sorted(double) == sorted(single) == [1, 2, 3, 4, 5, 6]
    for step in single:
        assert double[step] == pytest.approx(single[step], abs=1e-5), step
