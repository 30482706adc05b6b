"""The `uniform` objective (unmask/diffusion/uniform.py): DiffusionGemma's canvas loss on a
fixed batch equals a short computation from its definition (docs/diffusion.md, Uniform
corruption) whose logits are transformers' DiffusionGemmaForBlockDiffusion's for the same
encoder input, corrupted canvas and self-conditioning signal; the canvas layout by hand;
the refusals (objective and family, canvas sizes, rows, settings), one line each; the
router frozen for fine-tuning, trained from scratch, and the keys that say otherwise."""

import math

import pytest
import torch
import torch.nn.functional as F
import transformers
import yaml
from test_diffusion_gemma import FULL, SLIDING, TEXT, VISION

from unmask.cli import main
from unmask.config import validate_tree
from unmask.data.tokenizer import build_char_tokenizer, ensure_special_tokens
from unmask.diffusion import DiffusionConfig, build_objective
from unmask.diffusion.uniform import canvas_rows
from unmask.errors import InputError
from unmask.models import build_model, from_pretrained
from unmask.optim import build_optimizer
from unmask.train.setup import build_train_model, plan_parallel

VOCAB, CANVAS, EOS = 97, 3, 1
assert TEXT["vocab_size"] == VOCAB  # test_diffusion_gemma's tiny transformers config


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(transformers' tiny DiffusionGemmaForBlockDiffusion, unmask's read of its folder)."""
    torch.manual_seed(0)
    config = transformers.DiffusionGemmaConfig(text_config=TEXT, vision_config=VISION,
                                               canvas_length=CANVAS, initializer_range=0.1)  # fmt: skip
    hf = transformers.DiffusionGemmaForBlockDiffusion(config).eval()
    with torch.no_grad():  # norms, scales and scalars away from 1: a swapped one shows
        for name, param in hf.named_parameters():
            if "norm" in name or name.endswith("scale"):
                param.uniform_(0.5, 1.5)
        for name, buffer in hf.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.uniform_(0.5, 1.5)
    folder = tmp_path_factory.mktemp("uniform") / "hf"
    hf.save_pretrained(folder)
    return hf, from_pretrained(folder).eval()


#: (prompt length, answer length, ends with EOS, padding maskable) of each row of L = 14:
#: two canvases; exactly one; a cut answer of four whole canvases; a last canvas of one
#: EOS and two EOS of fill; a cut answer whose last canvas runs past the row; an answer of
#: its EOS alone; a row without an answer (no canvas, nothing scored)
ROWS = [(5, 4, True, True), (8, 2, True, False), (2, 12, False, False), (3, 9, True, True),
        (6, 8, False, False), (4, 0, True, False), (14, 0, False, False)]  # fmt: skip
LENGTH = 14


def batch(seed: int = 3) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((len(ROWS), LENGTH), EOS)
    maskable = torch.zeros(len(ROWS), LENGTH, dtype=torch.bool)
    for row, (prompt, answer, ended, padded) in enumerate(ROWS):
        words = torch.randint(3, VOCAB, (prompt + answer,), generator=g)
        ids[row, : prompt + answer] = words
        stop = prompt + answer + int(ended)
        maskable[row, prompt:stop] = True
        if padded:
            maskable[row, prompt:] = True
    return {"input_ids": ids, "maskable": maskable}


def by_definition(hf, rows: dict, seed: int, prob: float = 0.5) -> tuple[float, int, dict]:
    """The loss from docs/diffusion.md's words, one row at a time with Python lists, the
    logits transformers': (sum of cross-entropies, scored positions, what was drawn)."""
    g = torch.Generator().manual_seed(seed)
    count, length = rows["input_ids"].shape
    eps = 1e-3
    t = (1 - eps) * torch.rand(count, generator=g) + eps
    u_canvas, u_self = torch.rand(count, generator=g), torch.rand(count, generator=g)
    u_replace = torch.rand(count, length, generator=g)
    u_token = torch.rand(count, length, generator=g)
    total, scored, seen = 0.0, 0, {"canvas": [], "self": []}
    for b in range(count):
        ids, maskable = rows["input_ids"][b].tolist(), rows["maskable"][b].tolist()
        if not any(maskable):
            continue
        start = maskable.index(True)
        eos = [i for i in range(start, length) if maskable[i] and ids[i] == EOS]
        end = eos[0] if eos else max(i for i in range(length) if maskable[i])
        answer = ids[start : end + 1]
        canvases = math.ceil(len(answer) / CANVAS)
        k = min(int(u_canvas[b] * canvases), canvases - 1)
        clean = answer[k * CANVAS : (k + 1) * CANVAS]
        score = [True] * len(clean)
        score += [bool(eos)] * (CANVAS - len(clean))  # EOS fill: scored after an EOS
        clean += [EOS] * (CANVAS - len(clean))
        noisy = [min(int(u_token[b, i] * VOCAB), VOCAB - 1) if u_replace[b, i] < t[b] else clean[i]
                 for i in range(CANVAS)]  # fmt: skip
        encoder = torch.tensor([ids[:start] + answer[: k * CANVAS]])
        canvas = torch.tensor([noisy])
        with torch.no_grad():
            logits = hf(input_ids=encoder, decoder_input_ids=canvas).logits
            if u_self[b] < prob:
                logits = hf(input_ids=encoder, decoder_input_ids=canvas,
                            self_conditioning_logits=logits).logits  # fmt: skip
        ce = F.cross_entropy(logits[0].double(), torch.tensor(clean), reduction="none")
        total += sum(ce[i].item() for i in range(CANVAS) if score[i])
        scored += sum(score)
        seen["canvas"].append(k)
        seen["self"].append(bool(u_self[b] < prob))
    return total, scored, seen


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_the_loss_equals_its_definition_with_transformers_logits(models, seed):
    hf, ours = models
    objective = build_objective(DiffusionConfig(objective="uniform"), mask_id=2, eos_id=EOS)
    rows = batch()
    with torch.no_grad():
        loss_sum, count = objective(ours, rows, torch.Generator().manual_seed(seed))
    expected, scored, seen = by_definition(hf, rows, seed)
    assert int(count) == scored
    assert loss_sum.item() / scored == pytest.approx(expected / scored, abs=1e-5)
    # what the seeds exercise: later canvases (the encoder reads earlier ones) and both
    # kinds of rows of the self-conditioning draw
    if seed == 0:
        assert max(seen["canvas"]) > 0 and any(seen["self"]) and not all(seen["self"])


def test_no_self_conditioning_is_one_decoder_pass(models):
    hf, ours = models
    cfg = DiffusionConfig(objective="uniform", self_conditioning_prob=0.0)
    objective = build_objective(cfg, mask_id=2, eos_id=EOS)
    rows = batch()
    with torch.no_grad():
        loss_sum, count = objective(ours, rows, torch.Generator().manual_seed(5))
    expected, scored, _ = by_definition(hf, rows, 5, prob=0.0)
    assert loss_sum.item() / scored == pytest.approx(expected / scored, abs=1e-5)


def test_noise_of_a_row_slice_is_the_whole_batch_noise_of_those_rows(models):
    """global_noise: rows [2, 5) of a batch drawn as a slice get the noise the whole batch's
    draw gives them (a rank of a multi-process run), hence the same loss terms."""
    _, ours = models
    objective = build_objective(DiffusionConfig(objective="uniform"), mask_id=2, eos_id=EOS)
    rows = batch()
    whole = objective.with_noise(rows, torch.Generator().manual_seed(7))
    part = objective.with_noise({k: v[2:5] for k, v in rows.items()},
                                torch.Generator().manual_seed(7), rows=(2, len(ROWS)))  # fmt: skip
    for key, value in part.items():
        assert torch.equal(value, whole[key][2:5]), key


def test_canvas_layout_by_hand():
    ids = torch.tensor([[7, 8, 9, 4, 5, EOS, EOS, EOS]])
    maskable = torch.tensor([[False] * 3 + [True] * 5])
    rows = canvas_rows(ids, maskable, EOS, 2, torch.tensor([0.9]))  # answer 4 5 EOS: 2 canvases
    assert rows["count"].tolist() == [2] and rows["index"].tolist() == [1]
    # the encoder reads the prompt and canvas 0, left-padded, positions from 0
    assert rows["encoder_ids"].tolist() == [[EOS, EOS, EOS, 7, 8, 9, 4, 5]]
    assert rows["prompt_mask"].tolist() == [[False] * 3 + [True] * 5]
    assert rows["position_ids"].tolist() == [[0, 0, 0, 0, 1, 2, 3, 4]]
    # canvas 1: the answer's EOS and one EOS of fill, both scored, at positions 5 and 6
    assert rows["canvas_ids"].tolist() == [[EOS, EOS]] and rows["scored"].tolist() == [[True, True]]
    assert rows["canvas_positions"].tolist() == [[5, 6]]
    # an answer cut by the row's end (no EOS): the columns past it are not scored
    cut = canvas_rows(torch.tensor([[7, 8, 4, 5, 6]]), torch.tensor([[False, False] + [True] * 3]),
                      EOS, 2, torch.tensor([0.99]))  # fmt: skip
    assert cut["index"].tolist() == [1] and cut["scored"].tolist() == [[True, False]]
    assert cut["canvas_ids"].tolist() == [[6, EOS]]


# -- refusals ------------------------------------------------------------------------------

GEMMA = {"model_type": "diffusion_gemma", "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
         "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
         "vocab_size": 128, "diffusion_gemma": {"sliding_window": 8, "canvas_length": 4,
                                                "layer_types": [SLIDING, FULL]}}  # fmt: skip


def tree(**sections) -> dict:
    base = {"model": dict(GEMMA), "diffusion": {"objective": "uniform"},
            "data": {"dataset": "synthetic", "packing": False, "packing_length": 20,
                     "synthetic_train_size": 64, "synthetic_eval_size": 16},
            "train": {"max_steps": 2, "per_device_train_batch_size": 4}}  # fmt: skip
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return base


@pytest.mark.parametrize("sections, message", [
    ({"model": {"model_type": "qwen3_dllm", "num_experts": 0, "diffusion_gemma": None}},
     r"^diffusion.objective 'uniform' trains a prompt encoder and canvas decoder \(model_type "
     r"diffusion_gemma\); model 'qwen3_dllm' has none: use a masked objective"),
    ({"diffusion": {"objective": "sft"}},
     r"^model 'diffusion_gemma' \(a canvas decoder\) has no \[MASK\] token: diffusion.objective "
     r"'sft' needs one; train it with diffusion.objective uniform$"),
    ({"model": {**GEMMA, "diffusion_gemma": {**GEMMA["diffusion_gemma"], "canvas_length": 32}}},
     r"^model.diffusion_gemma.canvas_length \(32\) is above data.packing_length \(20\)"),
    ({"model": {**GEMMA, "max_position_embeddings": 21}},
     r"canvas_length \(4\) with data.packing_length \(20\) needs 23 positions .* above "
     r"max_position_embeddings \(21\)"),
    ({"data": {"packing": True}}, r"needs one example per row: set data.packing: false"),
    ({"diffusion": {"objective": "uniform", "loss_weight": "uniform"}},
     r"diffusion.loss_weight is not used by objective uniform"),
    ({"diffusion": {"objective": "mdlm", "self_conditioning_prob": 0.2}, "model": {
        "model_type": "qwen3_dllm", "num_experts": 0, "diffusion_gemma": None}},
     r"diffusion.self_conditioning_prob needs objective uniform"),
    ({"train": {"activation_checkpointing": "full"}},
     r"diffusion_gemma's layers do not recompute yet"),
])  # fmt: skip
def test_refused_in_one_line_by_the_trainer_and_the_cli(tmp_path, capsys, sections, message):
    config = tree(**sections)
    config["model"] = {k: v for k, v in config["model"].items() if v is not None}
    with pytest.raises(InputError, match=message):
        plan_parallel(validate_tree(config), 1)
    config["train"]["output_dir"] = str(tmp_path / "run")
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    capsys.readouterr()
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("unmask: "), err
    assert not (tmp_path / "run").exists()  # refused before anything is written


def test_unmask_plan_plans_it_and_refuses_tensor_parallelism_in_one_line(tmp_path, capsys):
    config = tree()
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["plan", str(path), "--world", "8"]) == 0
    assert "canvas decoder:" in capsys.readouterr().out
    assert main(["plan", str(path), "parallel.tensor_parallel=2", "--world", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "parallel.tensor_parallel=2: model_type " \
        "'diffusion_gemma' trains under tensor parallelism, but unmask plan does not model its " \
        "split yet" in err, err  # fmt: skip


# -- the router ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma_folder(tmp_path_factory):
    from unmask.models import ModelConfig

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("gemma") / "model"
    build_model(ModelConfig(**GEMMA)).save_pretrained(str(folder))
    return folder


def routers(model):
    modules = [m for m in model.modules() if getattr(m, "is_moe_router", False)]
    return [p for m in modules for p in m.parameters()]


@pytest.mark.parametrize("pretrained, key, frozen", [
    (False, None, False),  # from scratch: a router to learn
    (True, None, True),  # fine-tuning: frozen (NeMo AutoModel's recipe)
    (True, False, False), (False, True, True),  # the key says otherwise
])  # fmt: skip
def test_router_frozen_for_fine_tuning_and_the_key_to_change_it(gemma_folder, pretrained, key,
                                                                 frozen):  # fmt: skip
    diffusion = {"objective": "uniform"} | ({} if key is None else {"freeze_router": key})
    config = tree(diffusion=diffusion)
    if pretrained:
        config["model"] = {"pretrained": str(gemma_folder)}
    cfg = validate_tree(config)
    tokenizer = build_char_tokenizer()
    ensure_special_tokens(tokenizer)
    model = build_train_model(cfg, tokenizer, 0, torch.device("cpu"), plan_parallel(cfg, 1), None)
    params = routers(model)
    assert len(params) == 3 * 2  # proj, scale, per_expert_scale of each layer
    assert all(p.requires_grad is not frozen for p in params)
    optimized = {id(p) for group in build_optimizer(cfg.optim, model).param_groups
                 for p in group["params"]}  # fmt: skip
    assert all((id(p) in optimized) is not frozen for p in params)
    objective = build_objective(cfg.diffusion, mask_id=2, eos_id=EOS)
    loss_sum, count = objective(model, batch(), torch.Generator().manual_seed(0))
    (loss_sum / count).backward()
    assert all((p.grad is None) is frozen for p in params)
    assert model.model.embed_tokens.weight.grad is not None  # the rest trains
