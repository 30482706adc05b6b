"""DiffusionGemma with images (models/diffusion_gemma_vision.py) against transformers'
DiffusionGemmaForBlockDiffusion: tiny random models with a tiny Gemma 4 vision tower, saved
by transformers and read by unmask; the same canvas logits (float32, 1e-5) for one image,
several images of different sizes per row, a batch with a text-only row, left padding, and
the bidirectional image blocks (use_bidirectional_attention: vision); folders with the tower
round-trip bit for bit and transformers reads unmask's; bad image input is one line."""

import json
import shutil

import pytest
import torch
import transformers
from safetensors import safe_open

from unmask.errors import InputError
from unmask.models import from_pretrained
from unmask.models.diffusion_gemma_vision import Images, folder_vision

SLIDING, FULL = "sliding_attention", "full_attention"
VOCAB, IMAGE, BOI, EOI = 97, 90, 91, 92
TEXT = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "global_head_dim": 16,
        "num_global_key_value_heads": 1, "sliding_window": 4,
        "layer_types": [SLIDING, FULL, SLIDING, FULL], "num_experts": 4, "top_k_experts": 2,
        "moe_intermediate_size": 24, "max_position_embeddings": 128,
        "final_logit_softcapping": 2.0, "initializer_range": 0.1}  # fmt: skip
VISION = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
          "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "patch_size": 2,
          "position_embedding_size": 16, "pooling_kernel_size": 2}  # fmt: skip
CANVAS = 6
PAD_ID = 0
TOLERANCE = 1e-5

pytestmark = pytest.mark.usefixtures("one_thread")


def transformers_model(bidirectional: bool = False, seed: int = 0):
    """A tiny DiffusionGemmaForBlockDiffusion with a two-layer vision tower; norms, scales,
    layer scalars and the position table drawn so a swapped one shows."""
    torch.manual_seed(seed)
    text = {**TEXT, "use_bidirectional_attention": "vision" if bidirectional else None}
    config = transformers.DiffusionGemmaConfig(
        text_config=text, vision_config=VISION, canvas_length=CANVAS, initializer_range=0.1,
        image_token_id=IMAGE, boi_token_id=BOI, eoi_token_id=EOI)  # fmt: skip
    model = transformers.DiffusionGemmaForBlockDiffusion(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("scale"):
                param.uniform_(0.5, 1.5)
            elif "position_embedding_table" in name or "vision" in name:
                param.normal_(0.0, 0.3)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="module", params=[False, True], ids=["causal", "bidirectional"])
def folders(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("dg_vision")
    hf = transformers_model(request.param)
    hf.save_pretrained(root / "hf")
    return hf, root / "hf"


def patches(shapes: list[tuple[int, int]], seed: int = 3) -> Images:
    """Images of (rows, columns) patches as the processor lays them out: row-major patches of
    3 x 2 x 2 pixels in [0, 1], (x, y) positions, padded to the largest with (-1, -1)."""
    g = torch.Generator().manual_seed(seed)
    most = max(r * c for r, c in shapes)
    pixels = torch.zeros(len(shapes), most, 3 * 2 * 2)
    positions = torch.full((len(shapes), most, 2), -1, dtype=torch.long)
    for i, (rows, cols) in enumerate(shapes):
        ys, xs = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
        positions[i, : rows * cols] = torch.stack((xs.flatten(), ys.flatten()), dim=-1)
        pixels[i, : rows * cols] = torch.rand(rows * cols, 12, generator=g)
    return Images(pixels, positions)


def soft_tokens(shape: tuple[int, int]) -> int:
    return (shape[0] // 2) * (shape[1] // 2)


def unpadded(parts: list, seed: int) -> list[int]:
    """Text tokens (2 .. 88: no pad, no EOS) and images ((rows, cols): BOI, its soft tokens,
    EOI)."""
    g = torch.Generator().manual_seed(seed)
    row: list[int] = []
    for part in parts:
        if isinstance(part, tuple):
            row += [BOI] + [IMAGE] * soft_tokens(part) + [EOI]
        else:
            row += torch.randint(2, 89, (part,), generator=g).tolist()
    return row


CASES = {
    "one image": [[3, (4, 4), 2]],
    "several images of different sizes per row": [[2, (4, 6), 1, (2, 2), 3],
                                                   [(6, 4), 2, (4, 4), 1]],
    "a batch with a text-only row, left padded": [[7], [1, (4, 4), 2]],
}  # fmt: skip


def batch(rows: list[list]):
    """(ids (B, L) left-padded, real (B, L) bool, the rows' images in order)."""
    tokens = [unpadded(r, seed) for seed, r in enumerate(rows)]
    length = max(len(t) for t in tokens)
    ids = torch.tensor([[PAD_ID] * (length - len(t)) + t for t in tokens])
    real = torch.tensor([[False] * (length - len(t)) + [True] * len(t) for t in tokens])
    shapes = [p for r in rows for p in r if isinstance(p, tuple)]
    return ids, real, patches(shapes)


def transformers_logits(hf, ids, real, images, canvas, previous):
    """transformers' forward, its encoder masks built as its `generate` builds them (its
    forward drops the bidirectional image blocks: encoder.create_masks_for_generate's
    result is not used there)."""
    kinds = (ids == IMAGE).long()
    masks = hf.model.encoder.create_masks_for_generate(
        config=hf.config, inputs_embeds=torch.empty(*ids.shape, 0), attention_mask=real,
        cache=None, position_ids=torch.arange(ids.shape[1])[None], mm_token_type_ids=kinds)  # fmt: skip
    pictures = {} if images is None else dict(pixel_values=images.pixel_values,
                                              image_position_ids=images.position_ids)  # fmt: skip
    with torch.no_grad():
        return hf(input_ids=ids, attention_mask=masks, decoder_input_ids=canvas,
                  self_conditioning_logits=previous, **pictures,
                  decoder_attention_mask=torch.nn.functional.pad(real, (0, CANVAS), value=True),
                  ).logits  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_logits_with_images_equal_transformers(folders, case):
    hf, folder = folders
    ours = from_pretrained(folder).eval()
    ids, real, images = batch(CASES[case])
    g = torch.Generator().manual_seed(7)
    canvas = torch.randint(0, VOCAB, (ids.shape[0], CANVAS), generator=g)
    previous = 3 * torch.randn(ids.shape[0], CANVAS, VOCAB, generator=g)
    expected = transformers_logits(hf, ids, real, images, canvas, previous)
    with torch.no_grad():
        got = ours(ids, canvas, previous, prompt_mask=real, images=images)
        assert (got - expected).abs().max().item() <= TOLERANCE
        # the pictures matter: other pixels, other logits (rows with an image)
        other = Images(images.pixel_values.flip(1), images.position_ids)
        moved = ours(ids, canvas, previous, prompt_mask=real, images=other)
        has = (ids == IMAGE).any(dim=1)
        assert ((moved - got).abs().amax(dim=(1, 2)) > 1e-4).tolist() == has.tolist()


def test_the_bidirectional_rule_is_the_configs(folders):
    """use_bidirectional_attention: vision turns the image blocks on, else they are off; the
    other rule gives other logits than transformers' (so the parity above sees the rule)."""
    hf, folder = folders
    ours = from_pretrained(folder).eval()
    vision = folder_vision(ours)
    assert vision.bidirectional == (hf.config.text_config.use_bidirectional_attention == "vision")
    ids, real, images = batch(CASES["several images of different sizes per row"])
    canvas = torch.randint(0, VOCAB, (ids.shape[0], CANVAS), generator=torch.Generator())
    expected = transformers_logits(hf, ids, real, images, canvas, None)
    vision.bidirectional = not vision.bidirectional
    with torch.no_grad():
        other = ours(ids, canvas, prompt_mask=real, images=images)
    assert (other - expected).abs().max().item() > 1e-4


def test_folders_with_the_tower_round_trip_and_transformers_reads_ours(folders, tmp_path):
    hf, folder = folders
    ours = from_pretrained(folder).eval()
    ids, real, images = batch(CASES["several images of different sizes per row"])
    canvas = torch.randint(0, VOCAB, (ids.shape[0], CANVAS), generator=torch.Generator())
    with torch.no_grad():
        before = ours(ids, canvas, prompt_mask=real, images=images)
    ours.save_pretrained(tmp_path / "ours")
    with safe_open(str(folder / "model.safetensors"), "pt") as theirs, \
            safe_open(str(tmp_path / "ours" / "model.safetensors"), "pt") as written:  # fmt: skip
        assert set(written.keys()) == set(theirs.keys())
        assert any(key.startswith("model.encoder.vision_tower.") for key in theirs.keys())
        for key in theirs.keys():
            assert torch.equal(written.get_tensor(key), theirs.get_tensor(key)), key
    again = from_pretrained(tmp_path / "ours").eval()
    for key, tensor in folder_vision(ours).state_dict().items():
        assert torch.equal(tensor, folder_vision(again).state_dict()[key]), key
    with torch.no_grad():
        assert torch.equal(again(ids, canvas, prompt_mask=real, images=images), before)
    back = transformers.DiffusionGemmaForBlockDiffusion.from_pretrained(tmp_path / "ours").eval()
    expected = transformers_logits(back, ids, real, images, canvas, None)
    assert (before - expected).abs().max().item() <= TOLERANCE


def test_bad_image_input_is_one_line(folders, tmp_path):
    hf, folder = folders
    ours = from_pretrained(folder).eval()
    ids, real, images = batch(CASES["one image"])
    canvas = torch.zeros(1, CANVAS, dtype=torch.long)
    two = patches([(4, 4), (4, 4)])
    with pytest.raises(InputError, match="the prompts hold 4 image tokens but their 2 image"):
        ours(ids, canvas, images=two)
    text_only = from_pretrained(folder).eval()
    text_only.hf_carried_weights = {}
    with pytest.raises(InputError, match="this model has no vision tower"):
        text_only(ids, canvas, images=images)


# ------------------------------------------------ sample(images=) equals transformers' generate

EOS, PAD = 1, 0
OPTIONS = dict(max_denoising_steps=6, temperature_start=0.3, temperature_end=0.1,
               confidence_threshold=0.3)  # fmt: skip
THEIRS = dict(max_denoising_steps=6, t_max=0.3, t_min=0.1, confidence_threshold=0.3)
#: 22 prompts: text only, one image, two of different sizes, text between and around
PROMPTS = [[3, (4, 4), 2], [5], [(2, 2)], [1, (4, 6), 2, (2, 4), 1], [9], [2, (6, 6)],
           [(4, 4), 4], [3, (2, 2), (2, 2), 1], [12], [1, (6, 4), 3], [4, (4, 2), 2],
           [(2, 6), 1], [7, (4, 4)], [2], [1, (2, 2), 5, (4, 4), 1], [6, (2, 4), 2],
           [(4, 4), (2, 2)], [3], [8, (6, 2), 1], [2, (4, 4), 2], [(2, 2), 6], [4, (2, 4)]]  # fmt: skip


def row_images(parts: list) -> Images | None:
    shapes = [p for p in parts if isinstance(p, tuple)]
    return patches(shapes, seed=len(parts) * 7 + len(shapes)) if shapes else None


def stacked(rows: list[Images | None]) -> Images:
    """The rows' images in order, padded to the largest patch count."""
    given = [r for r in rows if r is not None]
    most = max(r.pixel_values.shape[1] for r in given)
    pixels = [torch.nn.functional.pad(r.pixel_values, (0, 0, 0, most - r.pixel_values.shape[1]))
              for r in given]  # fmt: skip
    positions = [torch.nn.functional.pad(r.position_ids, (0, 0, 0, most - r.position_ids.shape[1]),
                                         value=-1) for r in given]  # fmt: skip
    return Images(torch.cat(pixels), torch.cat(positions))


@torch.no_grad()
def transformers_alone(hf, ids: list[int], images: Images | None, seed: int) -> list[int]:
    """transformers' generate for one prompt (its images) after torch.manual_seed(seed), the
    answer as unmask writes it (12 tokens, EOS after the first EOS)."""
    ids_t = torch.tensor([ids])
    extra = {} if images is None else dict(pixel_values=images.pixel_values,
                                           image_position_ids=images.position_ids,
                                           mm_token_type_ids=(ids_t == IMAGE).long())  # fmt: skip
    torch.manual_seed(seed)
    out = hf.generate(ids_t, max_new_tokens=12, eos_token_id=EOS, pad_token_id=PAD,
                      **THEIRS, **extra)  # fmt: skip
    answer = out.sequences[0, len(ids) :].tolist()[:12]
    if EOS in answer:
        answer = answer[: answer.index(EOS) + 1]
    return answer + [EOS] * (12 - len(answer))


def test_sample_with_images_equals_transformers_generate_alone_and_batched(folders):
    from unmask.sampling import SamplingConfig, left_pad, sample

    hf, folder = folders
    ours = from_pretrained(folder).eval()
    rows = [unpadded(p, seed) for seed, p in enumerate(PROMPTS)]
    images = [row_images(p) for p in PROMPTS]
    config = SamplingConfig(gen_length=12, uniform_canvas=True, **OPTIONS)
    expected = [
        transformers_alone(hf, r, im, 300 + i) for i, (r, im) in enumerate(zip(rows, images))
    ]
    alone = []
    for i, (r, im) in enumerate(zip(rows, images)):
        out = sample(ours, torch.tensor([r]), config, mask_id=PAD, eos_id=EOS, pad_id=PAD,
                     generator=torch.Generator().manual_seed(300 + i), images=im)  # fmt: skip
        alone.append(out.answers[0].tolist())
    assert alone == expected
    ids, valid = left_pad(rows, PAD)
    out = sample(ours, ids, config, mask_id=PAD, eos_id=EOS, pad_id=PAD, attention_mask=valid,
                 generator=torch.Generator().manual_seed(300), images=stacked(images))  # fmt: skip
    assert [row.tolist() for row in out.answers] == expected
    assert len({tuple(a) for a in expected}) >= 18  # the answers differ from row to row
    # the images are read: other pixels, other answers for some rows with an image
    flipped = sample(ours, ids, config, mask_id=PAD, eos_id=EOS, pad_id=PAD,
                     attention_mask=valid, generator=torch.Generator().manual_seed(300),
                     images=Images(stacked(images).pixel_values.flip(1) * 0.0 + 0.5,
                                   stacked(images).position_ids))  # fmt: skip
    assert [row.tolist() for row in flipped.answers] != expected


# ------------------------------------------ the uniform objective with pictures in the encoder

#: (prompt parts, answer tokens, ended): rows whose prompts hold pictures, one without
TRAIN_ROWS = [([2, (4, 4), 1], 7, True), ([(2, 4), 3], 5, False), ([4], 6, True),
              ([1, (2, 2), 2, (4, 2)], 8, True)]  # fmt: skip
TRAIN_CANVAS = CANVAS


def train_batch(seed: int = 5) -> tuple[dict, list[Images | None]]:
    """Right-padded rows (EOS) of prompt + answer, `maskable` over the answer (and its EOS),
    the pictures of all rows in order; and each row's own pictures."""
    g = torch.Generator().manual_seed(seed)
    rows, masks, own = [], [], []
    for index, (parts, answer, ended) in enumerate(TRAIN_ROWS):
        prompt = unpadded(parts, 40 + index)
        words = torch.randint(3, 89, (answer,), generator=g).tolist()
        rows.append(prompt + words + [EOS] * int(ended))
        masks.append([False] * len(prompt) + [True] * (answer + int(ended)))
        shapes = [p for p in parts if isinstance(p, tuple)]
        own.append(patches(shapes, seed=index) if shapes else None)
    length = max(len(r) for r in rows) + 2
    ids = torch.tensor([r + [EOS] * (length - len(r)) for r in rows])
    maskable = torch.tensor([m + [False] * (length - len(m)) for m in masks])
    return {"input_ids": ids, "maskable": maskable, "images": stacked(own)}, own


def loss_by_definition(hf, batch: dict, own: list, seed: int) -> tuple[float, int]:
    """docs/diffusion.md's uniform loss row by row (the draws as the objective makes them,
    self-conditioning off), the logits transformers' with each row's own pictures."""
    import math

    g = torch.Generator().manual_seed(seed)
    count, length = batch["input_ids"].shape
    t = (1 - 1e-3) * torch.rand(count, generator=g) + 1e-3
    u_canvas, _ = torch.rand(count, generator=g), torch.rand(count, generator=g)
    u_replace, u_token = (
        torch.rand(count, length, generator=g),
        torch.rand(count, length, generator=g),
    )
    total, scored = 0.0, 0
    for b in range(count):
        ids, maskable = batch["input_ids"][b].tolist(), batch["maskable"][b].tolist()
        start = maskable.index(True)
        eos = [i for i in range(start, length) if maskable[i] and ids[i] == EOS]
        end = eos[0] if eos else max(i for i in range(length) if maskable[i])
        answer = ids[start : end + 1]
        canvases = math.ceil(len(answer) / TRAIN_CANVAS)
        k = min(int(u_canvas[b] * canvases), canvases - 1)
        clean = answer[k * TRAIN_CANVAS : (k + 1) * TRAIN_CANVAS]
        score = [True] * len(clean) + [bool(eos)] * (TRAIN_CANVAS - len(clean))
        clean += [EOS] * (TRAIN_CANVAS - len(clean))
        noisy = [min(int(u_token[b, i] * VOCAB), VOCAB - 1) if u_replace[b, i] < t[b] else clean[i]
                 for i in range(TRAIN_CANVAS)]  # fmt: skip
        encoder = torch.tensor([ids[:start] + answer[: k * TRAIN_CANVAS]])
        logits = transformers_logits(hf, encoder, torch.ones_like(encoder, dtype=torch.bool),
                                     own[b], torch.tensor([noisy]), None)  # fmt: skip
        ce = torch.nn.functional.cross_entropy(logits[0].double(), torch.tensor(clean),
                                               reduction="none")  # fmt: skip
        total += sum(ce[i].item() for i in range(TRAIN_CANVAS) if score[i])
        scored += sum(score)
    return total, scored


@pytest.mark.parametrize("seed", [0, 1])
def test_the_uniform_loss_with_pictures_equals_its_definition(folders, seed):
    from unmask.diffusion import DiffusionConfig, build_objective

    hf, folder = folders
    ours = from_pretrained(folder).eval()
    objective = build_objective(DiffusionConfig(objective="uniform", self_conditioning_prob=0.0),
                                mask_id=2, eos_id=EOS)  # fmt: skip
    batch, own = train_batch()
    with torch.no_grad():
        loss_sum, count = objective(ours, batch, torch.Generator().manual_seed(seed))
        without, _ = objective(ours, {k: v for k, v in batch.items() if k != "images"} | {
            "input_ids": batch["input_ids"].masked_fill(batch["input_ids"] == IMAGE, 3)},
            torch.Generator().manual_seed(seed))  # fmt: skip
    expected, scored = loss_by_definition(hf, batch, own, seed)
    assert int(count) == scored
    assert loss_sum.item() / scored == pytest.approx(expected / scored, abs=1e-5)
    assert abs(without.item() - loss_sum.item()) / scored > 1e-4  # the pictures count


# ------------------------------------- model.freeze_vision: the tower and projector trained


@pytest.fixture(scope="module")
def causal(tmp_path_factory):
    """The causal tiny model and its folder: the cases below do not depend on the rule."""
    root = tmp_path_factory.mktemp("dg_vision_causal")
    hf = transformers_model(False)
    hf.save_pretrained(root / "hf")
    return hf, root / "hf"


def vision_keys(state) -> list[str]:
    return sorted(k for k in state if k.startswith(("model.encoder.vision_tower.",
                                                    "model.encoder.embed_vision.")))  # fmt: skip


def built(folder, **section):
    from unmask.models import ModelConfig, build_model

    return build_model(ModelConfig(pretrained=str(folder), **section))


def test_frozen_by_default_the_tower_stays_apart(causal):
    hf, folder = causal
    model = built(folder)
    assert vision_keys(model.state_dict()) == []
    assert not any(p.requires_grad for p in folder_vision(model).parameters())
    assert folder_vision(model) is not getattr(model.model, "encoder", None)
    assert len(vision_keys(model.hf_carried_weights)) == len(vision_keys(hf.state_dict()))


@pytest.mark.parametrize("freeze, tower, projector", [(False, True, True), ("tower", False, True),
                                                      ("projector", True, False)])  # fmt: skip
def test_freeze_vision_registers_the_tower_under_the_folders_names(causal, freeze, tower,
                                                                    projector):  # fmt: skip
    hf, folder = causal
    frozen, model = built(folder).eval(), built(folder, freeze_vision=freeze).eval()
    state = model.state_dict()
    assert vision_keys(state) == vision_keys(hf.state_dict())
    for key in vision_keys(state):
        assert torch.equal(state[key], hf.state_dict()[key]), key
    assert vision_keys(model.hf_carried_weights) == []
    grads = {name: p.requires_grad for name, p in model.named_parameters()}
    assert {grads[k] for k in grads if k.startswith("model.encoder.vision_tower.")} == {tower}
    assert {grads[k] for k in grads if k.startswith("model.encoder.embed_vision.")} == {projector}
    ids, real, images = batch(CASES["several images of different sizes per row"])
    canvas = torch.randint(0, VOCAB, (ids.shape[0], CANVAS), generator=torch.Generator())
    with torch.no_grad():  # the same computation as the frozen, held-apart tower
        assert torch.equal(model(ids, canvas, prompt_mask=real, images=images),
                           frozen(ids, canvas, prompt_mask=real, images=images))  # fmt: skip
    model(ids, canvas, prompt_mask=real, images=images).sum().backward()
    for name, param in model.named_parameters():
        if name.startswith("model.encoder."):
            assert (param.grad is not None and param.grad.abs().sum() > 0) == param.requires_grad


def test_freeze_vision_refusals(causal, tmp_path):
    from unmask.models import ModelConfig

    hf, folder = causal
    with pytest.raises(ValueError, match="freeze_vision=False needs model.pretrained"):
        ModelConfig(model_type="diffusion_gemma", freeze_vision=False)
    with pytest.raises(ValueError, match="with model.lora: LoRA trains adapters only"):
        ModelConfig(pretrained=str(folder), freeze_vision="tower", lora=True)
    text_only = from_pretrained(folder)
    text_only.hf_source_config = {k: v for k, v in text_only.hf_source_config.items()
                                  if k != "vision_config"}  # fmt: skip
    text_only.hf_carried_weights = {}
    text_only.save_pretrained(tmp_path / "text")
    with pytest.raises(InputError, match="needs a diffusion_gemma folder with a vision tower"):
        built(tmp_path / "text", freeze_vision=False)


def test_the_request_check_refuses_a_folder_without_a_tower_before_any_build(causal, tmp_path):
    """check_vision_request (check_model_request's, which the trainer and `unmask plan` both
    run, issue 54): a trained or LoRA-adapted tower needs a diffusion_gemma folder whose
    config.json has a vision_config and whose weights hold the tower's tensors; the line is
    attach_vision's."""
    from unmask.models import ModelConfig, resolve_model
    from unmask.models.diffusion_gemma_vision import NO_TOWER
    from unmask.train.setup import check_vision_request

    hf, folder = causal
    text_only = from_pretrained(folder)
    source = dict(text_only.hf_source_config)
    text_only.hf_source_config = {k: v for k, v in source.items() if k != "vision_config"}
    text_only.hf_carried_weights = {}
    text_only.save_pretrained(tmp_path / "text")
    shutil.copytree(tmp_path / "text", tmp_path / "no_tensors")  # a vision_config, no tower
    (tmp_path / "no_tensors" / "config.json").write_text(json.dumps(source))
    sections = [dict(freeze_vision=False), dict(freeze_vision="tower"),
                dict(lora=True, lora_target_modules=["vision_tower"]),
                dict(lora=True, lora_target_modules=["q_proj", "embed_vision"])]  # fmt: skip
    for where in ("text", "no_tensors"):
        for section in sections:
            cfg = ModelConfig(pretrained=str(tmp_path / where), **section)
            with pytest.raises(InputError) as err:
                check_vision_request(resolve_model(cfg))
            assert str(err.value) == NO_TOWER, (where, section)
        check_vision_request(resolve_model(ModelConfig(pretrained=str(tmp_path / where))))
    for section in sections:  # the folder with its tower passes
        check_vision_request(resolve_model(ModelConfig(pretrained=str(folder), **section)))


def test_muon_routing_of_the_tower_and_projector(causal):
    """docs/multimodal.md's rule: the tower's hidden matrices on Muon; the patch embedding,
    the position table and the projector (names with `embed`: a map into a space, as the
    embedding) on AdamW with decay; norms on AdamW without decay."""
    from unmask.optim.routing import route_parameters

    hf, folder = causal
    routing = route_parameters(built(folder, freeze_vision=False))
    where = {name: group for group in ("muon", "adamw_decay", "adamw_no_decay")
             for name, _ in getattr(routing, group)}  # fmt: skip
    tower = "model.encoder.vision_tower."
    layer = tower + "encoder.layers.0."
    expected = {
        tower + "patch_embedder.input_proj.weight": "adamw_decay",
        tower + "patch_embedder.position_embedding_table": "adamw_decay",
        "model.encoder.embed_vision.embedding_projection.weight": "adamw_decay",
        **{f"{layer}self_attn.{p}_proj.linear.weight": "muon" for p in "qkvo"},
        **{f"{layer}mlp.{p}_proj.linear.weight": "muon" for p in ("gate", "up", "down")},
        **{f"{layer}self_attn.{p}_norm.weight": "adamw_no_decay" for p in "qk"},
        **{f"{layer}{n}.weight": "adamw_no_decay" for n in (
            "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
            "post_feedforward_layernorm")},
    }  # fmt: skip
    vision = {name: group for name, group in where.items() if name.startswith("model.encoder.")}
    layer1 = {k.replace(".layers.0.", ".layers.1."): v for k, v in expected.items()
              if ".layers.0." in k}  # fmt: skip
    assert vision == {**expected, **layer1}


def test_a_trained_tower_saves_reads_bit_exact_and_transformers_reads_it(causal, tmp_path):
    """A changed (trained) tower and projector: save_pretrained writes them from the state
    dict, reading the folder back gives them bit for bit (trained or frozen again), and
    transformers' logits on the saved folder equal unmask's (1e-5)."""
    hf, folder = causal
    model = built(folder, freeze_vision=False).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith("model.encoder."):
                param.add_(0.05 * torch.randn(param.shape, generator=torch.Generator()))
    ids, real, images = batch(CASES["several images of different sizes per row"])
    canvas = torch.randint(0, VOCAB, (ids.shape[0], CANVAS), generator=torch.Generator())
    with torch.no_grad():
        before = model(ids, canvas, prompt_mask=real, images=images)
    model.save_pretrained(tmp_path / "trained")
    state = model.state_dict()
    with safe_open(str(tmp_path / "trained" / "model.safetensors"), "pt") as written:
        assert vision_keys(written.keys()) == vision_keys(state)
        for key in vision_keys(state):
            assert torch.equal(written.get_tensor(key), state[key]), key
    for freeze in (False, True):
        again = built(tmp_path / "trained", freeze_vision=freeze).eval()
        for key, tensor in folder_vision(model).state_dict().items():
            assert torch.equal(tensor, folder_vision(again).state_dict()[key]), key
        with torch.no_grad():
            assert torch.equal(again(ids, canvas, prompt_mask=real, images=images), before)
    back = transformers.DiffusionGemmaForBlockDiffusion.from_pretrained(tmp_path / "trained")
    expected = transformers_logits(back.eval(), ids, real, images, canvas, None)
    assert (before - expected).abs().max().item() <= TOLERANCE
    original = transformers_logits(hf, ids, real, images, canvas, None)
    assert (before - original).abs().max().item() > 1e-3  # the changed tower is what was read


def test_a_trained_tower_resumes_bit_exact_from_a_checkpoint(causal, tmp_path):
    """Two steps straight equal one step, a checkpoint, a fresh model and optimizer loaded
    from it, one step: the tower, the projector and their optimizer state bit for bit."""
    from unmask.checkpoint.checkpointer import Checkpointer

    hf, folder = causal
    ids, real, images = batch(CASES["several images of different sizes per row"])
    canvas = torch.randint(0, VOCAB, (ids.shape[0], CANVAS), generator=torch.Generator())

    def trainer(freeze):
        model = built(folder, freeze_vision=freeze)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-2)
        return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)

    def step(model, optimizer, scheduler):
        optimizer.zero_grad()
        model(ids, canvas, prompt_mask=real, images=images).logsumexp(-1).mean().backward()
        optimizer.step()
        scheduler.step()

    straight = trainer("tower")
    step(*straight)
    saver = Checkpointer(tmp_path / "run")
    path = saver.save(1, *straight, {"step": 1}, {})
    step(*straight)
    resumed = trainer("tower")
    saver.load(path, *resumed)
    step(*resumed)
    ours, theirs = straight[0].state_dict(), resumed[0].state_dict()
    assert vision_keys(ours) and ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
    projection = "model.encoder.embed_vision.embedding_projection.weight"
    assert not torch.equal(ours[projection], hf.state_dict()[projection])  # it trained
    tower = "model.encoder.vision_tower.patch_embedder.input_proj.weight"
    assert torch.equal(ours[tower], hf.state_dict()[tower])  # frozen: as read


# ------------------------------------------------------ LoRA on the tower and the projector

TOWER_LINEAR = {f"self_attn.{p}_proj" for p in "qkvo"} | {f"mlp.{p}_proj" for p in
                                                          ("gate", "up", "down")}  # fmt: skip


def lora_model(folder, targets):
    from unmask.models.lora import apply_lora

    section = dict(lora=True, lora_r=4, lora_alpha=8, lora_dropout=0.0,
                   lora_target_modules=targets)  # fmt: skip
    model = built(folder, **section)
    from unmask.models import ModelConfig

    return apply_lora(model, ModelConfig(pretrained=str(folder), **section))


def adapted_modules(model) -> set[str]:
    from peft.tuners.lora.layer import Linear

    return {name.removeprefix("base_model.model.") for name, m in model.named_modules()
            if isinstance(m, Linear)}  # fmt: skip


@pytest.mark.parametrize("targets", [["vision_tower"], ["embed_vision"], ["q_proj", "embed_vision"],
                                     ["all-linear", "vision_tower", "embed_vision"]])  # fmt: skip
def test_lora_targets_on_the_tower_and_the_projector_are_chosen_separately(causal, targets):
    pytest.importorskip("peft")
    hf, folder = causal
    found = adapted_modules(lora_model(folder, targets))
    tower = {f"model.encoder.vision_tower.encoder.layers.{i}.{n}.linear" for i in range(2)
             for n in TOWER_LINEAR}  # fmt: skip
    projector = {"model.encoder.embed_vision.embedding_projection"}
    stack_q = {f"model.layers.{i}.self_attn.q_proj" for i in range(4)}
    stack = {f"model.layers.{i}.{n}" for i in range(4) for n in TOWER_LINEAR
             if not (n == "self_attn.v_proj" and i % 2)}  # full layers: no v_proj  # fmt: skip
    expected = {"vision_tower": tower, "embed_vision": projector, "q_proj": stack_q,
                "all-linear": stack}  # fmt: skip
    assert found == set().union(*(expected[t] for t in targets))


def test_lora_on_the_tower_and_projector_keeps_the_base_and_reloads_with_equal_logits(
        causal, tmp_path):  # fmt: skip
    """Three AdamW steps on the adapters of the tower and the projector (pictures in the
    batch): the base weights (tower and projector included) stay bit for bit; the adapter
    saved in peft's format, merged into a fresh base, gives the trained model's logits; the
    merged folder reads back (unmask and transformers) with those logits."""
    pytest.importorskip("peft")
    from unmask.models.diffusion_gemma_vision import attach_vision
    from unmask.models.lora import adapts_vision, merge_adapter, save_adapter

    hf, folder = causal
    model = lora_model(folder, ["vision_tower", "embed_vision"])
    base = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}
    ids, real, images = batch(CASES["several images of different sizes per row"])
    canvas = torch.randint(0, VOCAB, (ids.shape[0], CANVAS), generator=torch.Generator())
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-2)
    for _ in range(3):
        optimizer.zero_grad()
        model(ids, canvas, prompt_mask=real, images=images).logsumexp(-1).mean().backward()
        optimizer.step()
    for key, value in model.state_dict().items():
        if "lora_" not in key:
            assert torch.equal(value, base[key]), key
    model.eval()
    with torch.no_grad():
        trained = model(ids, canvas, prompt_mask=real, images=images)
        plain = from_pretrained(folder).eval()(ids, canvas, prompt_mask=real, images=images)
    assert (trained - plain).abs().max().item() > 1e-3  # the adapters moved the logits
    save_adapter(model, tmp_path / "adapter")
    assert adapts_vision(tmp_path / "adapter")
    # as `unmask generate --model ADAPTER` reads it: the recorded base, its tower registered
    # for the merge, the fingerprint of the frozen base (tower included) checked
    from unmask.checkpoint.saved import inspect_saved, load_saved_model
    from unmask.models import ModelConfig
    from unmask.models.lora import LORA_BASE_FILE, base_fingerprint, base_record

    record = base_record(ModelConfig(pretrained=str(folder)), 0, VOCAB, base_fingerprint(model))
    (tmp_path / "adapter" / LORA_BASE_FILE).write_text(json.dumps(record))
    with torch.no_grad():
        loaded = load_saved_model(inspect_saved(tmp_path / "adapter"))
        read = loaded(ids, canvas, prompt_mask=real, images=images)
    assert (read - trained).abs().max().item() <= TOLERANCE
    fresh = from_pretrained(folder)
    attach_vision(fresh, True)
    merged = merge_adapter(fresh, tmp_path / "adapter").eval()
    with torch.no_grad():
        got = merged(ids, canvas, prompt_mask=real, images=images)
    assert (got - trained).abs().max().item() <= TOLERANCE
    merged.save_pretrained(tmp_path / "merged")
    with torch.no_grad():
        again = from_pretrained(tmp_path / "merged").eval()(ids, canvas, prompt_mask=real,
                                                            images=images)  # fmt: skip
    assert torch.equal(again, got)
    back = transformers.DiffusionGemmaForBlockDiffusion.from_pretrained(tmp_path / "merged")
    expected = transformers_logits(back.eval(), ids, real, images, canvas, None)
    assert (got - expected).abs().max().item() <= TOLERANCE


# ------------------------------------------------------------------ the tower's FLOPs (MFU)


@pytest.mark.parametrize("freeze", [True, "tower", "projector", False])
def test_tower_flops_equal_torchs_flop_counter(causal, freeze):
    """tower_flops (what the MFU adds for a call's pictures) equals FlopCounterMode over the
    tower and projector's forward and the backward the trained parts run; and the training
    call's count with pictures is the count without them plus exactly that."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from unmask.models.shape import DIFFUSION_GEMMA
    from unmask.train.mfu import flop_model

    hf, folder = causal
    model = built(folder, freeze_vision=freeze) if freeze is not True else built(folder)
    vision = folder_vision(model)
    images = patches([(4, 6), (2, 2), (6, 4)])
    counter = FlopCounterMode(display=False)
    # attention in matmuls the counter sees (it has no formula for the CPU's fused kernel)
    with sdpa_kernel(SDPBackend.MATH), counter:
        out = vision.soft_tokens(images)
        if out.requires_grad:
            out.sum().backward()
    flops = flop_model(model)
    assert flops.tower is not None
    assert int(flops.tower.call_flops(images)) == counter.get_total_flops()
    # the text part counts no tower weights
    assert flops.matmul_params == flop_model(built(folder)).matmul_params
    ids, real, _ = batch([[2, (4, 6), 1, (2, 2), 3], [(6, 4), 2]])
    canvas = torch.zeros(ids.shape[0], CANVAS, dtype=torch.long)
    without = DIFFUSION_GEMMA.call_flops(flops, model.config, (ids, canvas), {})
    counted = DIFFUSION_GEMMA.call_flops(flops, model.config, (ids, canvas), {"images": images})
    assert int(counted) - without == counter.get_total_flops()


# --------------------------------------------- unmask plan: the 26B-A4B's tower at 8 H100s


@pytest.fixture(scope="module")
def gemma_26b_folder(tmp_path_factory):
    """configs/models/diffusion_gemma_26b_a4b.yaml's architecture as a folder's config.json
    with transformers' default Gemma 4 vision tower (the planner reads no weights)."""
    import json
    from pathlib import Path

    from unmask.config import load_config
    from unmask.models import hf_config_dict

    yaml = Path(__file__).parents[2] / "configs" / "models" / "diffusion_gemma_26b_a4b.yaml"
    folder = tmp_path_factory.mktemp("gemma_26b")
    config = hf_config_dict(load_config(yaml).model)
    config["vision_config"] = transformers.DiffusionGemmaConfig().vision_config.to_dict()
    (folder / "config.json").write_text(json.dumps(config))
    return yaml, folder


def planned(gemma_26b_folder, freeze):
    from unmask.config import load_config

    yaml, folder = gemma_26b_folder
    return load_config(yaml, ["parallel.expert_parallel=8", f"model.pretrained={folder}",
                              f"model.freeze_vision={freeze}"])  # fmt: skip


@pytest.mark.parametrize("freeze", ["true", "tower", "false"])
def test_the_planner_counts_the_26b_a4b_tower_at_8_ranks(gemma_26b_folder, freeze):
    """transformers' default tower (768 wide, 16 layers of 12 heads of 64, MLP 3072, patches
    of 16, a 2 x 10240 position table) and the projector to 2816: frozen, whole on every
    rank in float32 and forward only; trained, FSDP2-sharded float32 with its gradients and
    AdamW's two moments over 8 ranks, one bfloat16 layer gathered, its saves; one picture
    of 280 soft tokens (2520 patches) per row."""
    from unmask.models.diffusion_gemma_vision import tower_flops
    from unmask.plan.vision import plan_tower, traced_tower_saves

    cfg = planned(gemma_26b_folder, freeze)
    tower = plan_tower(cfg, 8)
    h, inner, text, rows = 768, 3072, 2816, cfg.train.per_device_train_batch_size
    layer = 4 * h * h + 3 * h * inner + 2 * 64 + 4 * h  # q k v o, MLP, q/k norms, 4 norms
    projector = h * text
    total = 3 * 16 * 16 * h + 2 * 10240 * h + 16 * layer + projector
    assert tower.parameters == total == 169_527_296
    assert (tower.pictures, tower.patches) == (rows, 2520)
    trains = {"true": (False, False), "tower": (False, True), "false": (True, True)}[freeze]
    trained = (total - projector) * trains[0] + projector * trains[1]
    assert tower.trained == trained
    micro = cfg.train.gradient_accumulation_steps
    assert tower.flops == micro * tower_flops(
        {"hidden_size": h, "intermediate_size": inner, "num_hidden_layers": 16,
         "num_attention_heads": 12, "num_key_value_heads": 12, "head_dim": 64,
         "patch_size": 16, "pooling_kernel_size": 3}, text, rows, 2520, rows * 280, *trains)  # fmt: skip
    if freeze == "true":
        assert (tower.weights, tower.gradients, tower.optimizer, tower.activations) == (
            4 * total, 0, 0, 0)  # fmt: skip
        return
    assert tower.weights == 4 * total // 8 + 2 * layer  # bf16: a gathered layer
    assert tower.gradients == 4 * trained // 8
    assert tower.optimizer == 8 * trained // 8
    projector_input = rows * 280 * h * (4 + 2)
    if freeze == "tower":
        assert tower.activations == projector_input
    else:
        from unmask.models.diffusion_gemma_vision import Vision

        with torch.device("meta"):
            vision = Vision(json.loads((gemma_26b_folder[1] / "config.json").read_text()), text)
        saves = traced_tower_saves(vision, rows, 2520, torch.bfloat16)
        pooling = rows * 2520 * h * 4 + rows * 2520 * 280 * 4
        assert tower.activations == saves + pooling + projector_input
        assert saves > 16 * rows * 2520 * h * 2 * 8  # at least 8 saved (P, h) bf16 a layer


def test_the_planners_tower_saves_equal_a_cpu_forwards(causal):
    """traced_tower_saves (the meta device, attention as a fused kernel saves) against the
    saved tensors of a real forward of the tiny trained tower on the CPU (its fused
    attention), byte for byte."""
    from unmask.models.diffusion_gemma_vision import Vision
    from unmask.plan.vision import traced_tower_saves

    hf, folder = causal
    vision = folder_vision(built(folder, freeze_vision=False))
    images = patches([(4, 4), (4, 4)])
    params = {p.untyped_storage()._cdata for p in vision.parameters()}
    seen, total = set(), [0]

    def pack(t):
        key = t.untyped_storage()._cdata
        if key not in params and key not in seen:
            seen.add(key)
            total[0] += t.untyped_storage().nbytes()
        return t

    tower = vision.vision_tower
    padding = (images.position_ids == -1).all(dim=-1)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        x = tower.patch_embedder(images.pixel_values, images.position_ids, padding)
        for layer in tower.encoder.layers:
            x = layer(x, images.position_ids, ~padding)
    with torch.device("meta"):
        meta = Vision(from_pretrained(folder).hf_source_config, 32)
    traced = traced_tower_saves(meta, 2, 16, torch.float32)
    assert traced == total[0]


def test_unmask_plan_prints_the_tower(causal, tmp_path, capsys):
    """`unmask plan` of a run on a folder with a tower: the tower's counts beside the plan
    (text), and as `vision_tower` in --json (plan_tower's)."""
    from conftest import write_run_config

    from unmask.cli import main
    from unmask.config import load_config
    from unmask.plan.vision import plan_tower

    hf, folder = causal
    path = write_run_config(tmp_path, "tower", {"diffusion": {"objective": "uniform"}}, {
        "model": {"pretrained": str(folder), "freeze_vision": False}})  # fmt: skip
    args = ["plan", str(path), "--world", "1", "--device", "cpu"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "vision tower: 0.000 B parameters, freeze_vision False:" in text
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["vision_tower"] == plan_tower(load_config(path), 1).to_json()
    assert out["vision_tower"]["parameters"] == sum(
        p.numel() for p in folder_vision(from_pretrained(folder)).parameters())  # fmt: skip


@pytest.mark.parametrize("targets", [["vision_tower"], ["embed_vision"],
                                     ["vision_tower", "q_proj"]])  # fmt: skip
def test_unmask_plan_counts_lora_on_the_tower_as_the_trainer_builds_it(causal, tmp_path, capsys,
                                                                      targets):  # fmt: skip
    """LoRA on the tower / projector (freeze_vision true): `unmask plan` runs (vision targets
    only: the text model planned without LoRA) and counts the adapted part registered with
    its backward: the adapters' parameters are those peft adds to the trainer's model, the
    FLOPs the MFU's count of that model (tower_flop_model), activations saved."""
    pytest.importorskip("peft")
    from conftest import write_run_config

    from unmask.cli import main
    from unmask.config import load_config
    from unmask.models.diffusion_gemma_vision import tower_flop_model, tower_flops
    from unmask.plan.vision import plan_tower

    hf, folder = causal
    path = write_run_config(tmp_path, "lora", {"diffusion": {"objective": "uniform"}}, {
        "model": {"pretrained": str(folder), "lora": True, "lora_r": 4,
                  "lora_target_modules": targets}})  # fmt: skip
    assert main(["plan", str(path), "--world", "1", "--device", "cpu"]) == 0
    assert "LoRA: 0.0" in capsys.readouterr().out
    cfg = load_config(path)
    tower = plan_tower(cfg, 1)
    model = lora_model(folder, targets)
    adapters = sum(p.numel() for n, p in model.named_parameters()
                   if "lora_" in n and ".encoder." in n)  # fmt: skip
    assert tower.adapters == adapters > 0
    assert tower.gradients == 4 * adapters and tower.optimizer == 8 * adapters
    assert tower.weights == 4 * (tower.parameters + adapters)
    flops = tower_flop_model(model)
    assert (flops.tower, flops.projector) == ("vision_tower" in targets, "embed_vision" in targets)
    rows, k = tower.pictures, flops.cfg["pooling_kernel_size"]
    assert tower.flops == cfg.train.gradient_accumulation_steps * tower_flops(
        flops.cfg, flops.text_hidden, rows, tower.patches, rows * tower.patches // (k * k),
        flops.tower, flops.projector)  # fmt: skip
    assert tower.activations > 0


def test_the_towers_pictures_per_rank_are_the_text_plans_rows(causal, tmp_path):
    """plan_tower takes rows per rank and micro-batches as the text plan does (step_rows of
    parallel_of): under split_batches over 2 ranks half the rows of a rank's batch, and the
    FLOPs scale with them."""
    from conftest import write_run_config

    from unmask.config import load_config
    from unmask.plan.vision import plan_tower

    hf, folder = causal
    path = write_run_config(tmp_path, "split", {"diffusion": {"objective": "uniform"}}, {
        "model": {"pretrained": str(folder), "freeze_vision": False}})  # fmt: skip
    whole = plan_tower(load_config(path), 2)
    split = plan_tower(load_config(path, ["train.split_batches=true"]), 2)
    rows = load_config(path).train.per_device_train_batch_size
    assert (whole.pictures, split.pictures) == (rows, rows // 2)
    assert split.flops == pytest.approx(whole.flops / 2, rel=1e-12)
    assert split.activations < whole.activations


@pytest.mark.parametrize("freeze", [True, False])
def test_build_empty_like_loads_a_state_and_saves_the_folder_one_process_does(causal, tmp_path,
                                                                              freeze):  # fmt: skip
    """build_empty_like (what a sharded run's final save loads the gathered state into)
    writes the folder one process writes: the tower frozen (carried) or trained (its state)."""
    from unmask.models.build import build_empty_like

    hf, folder = causal
    model = built(folder, freeze_vision=freeze)
    plain = build_empty_like(model)
    plain.load_state_dict(model.state_dict())
    model.save_pretrained(tmp_path / "one")
    plain.save_pretrained(tmp_path / "sharded")
    with safe_open(str(tmp_path / "one" / "model.safetensors"), "pt") as one, \
            safe_open(str(tmp_path / "sharded" / "model.safetensors"), "pt") as sharded:  # fmt: skip
        assert set(one.keys()) == set(sharded.keys()) and vision_keys(one.keys())
        for key in one.keys():
            assert torch.equal(one.get_tensor(key), sharded.get_tensor(key)), key
    assert (tmp_path / "one" / "config.json").read_text() == (
        tmp_path / "sharded" / "config.json").read_text()  # fmt: skip


@pytest.mark.parametrize("freeze", [True, "tower"])
def test_a_dcp_checkpoint_exports_with_its_tower(causal, tmp_path, freeze):
    """A DCP checkpoint (one process, async_save) records the tower: its config.json's
    vision keys, the frozen tower's tensors beside the state, a trained one in it; the
    gathered model gives the saved model's logits with pictures and writes its folder."""
    from unmask.checkpoint.checkpointer import Checkpointer
    from unmask.checkpoint.saved import gather_distributed_checkpoint

    hf, folder = causal
    model = built(folder, freeze_vision=freeze).eval()
    if freeze is not True:
        with torch.no_grad():
            model.model.encoder.embed_vision.embedding_projection.weight.mul_(1.5)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    saver = Checkpointer(tmp_path / "run", async_save=True)
    path = saver.save(1, model, optimizer, scheduler, {"step": 1}, {})
    saver.wait()
    gathered = gather_distributed_checkpoint(path)
    ids, real, images = batch(CASES["several images of different sizes per row"])
    canvas = torch.randint(0, VOCAB, (ids.shape[0], CANVAS), generator=torch.Generator())
    with torch.no_grad():
        assert torch.equal(gathered(ids, canvas, prompt_mask=real, images=images),
                           model(ids, canvas, prompt_mask=real, images=images))  # fmt: skip
    model.save_pretrained(tmp_path / "one")
    gathered.save_pretrained(tmp_path / "gathered")
    with safe_open(str(tmp_path / "one" / "model.safetensors"), "pt") as one, \
            safe_open(str(tmp_path / "gathered" / "model.safetensors"), "pt") as other:  # fmt: skip
        assert set(one.keys()) == set(other.keys()) and vision_keys(one.keys())
        for key in one.keys():
            assert torch.equal(one.get_tensor(key), other.get_tensor(key)), key
