"""DiffusionGemma's images: the Gemma 4 vision tower and the `embed_vision` projector that
put a picture's soft tokens into the prompt encoder (models/diffusion_gemma.py).

What transformers 5.24 computes (models/gemma4 `Gemma4VisionModel`, models/diffusion_gemma
`DiffusionGemmaMultimodalEmbedder` and `DiffusionGemmaEncoderModel`), computed here the same
way:

- Input: the processor's patches, `pixel_values` (N, P, 3 x patch^2) in [0, 1], and their
  (x, y) grid positions `image_position_ids` (N, P, 2), (-1, -1) marking padding patches
  (images of different sizes share one P). Images are in the order their image tokens occur
  over the batch's rows (row 0's first, ...).
- Patch embedding: a linear map of 2 x (pixels - 0.5), plus a learned x embedding and a
  learned y embedding of the patch's position (zero on padding patches).
- Layers: input norm -> attention -> post-attention norm -> residual; pre-feedforward norm ->
  gated GELU (tanh) MLP -> post-feedforward norm -> residual. Attention is bidirectional
  over an image's real patches, scale 1.0, q/k RMSNorm per head (weights), v RMSNorm without
  weight, 2-D RoPE: the first half of each head rotates by the x position, the second half
  by the y position, each half with frequencies theta^(-4i / head_dim). RMSNorm multiplies
  by w (not 1 + w). With `use_clipped_linears` every projection clamps its input and
  output to stored bounds.
- Pooling: padding patches zeroed, then the average of each k x k block of patches
  (k = `pooling_kernel_size`) by their positions, times sqrt(hidden) in float32; blocks no
  patch falls in are dropped, so an image gives (its patch rows / k) x (patch columns / k)
  soft tokens; with `standardize`, (x - std_bias) x std_scale.
- Projector: weightless RMSNorm, then a linear map to the text model's hidden size.
- The encoder's embedding of each image token (`image_token_id`) is replaced by the next
  soft token (unscaled: only text embeddings are scaled by sqrt(hidden)); where
  text_config.use_bidirectional_attention is "vision", each run of consecutive image tokens
  also attends to itself bidirectionally in the encoder (every layer, window or not).

Frozen (`model.freeze_vision: true`, the default): held apart from the text model. The
folder's tower tensors stay the model's carried weights (`hf_carried_weights`, written back
as read), and the tower built from them is not a registered submodule, so it is not in the
state dict, the optimizer, FSDP's units or LoRA's targets.

Trained (`freeze_vision: false`, `tower` or `projector`: what stays frozen), or adapted by
LoRA (`vision_tower` / `embed_vision` in `lora_target_modules`): `attach_vision` registers
the tower and the projector as the model's `model.encoder` (DiffusionGemmaStack), so their
state-dict names are the folder's (`model.encoder.vision_tower.*`,
`model.encoder.embed_vision.*`), `save_pretrained` writes them from the state dict, the
optimizer and checkpoints hold them, and each tower layer is an FSDP2 unit (its class
declares `fsdp_unit`, which parallel/fsdp.py apply_fsdp shards on its own). The frozen part
keeps requires_grad False.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from unmask.errors import InputError
from unmask.models.diffusion_gemma_layout import (
    LORA_PROJECTOR,
    LORA_TOWER,
    PROJECTOR,
    TOWER,
)


@dataclass
class Images:
    """A batch's images as the folder's processor gives them: pixel_values (N, P, 3 x p^2)
    float, position_ids (N, P, 2) long ((-1, -1): a padding patch), in the order their image
    tokens occur over the rows."""

    pixel_values: torch.Tensor
    position_ids: torch.Tensor

    def to(self, device: torch.device) -> Images:
        return Images(self.pixel_values.to(device), self.position_ids.to(device))


def _norm(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm in float32 (x (..., D) times w when given), back in x's dtype."""
    xf = x.float()
    out = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        out = out * weight.float()
    return out.type_as(x)


class Norm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _norm(x, self.eps, self.weight)


class ClippableLinear(nn.Module):
    """A bias-free linear map (`.linear`), its input and output clamped to stored bounds
    when the config asks (`use_clipped_linears`)."""

    def __init__(self, clipped: bool, inputs: int, outputs: int) -> None:
        super().__init__()
        self.linear = nn.Linear(inputs, outputs, bias=False)
        self.clipped = clipped
        if clipped:
            for name in ("input_min", "input_max", "output_min", "output_max"):
                sign = -1.0 if name.endswith("min") else 1.0
                self.register_buffer(name, torch.tensor(sign * math.inf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.clipped:
            x = torch.clamp(x, self.input_min, self.input_max)
        x = self.linear(x)
        if self.clipped:
            x = torch.clamp(x, self.output_min, self.output_max)
        return x


def rotate_2d(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x (N, P, H, D) rotated by (x, y) positions (N, P, 2): the first D/2 features by x, the
    rest by y, each half rotate-half RoPE with frequencies theta^(-2i / (D/2))."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float32,
                                             device=x.device) / half))  # fmt: skip
    parts = []
    for axis in range(2):
        freqs = positions[..., axis, None].float() * inv_freq  # (N, P, D/4)
        angles = torch.cat((freqs, freqs), dim=-1)[:, :, None]  # (N, P, 1, D/2)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        part = x[..., axis * half : (axis + 1) * half]
        first, second = part[..., : half // 2], part[..., half // 2 :]
        parts.append(part * cos + torch.cat((-second, first), dim=-1) * sin)
    return torch.cat(parts, dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        hidden, heads, clipped = cfg["hidden_size"], cfg["num_attention_heads"], cfg["clipped"]
        self.head_dim, self.kv_heads = cfg["head_dim"], cfg["num_key_value_heads"]
        self.eps, self.theta = cfg["rms_norm_eps"], cfg["rope_theta"]
        self.q_proj = ClippableLinear(clipped, hidden, heads * self.head_dim)
        self.k_proj = ClippableLinear(clipped, hidden, self.kv_heads * self.head_dim)
        self.v_proj = ClippableLinear(clipped, hidden, self.kv_heads * self.head_dim)
        self.o_proj = ClippableLinear(clipped, heads * self.head_dim, hidden)
        self.q_norm = Norm(self.head_dim, self.eps)
        self.k_norm = Norm(self.head_dim, self.eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, real: torch.Tensor):
        """x (N, P, H); real (N, P) bool: the keys every patch attends to."""
        n, p, _ = x.shape
        shape = (n, p, -1, self.head_dim)
        q = rotate_2d(self.q_norm(self.q_proj(x).view(shape)), positions, self.theta)
        k = rotate_2d(self.k_norm(self.k_proj(x).view(shape)), positions, self.theta)
        v = _norm(self.v_proj(x).view(shape), self.eps)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=real[:, None, None, :], scale=1.0)
        return self.o_proj(out.transpose(1, 2).reshape(n, p, -1))


class MLP(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        hidden, inner, clipped = cfg["hidden_size"], cfg["intermediate_size"], cfg["clipped"]
        self.gate_proj = ClippableLinear(clipped, hidden, inner)
        self.up_proj = ClippableLinear(clipped, hidden, inner)
        self.down_proj = ClippableLinear(clipped, inner, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Layer(nn.Module):
    fsdp_unit = True  # parallel/fsdp.py: one FSDP2 unit per layer when registered (trained)

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = Norm(hidden, eps)
        self.post_attention_layernorm = Norm(hidden, eps)
        self.pre_feedforward_layernorm = Norm(hidden, eps)
        self.post_feedforward_layernorm = Norm(hidden, eps)

    def forward(self, x, positions, real):
        x = x + self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(x), positions, real)
        )
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class PatchEmbedder(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        self.input_proj = nn.Linear(3 * cfg["patch_size"] ** 2, hidden, bias=False)
        self.position_embedding_table = nn.Parameter(
            torch.ones(2, cfg["position_embedding_size"], hidden)
        )

    def forward(self, pixels: torch.Tensor, positions: torch.Tensor, padding: torch.Tensor):
        weight = self.input_proj.weight
        x = self.input_proj((2 * (pixels - 0.5)).to(weight.dtype))
        at = positions.clamp(min=0)
        table = self.position_embedding_table
        where = F.embedding(at[..., 0], table[0]) + F.embedding(at[..., 1], table[1])
        return x + torch.where(padding[..., None], 0.0, where)


class Encoder(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg["num_hidden_layers"]))


class VisionTower(nn.Module):
    """Gemma 4's vision model (module docstring): patches -> pooled soft tokens."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embedder = PatchEmbedder(cfg)
        self.encoder = Encoder(cfg)
        if cfg["standardize"]:
            self.register_buffer("std_bias", torch.zeros(cfg["hidden_size"]))
            self.register_buffer("std_scale", torch.ones(cfg["hidden_size"]))

    def forward(self, pixels: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(N, P, 3p^2), (N, P, 2) -> the real soft tokens of every image, in order (T, hidden)."""
        k = self.cfg["pooling_kernel_size"]
        slots = pixels.shape[-2] // (k * k)
        padding = (positions == -1).all(dim=-1)
        x = self.patch_embedder(pixels, positions, padding)
        for layer in self.encoder.layers:
            x = layer(x, positions, ~padding)
        x = x.masked_fill(padding[..., None], 0.0)
        at = positions.clamp(min=0)
        columns = at[..., 0].max(dim=-1, keepdim=True)[0] + 1
        block = torch.div(at, k, rounding_mode="floor")
        index = block[..., 0] + (columns // k) * block[..., 1]  # (N, P) the patch's block
        weights = F.one_hot(index.long(), slots).float() / (k * k)  # (N, P, slots)
        pooled = (weights.transpose(1, 2) @ x.float()).to(x.dtype)
        used = (weights != 0).any(dim=1)  # (N, slots) blocks some patch falls in
        tokens = pooled.float()[used] * self.cfg["hidden_size"] ** 0.5
        if self.cfg["standardize"]:
            tokens = (tokens - self.std_bias.float()) * self.std_scale.float()
        return tokens.to(x.dtype)


class Projector(nn.Module):
    """`embed_vision`: weightless RMSNorm, then a linear map to the text hidden size."""

    def __init__(self, vision_hidden: int, text_hidden: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.embedding_projection = nn.Linear(vision_hidden, text_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(_norm(x, self.eps))


def _tower_config(vision: dict[str, Any]) -> dict[str, Any]:
    """The sizes the tower reads from a folder's vision_config (transformers' defaults)."""
    rope = vision.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise InputError(f"config.json: vision_config.rope_parameters.rope_type="
                         f"{rope['rope_type']!r} is not supported; need axial")  # fmt: skip
    if vision.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise InputError(f"config.json: vision_config.hidden_activation="
                         f"{vision['hidden_activation']!r} is not supported; need "
                         "gelu_pytorch_tanh")  # fmt: skip
    defaults = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 16,
                "num_attention_heads": 12, "num_key_value_heads": 12, "head_dim": 64,
                "rms_norm_eps": 1e-6, "pooling_kernel_size": 3, "patch_size": 16,
                "position_embedding_size": 10 * 1024}  # fmt: skip
    cfg = {key: vision.get(key) or value for key, value in defaults.items()}
    cfg["rope_theta"] = float(rope.get("rope_theta", 100.0))
    cfg["clipped"] = bool(vision.get("use_clipped_linears", False))
    cfg["standardize"] = bool(vision.get("standardize", False))
    return cfg


class Vision(nn.Module):
    """The tower and the projector of one DiffusionGemma folder, and where their soft
    tokens go (`image_token_id`, the bidirectional rule)."""

    def __init__(self, source: dict[str, Any], text_hidden: int) -> None:
        super().__init__()
        cfg = _tower_config(source["vision_config"])
        self.image_token_id = int(source.get("image_token_id", 258_880))
        self.boi_token_id = int(source.get("boi_token_id", 255_999))
        self.eoi_token_id = int(source.get("eoi_token_id", 258_882))
        text = source.get("text_config") or {}
        self.bidirectional = text.get("use_bidirectional_attention") == "vision"
        self.vision_tower = VisionTower(cfg)
        self.embed_vision = Projector(cfg["hidden_size"], text_hidden, cfg["rms_norm_eps"])

    def load_folder_tensors(self, carried: dict[str, torch.Tensor]) -> None:
        """Load the folder's tower and projector tensors (strictly: one line naming what is
        missing or left over)."""
        state = {}
        for key, value in carried.items():
            for prefix, native in ((TOWER, f"{LORA_TOWER}."), (PROJECTOR, f"{LORA_PROJECTOR}.")):
                if key.startswith(prefix):
                    state[native + key[len(prefix) :]] = value
        expected = set(self.state_dict())
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        if missing or unexpected:
            raise InputError(f"the folder's vision tower does not match its vision_config: "
                             f"missing {missing[:3]}, unexpected {unexpected[:3]}")  # fmt: skip
        self.load_state_dict(state, strict=True)

    def soft_tokens(self, images: Images) -> torch.Tensor:
        """(T, text hidden): every image's soft tokens through the projector, in order."""
        return self.embed_vision(self.vision_tower(images.pixel_values, images.position_ids))

    def insert(self, x: torch.Tensor, input_ids: torch.Tensor, images: Images) -> torch.Tensor:
        """x (B, L, H) text embeddings with the image tokens' rows replaced by the soft tokens
        (one line when their counts differ)."""
        slots = input_ids == self.image_token_id
        tokens = self.soft_tokens(images.to(x.device))
        if int(slots.sum()) != tokens.shape[0]:
            raise InputError(f"the prompts hold {int(slots.sum())} image tokens but their "
                             f"{images.pixel_values.shape[0]} image(s) give {tokens.shape[0]} "
                             "soft tokens; give one image per image placeholder")  # fmt: skip
        return x.masked_scatter(slots[..., None], tokens.to(x.dtype))

    def groups(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """(B, L) long: each run of consecutive image tokens' index in its row, -1 elsewhere
        (the encoder's bidirectional blocks), or None when the config asks for none."""
        if not self.bidirectional:
            return None
        image = input_ids == self.image_token_id
        before = F.pad(image[:, :-1], (1, 0), value=False)
        run = torch.cumsum((image & ~before).long(), dim=1) - 1
        return torch.where(image, run, -1)


def trained_parts(freeze: bool | str) -> tuple[bool, bool]:
    """(tower trained, projector trained) for a `model.freeze_vision` value: True freezes
    both, False trains both, "tower" / "projector" freezes that one and trains the other."""
    if freeze is True:
        return False, False
    if freeze is False:
        return True, True
    return freeze != "tower", freeze != "projector"


NO_TOWER = ("model.freeze_vision / a vision LoRA target needs a diffusion_gemma folder with a "
            "vision tower (model.pretrained; its config.json has vision_config); this model "
            f"has none: set freeze_vision: true and drop {LORA_TOWER} / {LORA_PROJECTOR} "
            "from lora_target_modules")  # fmt: skip
"""The one line for a trained or adapted tower on a model without one (the request check
`has_folder_tower`, and `attach_vision`)."""


def has_folder_tower(source: dict[str, Any], tensor_names: set[str] | None) -> bool:
    """Whether a folder's config.json `source` and its weight tensors' names hold a tower:
    a diffusion_gemma config with a vision_config, and the tower's tensors (None: a folder
    without weight files, its config.json alone, is judged by it)."""
    return (source.get("model_type") == "diffusion_gemma"
            and isinstance(source.get("vision_config"), dict)
            and (tensor_names is None or any(n.startswith(TOWER) for n in tensor_names)))  # fmt: skip


def vision_registered(cfg: Any) -> bool:
    """Whether a model section (ModelConfig) has the tower and projector registered on the
    model: a trained part (`freeze_vision` not true) or a LoRA target on them."""
    targets = cfg.lora_target_modules
    adapted = cfg.lora and isinstance(targets, list) and bool(
        {LORA_TOWER, LORA_PROJECTOR} & set(targets))  # fmt: skip
    return cfg.freeze_vision is not True or adapted


def registered_vision(model: nn.Module) -> Vision | None:
    """The tower and projector registered on the model (`attach_vision`), else None."""
    encoder = getattr(getattr(model, "model", None), "encoder", None)
    return encoder if isinstance(encoder, Vision) else None


def _build_from_folder(model: nn.Module) -> Vision | None:
    """A Vision of the folder's config.json and carried tensors (None: the model has none)."""
    source = getattr(model, "hf_source_config", None) or {}
    carried = getattr(model, "hf_carried_weights", None) or {}
    if "vision_config" not in source or not any(k.startswith(TOWER) for k in carried):
        return None
    vision = Vision(source, model.config.hidden_size)
    vision.load_folder_tensors(carried)
    return vision


def attach_vision(model: nn.Module, freeze: bool | str) -> Vision:
    """Register the folder's tower and projector on the model as `model.model.encoder` (their
    state-dict names: the folder's), trained as `freeze` (`model.freeze_vision`) says; the
    frozen part gets requires_grad False. Their tensors leave `hf_carried_weights` (the
    state dict now writes them). One line when the model has no tower."""
    vision = registered_vision(model)
    if vision is None:
        vision = _build_from_folder(model)
        if vision is None:
            raise InputError(NO_TOWER)
        weight = model.model.embed_tokens.weight
        vision.to(device=weight.device, dtype=weight.dtype)
        model.model.encoder = vision
        model.__dict__.pop("_folder_vision", None)
        model.hf_carried_weights = {key: value for key, value in model.hf_carried_weights.items()
                                    if not key.startswith((TOWER, PROJECTOR))}  # fmt: skip
    tower, projector = trained_parts(freeze)
    vision.vision_tower.requires_grad_(tower)
    vision.embed_vision.requires_grad_(projector)
    return vision


def register_empty_vision(model: nn.Module, source: dict[str, Any]) -> Vision:
    """An uninitialized tower and projector of config.json `source`'s vision_config,
    registered as `attach_vision` does, to load a state dict into (a gathered checkpoint)."""
    with torch.device("meta"):
        vision = Vision(source, model.config.hidden_size)
    weight = model.model.embed_tokens.weight
    vision.to_empty(device=weight.device).to(dtype=weight.dtype)
    model.model.encoder = vision
    return vision


def folder_vision(model: nn.Module) -> Vision | None:
    """The model's tower and projector: the registered ones (`attach_vision`), else built
    once from its folder's config.json (`hf_source_config`) and carried tensors, frozen and
    held apart, on the embedding's device and dtype; None for a model without them (a fresh
    one, or a folder with no vision_config)."""
    registered = registered_vision(model)
    if registered is not None:
        return registered
    weight = model.model.embed_tokens.weight
    built = model.__dict__.get("_folder_vision")
    if built is not None:
        param = built.embed_vision.embedding_projection.weight
        if param.device != weight.device or param.dtype != weight.dtype:
            built.to(device=weight.device, dtype=weight.dtype)
        return built
    vision = _build_from_folder(model)
    if vision is None:
        return None
    vision.requires_grad_(False)
    vision.to(device=weight.device, dtype=weight.dtype).eval()
    model.__dict__["_folder_vision"] = vision  # not a submodule: kept out of the state dict
    return vision


def require_vision(model: nn.Module) -> Vision:
    """folder_vision(model), or one line saying the model has no tower."""
    vision = folder_vision(model)
    if vision is None:
        raise InputError("this model has no vision tower (a text-only diffusion_gemma, or not "
                         "a diffusion_gemma folder): images are not supported; drop the "
                         "images")  # fmt: skip
    return vision


# -- FLOPs (train/mfu.py, models/shape.py DiffusionGemmaShape.call_flops) -------------------


@dataclass(frozen=True)
class TowerFlops:
    """The tower's and projector's sizes and which of them train: what a training call's
    FLOP count adds for its pictures (`call_flops`)."""

    cfg: dict
    text_hidden: int
    tower: bool
    """The tower trains (its parameters or LoRA factors get gradients)."""
    projector: bool

    def call_flops(self, images: Images):
        """FLOPs of the tower and projector over a call's pictures (`Images`: N pictures of
        P patches, padding patches included, which are computed too), forward and the
        backward the trained parts run; a 0-d tensor (the soft-token count is read on the
        pictures' device without a sync)."""
        count, patches = images.pixel_values.shape[:2]
        k = self.cfg["pooling_kernel_size"]
        soft = (images.position_ids[..., 0] >= 0).sum() // (k * k)
        return tower_flops(self.cfg, self.text_hidden, count, patches, soft, self.tower,
                           self.projector)  # fmt: skip


def tower_flops(cfg: dict, text_hidden: int, images: int, patches: int, soft_tokens,
                tower: bool, projector: bool):  # fmt: skip
    """Matmul FLOPs of `images` pictures of `patches` patches each through the tower and
    `soft_tokens` soft tokens through the projector (2 per multiply-add). Forward: the patch
    embedding (3 p^2 -> hidden), per layer q, k, v, o and the gated MLP's three maps over
    every patch, attention's Q K^T and A V over all patch pairs (every head), the pooling's
    (blocks x patches) average, the projector (hidden -> text hidden). Backward of a
    trained tower: 2x the forward of its layers (input and weight gradients), 1x the patch
    embedding's (the pixels need no gradient) and the pooling's (the averaging weights are
    not parameters); the projector adds 1x for its weight gradient when it trains and 1x
    for its input gradient when the tower trains. A frozen part runs its forward only."""
    hidden, inner, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    width = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    k = cfg["pooling_kernel_size"]
    tokens = images * patches
    embed = 2 * tokens * 3 * cfg["patch_size"] ** 2 * hidden
    layer = (2 * tokens * hidden * (2 * width + 2 * kv) + 2 * tokens * 3 * hidden * inner
             + 4 * images * patches * patches * width)  # fmt: skip
    pool = 2 * images * (patches // (k * k)) * patches * hidden
    project = 2 * soft_tokens * hidden * text_hidden
    trained = 1 + int(tower)
    return (embed * trained + layers * layer * (1 + 2 * int(tower)) + pool * trained
            + project * (1 + int(tower) + int(projector)))  # fmt: skip


def tower_flop_model(model: nn.Module) -> TowerFlops | None:
    """The TowerFlops of a model's tower and projector: registered (trained where a
    parameter of the part requires a gradient) or held apart (frozen); None without one."""
    vision = next((m for m in model.modules() if isinstance(m, Vision)), None)
    if vision is not None:
        trains = [any(p.requires_grad for p in part.parameters())
                  for part in (vision.vision_tower, vision.embed_vision)]  # fmt: skip
        return TowerFlops(vision.vision_tower.cfg, vision.embed_vision.embedding_projection
                          .out_features, *trains)  # fmt: skip
    source = getattr(model, "hf_source_config", None) or {}
    carried = getattr(model, "hf_carried_weights", None) or {}
    if "vision_config" not in source or not any(k.startswith(TOWER) for k in carried):
        return None
    return TowerFlops(_tower_config(source["vision_config"]), model.config.hidden_size,
                      False, False)  # fmt: skip


def vision_modules(model: nn.Module) -> set[int]:
    """ids of the registered tower's and projector's modules (their matmuls are not the
    text model's per-token weights: the MFU counts them per picture)."""
    return {id(m) for v in model.modules() if isinstance(v, Vision) for m in v.modules()}
