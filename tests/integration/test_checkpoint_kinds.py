"""`unmask generate`, `eval --ppl` and `export` on every kind of checkpoint unmask writes,
each against an oracle that does not go through the code under test:

- a 2-process (torchrun, gloo, FSDP2) DCP checkpoint-N against the run's own final/,
  gathered by the training ranks (FSDP's full state dict) and loaded by transformers;
- the same for a 2-process LoRA run (peft names in the shards) against its final/ adapter
  applied by hand with peft;
- a one-process LoRA adapter checkpoint on a pretrained base folder, and one on a base built
  from the config, against `peft.PeftModel.from_pretrained(base, adapter).merge_and_unload()`
  (on transformers' Qwen3 for the exported folder);
- a missing checkpoint: the error lists what the run folder holds; the start line of a LoRA
  run counts trainable and total parameters.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import TINY, deep_update, save_tiny_model, write_run_config
from launch import TRAIN_WORKER, torchrun
from safetensors.torch import load_file

from unmask.checkpoint import load_for_sampling, resolve_model_folder, saved_kind
from unmask.cli import main
from unmask.config import load_config
from unmask.data.tokenizer import load_local_tokenizer
from unmask.errors import InputError
from unmask.models import ModelConfig, build_model, from_pretrained
from unmask.sampling import SamplingConfig, left_pad, sample
from unmask.train.trainer import Trainer

peft = pytest.importorskip("peft")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
PROMPTS = ["rev 123=", "sort 4=", "add 12+7=", "rev 9="]
LORA = {"lora": True, "lora_r": 4, "lora_alpha": 8}
SHORT = {"max_steps": 2, "save_steps": 2, "eval_steps": 0, "logging_steps": 1}


def write_config(root: Path, name: str, extra: dict) -> Path:
    return write_run_config(root, name, {"train": SHORT}, extra)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A tiny pretrained base folder; 2-process runs (plain and LoRA) in one torchrun launch;
    one-process LoRA runs on that base and on a base built from the config."""
    root = tmp_path_factory.mktemp("kinds")
    base = save_tiny_model(root / "base", seed=0)
    pretrained = {"model": {"pretrained": str(base)}}
    sharded = {"train": {"split_batches": True}}
    two = {
        "dcp": write_config(root, "dcp", deep_update(pretrained, sharded)),
        "lora_dcp": write_config(
            root, "lora_dcp", deep_update(deep_update(pretrained, sharded), {"model": LORA})
        ),
    }
    results = root / "results.json"
    proc = torchrun(2, TRAIN_WORKER, results, *two.values(), timeout=300)
    assert all(r["rc"] == 0 for r in json.loads(results.read_text()).values())
    lines = [line for line in proc.stdout.splitlines() if line.startswith("unmask: ")]
    starts = {name: next(x for x in lines if x.endswith(f"output_dir {root / name}"))
              for name in two}  # fmt: skip
    lora_cfg = load_config(write_config(root, "lora", deep_update(pretrained, {"model": LORA})))
    trainer = Trainer(lora_cfg)
    starts["lora"] = trainer._summary()
    trainer.train()
    Trainer(load_config(write_config(root, "lora_seed", {"model": LORA}))).train()
    return {"root": root, "base": base, "start_lines": starts, "seed": lora_cfg.train.seed}


def merged_by_hand(base: torch.nn.Module, adapter: Path) -> torch.nn.Module:
    """The oracle: peft's own loader applies the adapter to the base, then merges."""
    return peft.PeftModel.from_pretrained(base, str(adapter)).merge_and_unload().eval()


def completions(model, folder: Path, prompts=PROMPTS, gen_length: int = 8) -> list[str]:
    """Greedy samples one prompt at a time through the Python API (not the CLI's batching)."""
    tok = load_local_tokenizer(str(folder))
    out = []
    for prompt in prompts:
        ids, _ = left_pad([tok(prompt, add_special_tokens=False)["input_ids"]], 0)
        config = SamplingConfig(gen_length=gen_length, steps=gen_length)
        answer = sample(model, ids, config, mask_id=tok.mask_token_id, eos_id=tok.eos_token_id)
        answer = answer.answers[0].tolist()
        if tok.eos_token_id in answer:
            answer = answer[: answer.index(tok.eos_token_id)]
        out.append(tok.decode(answer, skip_special_tokens=True))
    return out


def cli_completions(model: Path, *flags: str) -> list[str]:
    out = model.parent / f"{model.name}-samples.jsonl"
    args = ["generate", "--model", str(model), "--out", str(out), "--gen-length", "8", *flags]
    assert main(args + [a for p in PROMPTS for a in ("--prompt", p)]) == 0
    return [json.loads(line)["completion"] for line in out.read_text().splitlines()]


def ppl(model: Path, text: Path, capsys, *flags: str) -> dict:
    capsys.readouterr()
    args = ["eval", "--model", str(model), "--ppl", str(text), "--context", "8", "--mc-num", "4"]
    assert main([*args, *flags]) == 0
    return json.loads(capsys.readouterr().out)


def ids_batch() -> torch.Tensor:
    return torch.randint(4, 100, (2, 12), generator=torch.Generator().manual_seed(0))


def logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids)


def hf_logits(model, ids) -> torch.Tensor:
    """Bidirectional logits of a transformers model (a full attention mask)."""
    full = torch.ones(ids.shape[0], 1, ids.shape[1], ids.shape[1], dtype=torch.bool)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask={"full_attention": full}).logits


def hf_model(folder: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()


def assert_same_folder_weights(a: Path, b: Path) -> None:
    left, right = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert set(left) == set(right)
    for key, value in left.items():
        assert torch.equal(value, right[key]), key


def text_file(root: Path) -> Path:
    path = root / "score.txt"
    path.write_text("rev 123=321\nsort 4=4\n")
    return path


def test_dcp_checkpoint_samples_scores_and_exports_like_the_gathered_final(runs, capsys):
    root = runs["root"]
    ckpt, final = root / "dcp" / "checkpoint-2", root / "dcp" / "final"
    assert saved_kind(ckpt) == "dcp" and saved_kind(final) == "hf"
    # the oracle: final/ was gathered by the two training ranks (FSDP full state dict) at the
    # same step; transformers loads it as Qwen3
    ids = ids_batch()
    reference = hf_logits(hf_model(final), ids)
    sm = load_for_sampling(ckpt)
    assert (logits(sm.model, ids) - reference).abs().max().item() < 1e-4
    expected = completions(from_pretrained(final).eval(), final)
    assert any(expected)  # not all empty: the comparison says something
    assert cli_completions(ckpt) == expected
    text = text_file(root)
    assert ppl(ckpt, text, capsys) == ppl(final, text, capsys)
    out = root / "dcp-export"
    assert main(["export", str(ckpt), "--out", str(out)]) == 0
    assert_same_folder_weights(out, final)
    assert (hf_logits(hf_model(out), ids) - reference).abs().max().item() == 0


def test_sharded_lora_checkpoint_and_final_adapter(runs, capsys):
    root = runs["root"]
    ckpt, final = root / "lora_dcp" / "checkpoint-2", root / "lora_dcp" / "final"
    assert saved_kind(ckpt) == "lora-dcp" and saved_kind(final) == "adapter"
    # final/ of a 2-process LoRA run is the adapter (peft format), recording its base
    recorded = json.loads((final / "adapter_config.json").read_text())
    assert recorded["base_model_name_or_path"] == str(runs["base"].resolve())
    oracle = merged_by_hand(from_pretrained(runs["base"]), final)
    ids = ids_batch()
    assert (logits(load_for_sampling(ckpt).model, ids) - logits(oracle, ids)).abs().max() < 1e-5
    expected = completions(oracle, final)
    assert any(expected)
    assert cli_completions(ckpt) == cli_completions(final) == expected
    text = text_file(root)
    assert ppl(ckpt, text, capsys) == ppl(final, text, capsys)


def test_lora_adapter_checkpoint_samples_scores_and_exports_like_peft_by_hand(
    runs, tmp_path, capsys
):
    root, base = runs["root"], runs["base"]
    ckpt = root / "lora" / "checkpoint-2"
    assert saved_kind(ckpt) == "adapter"
    assert not (ckpt / "config.json").exists()  # adapter only: the base comes from its record
    oracle = merged_by_hand(from_pretrained(base), ckpt)
    expected = completions(oracle, ckpt)
    assert any(expected)
    assert cli_completions(ckpt) == expected
    # the run folder resolves to final/ (the adapter, unmerged), the same weights at step 2
    assert resolve_model_folder(root / "lora") == root / "lora" / "final"
    assert cli_completions(root / "lora") == expected
    # eval: the same numbers as the oracle saved as a plain folder
    plain = tmp_path / "oracle"
    oracle.save_pretrained(str(plain))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy2(ckpt / name, plain / name)
    text = text_file(tmp_path)
    assert ppl(ckpt, text, capsys) == ppl(plain, text, capsys)
    # export: a merged HF folder; transformers' Qwen3 + peft's merge of the adapter agree
    out = tmp_path / "merged"
    assert main(["export", str(ckpt), "--out", str(out)]) == 0
    assert not (out / "adapter_config.json").exists()
    hf_base = hf_model(base)
    reference = hf_logits(peft.PeftModel.from_pretrained(hf_base, str(ckpt)).merge_and_unload(),
                          ids_batch())  # fmt: skip
    assert (hf_logits(hf_model(out), ids_batch()) - reference).abs().max().item() < 1e-5


def test_lora_base_moved_or_other_is_one_line_and_base_flag_fixes_it(runs, tmp_path, capsys):
    root = runs["root"]
    run = tmp_path / "run"
    shutil.copytree(root / "lora", run)
    ckpt = run / "checkpoint-2"
    expected = cli_completions(root / "lora" / "checkpoint-2")
    moved = tmp_path / "moved-base"
    shutil.copytree(runs["base"], moved)
    recorded = str(runs["base"].resolve())
    shutil.move(str(runs["base"]), str(tmp_path / "away"))  # the recorded base is gone
    try:
        capsys.readouterr()
        args = ["generate", "--model", str(ckpt), "--prompt", "rev 1="]
        assert main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [
            f"unmask: error: LoRA adapter {str(ckpt)!r} was trained on base model "
            f"{recorded!r}, which is not a model folder here; pass --base FOLDER with that "
            "model (lm-eval: base=FOLDER in model_args)"
        ]
        assert cli_completions(ckpt, "--base", str(moved)) == expected
        assert main(["export", str(ckpt), "--base", str(moved), "--out", str(tmp_path / "e")]) == 0
        other = save_tiny_model(tmp_path / "other", seed=5)
        capsys.readouterr()
        assert main([*args, "--base", str(other)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "was trained on other base weights than those of" in err[0]
        assert main(["generate", "--model", str(root / "dcp"), "--base", str(moved),
                     "--prompt", "a"]) == 2  # fmt: skip
        assert "--base is for unmerged LoRA adapters" in capsys.readouterr().err
    finally:
        shutil.move(str(tmp_path / "away"), str(runs["base"]))


def test_lora_checkpoint_from_before_base_records_uses_the_run_config(runs, tmp_path):
    """A checkpoint written before adapters recorded their base: no lora_base.json, no
    base_model_name_or_path; the run's config.yaml next to it names the base."""
    run = tmp_path / "run"
    shutil.copytree(runs["root"] / "lora", run)
    ckpt = run / "checkpoint-2"
    (ckpt / "lora_base.json").unlink()
    adapter_config = json.loads((ckpt / "adapter_config.json").read_text())
    (ckpt / "adapter_config.json").write_text(
        json.dumps({**adapter_config, "base_model_name_or_path": None})
    )
    oracle = merged_by_hand(from_pretrained(runs["base"]), ckpt)
    assert torch.equal(logits(load_for_sampling(ckpt).model, ids_batch()),
                       logits(oracle, ids_batch()))  # fmt: skip
    (run / "config.yaml").unlink()
    with pytest.raises(InputError, match="records no base model.*pass --base FOLDER"):
        load_for_sampling(ckpt)


def test_lora_on_a_base_built_from_the_config(runs, tmp_path):
    """No model.pretrained: the base is rebuilt from the recorded model section and seed."""
    ckpt = runs["root"] / "lora_seed" / "checkpoint-2"
    assert json.loads((ckpt / "lora_base.json").read_text())["pretrained"] is None
    torch.manual_seed(runs["seed"])  # what the trainer does before building the model
    base = build_model(ModelConfig(**TINY["model"]))
    oracle = merged_by_hand(base, ckpt)
    ids = ids_batch()
    assert torch.equal(logits(load_for_sampling(ckpt).model, ids), logits(oracle, ids))
    out = tmp_path / "merged"
    assert main(["export", str(ckpt), "--out", str(out)]) == 0
    assert torch.equal(logits(from_pretrained(out).eval(), ids), logits(oracle, ids))


def test_missing_checkpoint_lists_what_the_run_holds(runs, tiny_config, tmp_path, capsys):
    run = tmp_path / "quickstart"
    for step in (1500, 3000):
        (run / f"checkpoint-{step}").mkdir(parents=True)
        (run / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps({"step": step}))
    shutil.copytree(runs["base"], run / "final")
    missing = run / "checkpoint-2000"
    held = f"no checkpoint-2000 in {str(run)!r}; it holds checkpoint-1500, checkpoint-3000"
    text = text_file(tmp_path)
    commands = {
        "export": (["export", str(missing), "--out", str(tmp_path / "o")], f"{held}, final"),
        "generate": (["generate", "--model", str(missing), "--prompt", "a"], f"{held}, final"),
        "eval": (["eval", "--model", str(missing), "--ppl", str(text)], f"{held}, final"),
        "resume": (
            ["train", str(tiny_config()), f"train.resume_from_checkpoint={missing}"],
            f"resume_from_checkpoint: {held}",
        ),
    }
    for name, (args, message) in commands.items():
        capsys.readouterr()
        assert main(args) == 2, name
        assert capsys.readouterr().err.strip().splitlines() == [f"unmask: error: {message}"]
    assert not (tmp_path / "o").exists() and not (tmp_path / "run").exists()


def test_run_folder_resolves_to_its_newest_intact_checkpoint(runs, tmp_path):
    run = tmp_path / "dcp"
    shutil.copytree(runs["root"] / "dcp", run)
    shutil.rmtree(run / "final")
    shutil.copytree(run / "checkpoint-2", run / "checkpoint-3")
    (run / "checkpoint-3" / "trainer_state.json").write_text("{}")  # damaged: checksum differs
    assert resolve_model_folder(run) == run / "checkpoint-2"
    assert saved_kind(resolve_model_folder(run)) == "dcp"


def test_start_line_counts_trainable_parameters_of_lora_runs(runs):
    base = from_pretrained(runs["base"])
    total = sum(p.numel() for p in base.parameters())
    # rank 4 on q k v o gate up down of 2 blocks: r * (in + out) each
    cfg = base.config
    q, kv = (n * cfg.resolved_head_dim for n in (cfg.num_attention_heads, cfg.num_key_value_heads))
    h, m = cfg.hidden_size, cfg.intermediate_size
    pairs = [(h, q), (h, kv), (h, kv), (q, h), (h, m), (h, m), (m, h)]
    trainable = 2 * sum(4 * (a + b) for a, b in pairs)
    line = f"{trainable / 1e6:.2g}M trainable of {(total + trainable) / 1e6:.2f}M parameters |"
    assert runs["start_lines"]["lora"].startswith(f"unmask: {line}")
    assert line in runs["start_lines"]["lora_dcp"]  # sharded: counted over the global shapes
    plain = runs["start_lines"]["dcp"]
    assert f"unmask: {total / 1e6:.2f}M parameters |" in plain and "trainable" not in plain
