"""What works for dense models works for MoE ones (issue 28), on one tiny qwen3_moe_dllm
(4 experts top-2 + 1 shared, hidden 32, 2 layers), in process: each objective (SFT, BD3LM,
GRPO, preference) trains with finite losses and its final/ loads and samples; the sampler's
caches give the uncached tokens where the dense tests claim it (test_sampling_parts.py);
likelihood runs; LoRA on attention trains only its adapters and resumes exactly."""

import math
import shutil
from pathlib import Path

import pytest
import torch
from conftest import deep_update, losses, read_metrics, tiny_model, write_run_config

from unmask.config import load_config
from unmask.models import from_pretrained
from unmask.models.moe import moe_blocks
from unmask.sampling import SamplingConfig, left_pad, sample
from unmask.sampling.likelihood import log_likelihood
from unmask.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

MOE = {"model_type": "qwen3_moe_dllm", "num_experts": 4, "num_experts_per_tok": 2,
       "moe_intermediate_size": 16, "router_aux_loss_coef": 0.01}  # fmt: skip
SHORT = {"model": MOE, "train": {"max_steps": 4, "eval_steps": 0, "save_steps": 0}}
OBJECTIVES = {
    "sft": {"diffusion": {"objective": "sft", "prompt_drop_prob": 0.1}},
    "bd3lm": {"diffusion": {"objective": "bd3lm", "block_size": 4}},
    "grpo": {  # the format reward varies within groups of a random model (test_grpo_train.py)
        "diffusion": {"objective": "grpo"},
        "grpo": {"group_size": 2},
        "rewards": [{"fn": "format", "options": {"pattern": "[a-m]", "match": "search"}}],
        "train": {"per_device_train_batch_size": 2},
    },
    "preference": {
        "diffusion": {"objective": "preference"},
        "preference": {"num_samples": 2, "beta": 0.5},
        "train": {"per_device_train_batch_size": 4},
    },
}


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_each_objective_trains_an_moe_and_its_final_samples(tmp_path, name):
    trainer = Trainer(load_config(write_run_config(tmp_path, name, SHORT, OBJECTIVES[name])))
    trainer.train()
    steps = [r for r in read_metrics(tmp_path / name) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in steps)
    assert all(r["moe_load_max_over_mean"] >= 1.0 for r in steps)  # the router ran
    if name == "preference":  # policy = reference at step 1 (test_preference_train.py)
        assert steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    if name in ("sft", "bd3lm"):
        assert steps[-1]["loss"] < steps[0]["loss"]
    model = from_pretrained(tmp_path / name / "final").eval()
    assert len(moe_blocks(model)) == 2
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # final/ holds the trained weights
        torch.testing.assert_close(model(ids), trainer.model.eval()(ids), rtol=0, atol=0)
    opts = {"block_causal": True, "block_length": 4} if name == "bd3lm" else {}
    mask_id = trainer.tokenizer.mask_token_id
    out = sample(model, ids[:, :5], SamplingConfig(steps=8, gen_length=8, **opts),
                 mask_id=mask_id)  # fmt: skip
    assert not (out.sequences == mask_id).any()


V, MASK_ID, EOS = 29, 28, 27
PROMPT = torch.randint(0, EOS, (3, 5), generator=torch.Generator().manual_seed(0))


def tiny_moe(layers: int = 2):
    # initializer_range 0.2 as test_sampling_parts.py: peaked predictions
    fields = {k: v for k, v in MOE.items() if k != "router_aux_loss_coef"}
    return tiny_model(0, vocab_size=V, num_hidden_layers=layers, initializer_range=0.2,
                      **fields).eval()  # fmt: skip


def run(model, prompts, **kw):
    call = {k: kw.pop(k) for k in ("attention_mask", "generator") if k in kw}
    return sample(model, prompts, SamplingConfig(**kw), mask_id=MASK_ID, **call)


@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize(
    "kw",
    [
        dict(steps=12, gen_length=12, block_length=4, cfg_scale=0.5, cache_refresh=1),
        dict(steps=12, gen_length=12, block_length=4, shift_logits=True, cache_refresh=1),
        dict(steps=12, gen_length=12, block_length=4, threshold=0.3, block_causal=True),
        dict(steps=12, gen_length=12, block_length=12, block_causal=True, cfg_scale=0.5),
    ],
    ids=["refresh_cfg", "refresh_shift", "block_causal_threshold", "block_causal_one_block"],
)
def test_caches_give_the_uncached_tokens_where_dense_ones_do(cache, kw):
    # the claims of test_sampling_parts.py: refreshed every step, or block-causal attention
    # (ragged left-padded prompts there too), the cache is exact at temperature 0
    model = tiny_moe()
    prompts, valid = left_pad([[3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13]], pad_id=0)
    plain = run(model, prompts, attention_mask=valid, **kw)
    cached = run(model, prompts, attention_mask=valid, cache=cache, **kw)
    assert torch.equal(plain.sequences, cached.sequences)
    assert not (plain.sequences == MASK_ID).any()


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_caches_are_exact_for_one_moe_layer(cache):
    model = tiny_moe(layers=1)
    kw = dict(steps=12, gen_length=12, block_length=4)
    assert torch.equal(run(model, PROMPT, **kw).sequences,
                       run(model, PROMPT, cache=cache, **kw).sequences)  # fmt: skip


@pytest.mark.parametrize(
    "kw",
    [
        dict(schedule="dream", remasking="entropy", alg_temp=0.5, temperature=0.5, top_p=0.9),
        dict(remasking="topk_margin", schedule="dream"),
        dict(remasking="origin", temperature=1.0, ddpm_cache=True),
        dict(threshold=0.05, block_length=4),
        dict(remasking="random", temperature=0.8, block_length=4),
    ],
    ids=["dream_entropy", "topk_margin", "origin_ddpm_cache", "threshold", "random"],
)
def test_every_sampler_path_fills_every_mask(kw):
    out = run(tiny_moe(), PROMPT, steps=8, gen_length=8,
              generator=torch.Generator().manual_seed(1), **kw)  # fmt: skip
    assert not (out.sequences == MASK_ID).any()
    assert torch.equal(out.sequences[:, :5], PROMPT)


def test_likelihood_of_an_moe_is_exact_for_one_token():
    model = tiny_moe()
    prompt, answer = PROMPT[0], torch.tensor([7, 8, 9])
    gen = torch.Generator().manual_seed(0)
    est = log_likelihood(model, prompt, answer, mask_id=MASK_ID, mc_num=8, batch_size=4,
                         generator=gen)  # fmt: skip
    assert math.isfinite(est.value) and est.value < 0 and est.stderr is not None
    # one answer token: masked alone, so the estimate is log softmax at it, exactly
    one = log_likelihood(model, prompt, answer[:1], mask_id=MASK_ID)
    with torch.no_grad():
        logits = model(torch.cat([prompt, torch.tensor([MASK_ID])])[None])[0, -1]
    assert one.value == pytest.approx(torch.log_softmax(logits.double(), -1)[7].item(), 1e-6)


def test_lora_on_attention_trains_only_adapters_and_resumes(tmp_path):
    pytest.importorskip("peft")
    lora = {"model": {"lora": True, "lora_r": 4, "lora_alpha": 8,
                      "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
            "train": {"max_steps": 6, "save_steps": 3}}  # fmt: skip
    trainer = Trainer(load_config(write_run_config(tmp_path, "run", SHORT, lora)))
    params = dict(trainer.model.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    trainable = {n for n, p in params.items() if p.requires_grad}
    assert trainable and all("lora_" in n and "self_attn" in n for n in trainable)
    trainer.train()
    changed = {n for n, p in params.items() if not torch.equal(p.detach(), before[n])}
    assert changed == trainable  # every factor moved, no base weight (nor expert) did
    full = losses(tmp_path / "run")
    assert all(math.isfinite(v) for v in full.values())
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    shutil.copytree(tmp_path / "run" / "checkpoint-3", stopped / "checkpoint-3")
    resume = deep_update(lora, {"train": {"resume_from_checkpoint": True}})
    again = Trainer(load_config(write_run_config(tmp_path, "stopped", SHORT, resume)))
    assert again.step == 3
    again.train()
    resumed = losses(Path(tmp_path / "stopped"))
    assert sorted(resumed) == [4, 5, 6]
    assert all(resumed[s] == full[s] for s in (4, 5, 6))  # exactly, on CPU


def test_lora_on_the_expert_stacks_trains_merges_and_resumes(tmp_path):
    pytest.importorskip("peft")
    from unmask.models.lora import save_lora

    lora = {"model": {"lora": True, "lora_r": 2, "lora_alpha": 4, "lora_dropout": 0.0,
                      "lora_target_modules": ["q_proj", "experts"]},
            "train": {"max_steps": 6, "save_steps": 3}}  # fmt: skip
    trainer = Trainer(load_config(write_run_config(tmp_path, "run", SHORT, lora)))
    params = dict(trainer.model.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    trainable = {n for n, p in params.items() if p.requires_grad}
    assert all("lora_" in n for n in trainable)
    from peft.tuners.lora.layer import ParamWrapper

    wrapped = sorted(
        m.parameter_name for m in trainer.model.modules() if isinstance(m, ParamWrapper)
    )
    assert wrapped == sorted(["gate_proj", "up_proj", "down_proj"] * 2)  # each stack, 2 layers
    expert_factors = {n for n in trainable if "experts" in n}
    assert len(expert_factors) == 2 * 2 * 3  # (A, B) x 2 layers x 3 stacks
    trainer.train()
    changed = {n for n, p in params.items() if not torch.equal(p.detach(), before[n])}
    assert changed == trainable  # every factor moved, no base weight (nor expert stack) did
    # merged export: a plain folder whose logits are the adapted model's
    model = trainer.model.eval()
    ids = torch.randint(4, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model(ids)
    merged_cfg = trainer.cfg.model.model_copy(update={"lora_merge": True})
    save_lora(model, tmp_path / "out", tmp_path / "out" / "final", merged_cfg)
    exported = from_pretrained(tmp_path / "out" / "final").eval()
    with torch.no_grad():
        assert (exported(ids) - reference).abs().max().item() < 1e-5
    # the run's final/ is the adapter: it opens for sampling merged into its recorded base
    from unmask.checkpoint.open import load_for_sampling

    opened = load_for_sampling(tmp_path / "run" / "final", device="cpu")
    with torch.no_grad():
        assert (opened.model(ids) - reference).abs().max().item() < 1e-5
    full = losses(tmp_path / "run")
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    shutil.copytree(tmp_path / "run" / "checkpoint-3", stopped / "checkpoint-3")
    resume = deep_update(lora, {"train": {"resume_from_checkpoint": True}})
    again = Trainer(load_config(write_run_config(tmp_path, "stopped", SHORT, resume)))
    again.train()
    resumed = losses(stopped)
    assert sorted(resumed) == [4, 5, 6]
    assert all(resumed[s] == full[s] for s in (4, 5, 6))  # exactly, on CPU


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"model": {"lora_dropout": 0.05}},
         "model.lora_dropout=0.05 cannot apply to the expert stacks"),
        ({"model": {"num_experts": 0}}, "holds 'experts' but this model has no routed expert"),
        ({"train": {"expert_parallel": 2}},
         "LoRA on the expert stacks (lora_target_modules holds 'experts') does not run under "
         "parallel.expert_parallel=2"),
    ],
)  # fmt: skip
def test_lora_on_experts_refusals_are_one_line_exit_2(tmp_path, capsys, extra, message):
    from unmask.cli import main

    lora = {"model": {"lora": True, "lora_dropout": 0.0,
                      "lora_target_modules": ["q_proj", "experts"]}}  # fmt: skip
    path = write_run_config(tmp_path, "run", SHORT, deep_update(lora, extra))
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("unmask: error:") and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "run").exists()
