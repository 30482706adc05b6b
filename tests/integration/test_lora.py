"""LoRA and QLoRA runs: only the adapters train and are saved in peft's format (merged on
request), 4-bit requests that cannot run are one line, and an adapter run resumes with the
same losses but never onto other base weights or settings."""

import shutil

import pytest

from unmask.cli import main
from unmask.config import load_config
from unmask.train.trainer import Trainer


def _run(argv, capsys):
    code = main(argv)
    return code, capsys.readouterr().err.strip().splitlines()


def test_lora_trains_only_adapters_and_saves_a_peft_adapter(tiny_config, tmp_path):
    peft = pytest.importorskip("peft")
    import torch

    from unmask.models import build_model, from_pretrained
    from unmask.models.lora import save_lora

    extra = {
        "model": {"lora": True, "lora_r": 4, "lora_alpha": 8},
        "train": {"max_steps": 4, "save_steps": 0, "eval_steps": 0},
        "optim": {"name": "muon", "learning_rate": 1e-2},
    }
    cfg = load_config(tiny_config(extra))
    trainer = Trainer(cfg)
    params = dict(trainer.model.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    trainable = {n for n, p in params.items() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert not trainer.optimizer.routing.muon  # LoRA factors always go to AdamW
    trainer.train()
    changed = {n for n, p in params.items() if not torch.equal(p.detach(), before[n])}
    assert changed == trainable  # every factor moved, no base weight did
    ids = torch.randint(4, 100, (2, 20), generator=torch.Generator().manual_seed(0))
    # the adapter loads with peft's own loader on a fresh base model: identical logits
    torch.manual_seed(cfg.train.seed)
    base = build_model(cfg.model.model_copy(update={"lora": False}))
    loaded = peft.PeftModel.from_pretrained(base, str(tmp_path / "run" / "adaptor")).eval()
    model = trainer.model.eval()
    with torch.no_grad():
        reference = model(ids)
        assert torch.equal(loaded(ids), reference)
    # merged export on request: a plain HF folder with the same logits
    merged_cfg = cfg.model.model_copy(update={"lora_merge": True})
    save_lora(model, tmp_path / "out", tmp_path / "out" / "final", merged_cfg)
    exported = from_pretrained(tmp_path / "out" / "final").eval()
    with torch.no_grad():
        assert (exported(ids) - reference).abs().max().item() < 1e-5


def test_lora_4bit_without_cuda_is_one_line_exit_2(tiny_config, tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    extra = {"model": {"load_in_4bit": True, "lora": True}}
    code, err = _run(["train", str(tiny_config(extra))], capsys)
    assert code == 2 and len(err) == 1
    assert "load_in_4bit: true needs a CUDA GPU and the bitsandbytes package" in err[0]
    assert "(training device here: cpu)" in err[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "model, message",
    [
        ({}, "trains LoRA adapters on a frozen 4-bit base; set model.lora: true"),
        ({"lora": True, "lora_merge": True}, "lora_merge: true cannot merge into 4-bit weights"),
        ({"lora": True, "model_type": "bert"}, "is for the decoder families, not 'bert'"),
    ],
)
def test_4bit_requests_that_cannot_run_are_one_line(
    tiny_config, tmp_path, capsys, monkeypatch, model, message
):
    import unmask.models.quant as quant

    monkeypatch.setattr(quant, "cuda_ready", lambda device: True)  # as on a CUDA machine
    extra = {"model": {"load_in_4bit": True, **model}}
    code, err = _run(["train", str(tiny_config(extra))], capsys)
    assert code == 2 and len(err) == 1, err
    assert message in err[0]
    assert not (tmp_path / "run").exists()


def test_qlora_trains_adapters_on_a_4bit_base(tiny_config, tmp_path, monkeypatch):
    """The whole 4-bit path through the trainer, on bitsandbytes' CPU backend: only the
    device check is told it is on a CUDA machine."""
    peft = pytest.importorskip("peft")
    bnb = pytest.importorskip("bitsandbytes")
    import torch

    import unmask.models.quant as quant
    from unmask.models import build_model

    monkeypatch.setattr(quant, "cuda_ready", lambda device: True)
    model = {"load_in_4bit": True, "lora": True, "lora_r": 4, "lora_alpha": 8}
    extra = {
        "model": {**model, "hidden_size": 64, "intermediate_size": 128},
        "train": {"max_steps": 30, "save_steps": 15, "eval_steps": 15, "eval_max_batches": 2},
        "optim": {"learning_rate": 1e-2},
    }
    cfg = load_config(tiny_config(extra))
    trainer = Trainer(cfg)
    layers = [m for m in trainer.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    cpu_reference_path(layers)
    assert len(layers) == 7 * 2  # q k v o gate up down in both blocks
    assert all(m.weight.dtype == torch.uint8 and m.weight.bnb_quantized for m in layers)
    params = dict(trainer.model.named_parameters())
    trainable = {n for n, p in params.items() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    # the 4-bit base computes what the full-precision model does, up to NF4 rounding
    torch.manual_seed(cfg.train.seed)
    full = build_model(cfg.model.model_copy(update={"lora": False, "load_in_4bit": False}))
    ids = torch.randint(4, 100, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), trainer.model.disable_adapter():
        reference = full(ids)
        error = (trainer.model(ids) - reference).norm() / reference.norm()
    assert error.item() < 0.2
    before = {n: p.detach().clone() for n, p in params.items()}
    first = trainer.evaluate()
    last = trainer.train()["eval_loss"]
    assert last < 0.9 * first  # rank-4 adapters on a random base: a modest fall
    changed = {n for n, p in params.items() if not torch.equal(p.detach(), before[n])}
    assert changed == trainable
    # the adapter (peft format) loads with peft onto a freshly quantized base: same logits
    torch.manual_seed(cfg.train.seed)
    base = build_model(cfg.model.model_copy(update={"lora": False}))
    quant.quantize_4bit(base, list(quant_targets()), "cpu", torch.float32)
    cpu_reference_path([m for m in base.modules() if isinstance(m, bnb.nn.Linear4bit)])
    loaded = peft.PeftModel.from_pretrained(base, str(tmp_path / "run" / "adaptor")).eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids), trainer.model.eval()(ids))


def cpu_reference_path(layers) -> None:
    """bitsandbytes >= 0.50 repacks a 4-bit layer for CPU inference on its first eval-mode
    forward where the CPU has AVX512-BF16, rounding the block scales to bfloat16 (and the
    inverse repacking on save is best-effort), so a layer that went through eval and back
    computes slightly other numbers than a freshly quantized one. That path exists only on
    bitsandbytes' CPU backend (the 4-bit training path is CUDA): keep both models on the
    plain dequantizing path so the comparison below is exact."""
    for layer in layers:
        layer.support_avx512bf16_for_cpu = False


def quant_targets():
    from unmask.models.shape import NATIVE_LINEAR

    return NATIVE_LINEAR


def test_tokenizer_without_mask_under_lora_is_one_line_exit_2(tiny_config, tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, "<unk>": 1, **{c: i + 2 for i, c in enumerate("0123456789+=")}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", unk_token="<unk>")
    tok.save_pretrained(str(tmp_path / "tok"))
    extra = {"data": {"tokenizer": str(tmp_path / "tok")}, "model": {"lora": True}}
    code, err = _run(["train", str(tiny_config(extra))], capsys)
    assert code == 2 and len(err) == 1, err
    assert "no mask (or EOS) token and one cannot be added under model.lora: true" in err[0]
    assert not (tmp_path / "run").exists()


def test_lora_run_resumes_with_the_same_losses(tiny_config, tmp_path):
    pytest.importorskip("peft")
    from conftest import losses

    lora = {"lora": True, "lora_r": 4, "lora_alpha": 8}  # lora_dropout 0.05: RNG restored
    cfg = load_config(
        tiny_config(
            {"model": lora, "train": {"max_steps": 6, "save_steps": 3}, "optim": {"name": "muon"}}
        )
    )
    Trainer(cfg).train()
    full = losses(tmp_path / "run")
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    shutil.copytree(tmp_path / "run" / "checkpoint-3", stopped / "checkpoint-3")
    assert (stopped / "checkpoint-3" / "adapter_model.safetensors").is_file()
    resume = {"output_dir": str(stopped), "resume_from_checkpoint": True}
    cfg2 = load_config(
        tiny_config(
            {
                "model": lora,
                "train": {"max_steps": 6, "save_steps": 3, **resume},
                "optim": {"name": "muon"},
            },
            name="resume.yaml",
        )
    )
    trainer = Trainer(cfg2)
    assert trainer.step == 3
    trainer.train()
    resumed = losses(stopped)
    assert sorted(resumed) == [4, 5, 6]
    assert all(resumed[step] == full[step] for step in (4, 5, 6))  # exactly, on CPU
    name = "adaptor/adapter_model.safetensors"
    assert (tmp_path / "run" / name).read_bytes() == (stopped / name).read_bytes()


def test_lora_resume_on_other_base_weights_or_without_lora_is_one_line(
    tiny_config, tmp_path, capsys
):
    pytest.importorskip("peft")
    lora = {"lora": True, "lora_r": 4, "lora_alpha": 8}
    run = {"max_steps": 2, "save_steps": 2}
    Trainer(load_config(tiny_config({"model": lora, "train": run}))).train()
    (tmp_path / "run" / "final").rename(tmp_path / "kept-final")  # a run dir without final/
    before = sorted(p.name for p in (tmp_path / "run").iterdir())
    config_before = (tmp_path / "run" / "config.yaml").read_text()
    resume = {**run, "max_steps": 4, "resume_from_checkpoint": True}
    other_seed = {"model": lora, "train": {**resume, "seed": 7}}
    code, err = _run(["train", str(tiny_config(other_seed, name="b.yaml"))], capsys)
    assert code == 2 and len(err) == 1, err
    assert "was trained on other base weights than this config's model" in err[0]
    code, err = _run(["train", str(tiny_config({"train": resume}, name="c.yaml"))], capsys)
    assert code == 2 and len(err) == 1, err
    assert "it was written by a LoRA run: set model.lora: true" in err[0]
    other_rank = {"model": {**lora, "lora_r": 8}, "train": resume}
    code, err = _run(["train", str(tiny_config(other_rank, name="d.yaml"))], capsys)
    assert code == 2 and len(err) == 1, err
    assert "was written with other settings (lora_r: 4 -> 8)" in err[0]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == before  # nothing lost
    assert (tmp_path / "run" / "config.yaml").read_text() == config_before
