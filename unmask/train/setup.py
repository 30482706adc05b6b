"""What the trainer builds before its first step, in order: the device, the tokenizer
(with the mask and EOS tokens the objective needs), the data the objective trains on, the
model (vocabulary, 4-bit base, activation checkpointing, compiled blocks, LoRA, FSDP2) and
the objective with what it needs beside the model (its registry entry says what)."""

import contextlib
import copy
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from unmask.config import RunConfig
from unmask.data import (
    Datasets,
    adopt_mask_token,
    build_datasets,
    build_tokenizer,
    ensure_special_tokens,
    heldout_examples,
)
from unmask.data.images import PictureRows
from unmask.diffusion import Objective, build_objective, objective_spec
from unmask.diffusion.registry import head_share, names_that
from unmask.errors import InputError
from unmask.models import (
    ResolvedModel,
    build_model,
    decoder_layers,
    folder_mask_token_id,
    max_positions,
    resolve_model,
)
from unmask.models.diffusion_gemma_vision import NO_TOWER, has_folder_tower, vision_registered
from unmask.models.families import FAMILIES
from unmask.models.float8 import check_float8_request, convert_to_float8
from unmask.models.hf import read_config, tensor_names
from unmask.models.lora import apply_lora, lora_targets, targets_experts
from unmask.models.lora import check_request as check_lora_request
from unmask.models.quant import check_4bit_request, quantize_4bit
from unmask.parallel.batch import per_rank_batch_size
from unmask.parallel.context import check_context_parallel
from unmask.parallel.dims import ParallelDims
from unmask.parallel.expert import check_moe_request, shard_experts
from unmask.parallel.fsdp import apply_fsdp, compile_blocks
from unmask.parallel.pipeline import PipelineModel
from unmask.parallel.pipeline_plan import PipelinePlan, layer_costs, plan_pipeline
from unmask.parallel.schedules import schedule_spec
from unmask.parallel.tensor import apply_tensor_parallel, check_tensor_parallel


@dataclass(frozen=True)
class ParallelPlan:
    """A run's parallel layout at a world size, planned once after every pre-check
    (`plan_parallel`): the trainer and `unmask plan` both build it, so they accept and
    refuse the same configs with the same line, and the model builders read it (not the
    config's parallel section).

    dims: the layout (parallel/dims.py `ParallelDims`, its one owner: the degrees, ep
    included, the world mesh, FSDP2's mesh and the experts' grid); rows: the rows each
    data-parallel rank trains on per micro-batch; pipeline: the stages' layers and
    micro-batches (None without pipeline parallelism); model: the model the run builds,
    resolved once (models/build.py `ResolvedModel`); sequence_parallel: tensor
    parallelism shards the residual stream over the sequence; reshard_after_forward:
    FSDP2 frees gathered parameters after the forward."""

    dims: ParallelDims
    rows: int
    pipeline: PipelinePlan | None
    model: ResolvedModel
    sequence_parallel: bool = False
    reshard_after_forward: bool = True


def plan_parallel(cfg: RunConfig, world_size: int) -> ParallelPlan:
    """Every check of a run's layout before any process group exists (the family against
    the objective, LoRA, the rows against the model's positions, tensor, context, sequence
    and pipeline parallelism, experts, the degrees' factoring of the world), then the plan;
    a one-line InputError for the first problem."""
    t, p = cfg.train, cfg.parallel
    model = check_model_request(cfg, world_size)
    if t.torch_compile and targets_experts(cfg.model):
        raise InputError(
            "train.torch_compile does not trace peft's adapters on the expert stacks "
            "(model.lora_target_modules holds 'experts': they swap the stacks in place on every "
            "call); set train.torch_compile: false or drop 'experts'"
        )
    check_model_fits(cfg)
    check_tensor_parallel(
        model, p.tensor_parallel, lora=cfg.model.lora, sequence_parallel=p.sequence_parallel
    )
    check_context_request(cfg, world_size, model)
    check_sequence_request(cfg)
    check_pipeline_request(cfg, model)
    check_moe_request(model, p.expert_parallel, p.tensor_parallel)
    experts = 0 if model.wrapped else model.arch.num_experts
    dims = ParallelDims.resolve(world_size, dp_replicate=p.dp_replicate, dp_shard=p.dp_shard,
                                cp=p.context_parallel, tp=p.tensor_parallel,
                                pp=p.pipeline_parallel, ep=p.expert_parallel, shard=p.fsdp2,
                                experts=experts)  # fmt: skip
    what = "the world size" if dims.dp == world_size else "the data-parallel size"
    # rows per micro-batch on this rank; the global batch grows with the world size unless
    # split_batches (then per_device_train_batch_size is the global batch)
    rows = per_rank_batch_size(t.per_device_train_batch_size, dims.dp, t.split_batches, what)
    # the stages' layers and micro-batches (pp peers read the same rows)
    pipeline = pipeline_plan(cfg, dims, rows * t.gradient_accumulation_steps, model)
    return ParallelPlan(dims, rows, pipeline, model, p.sequence_parallel,
                        p.reshard_after_forward)  # fmt: skip


def check_model_request(cfg: RunConfig, world_size: int) -> ResolvedModel:
    """The model the run builds, resolved once, and the checks of it that need no layout
    (its family trains, with this objective; LoRA, 4-bit and float8 requests): the first
    checks of `plan_parallel`, which the trainer and `unmask plan` both run."""
    check_lora_request(cfg.model)  # first: a missing peft is named before what needs it
    model = resolve_model(cfg.model)
    check_family_trains(model)
    check_family_objective(cfg, model)
    check_4bit_request(cfg.model, world_size)
    check_float8_request(cfg.train.float8, cfg.train.bf16)
    check_vision_request(model)
    return model


def check_vision_request(model: ResolvedModel) -> None:
    """One line, before any model is built, for a trained or LoRA-adapted vision tower
    (`model.freeze_vision` not true, vision_tower / embed_vision among the LoRA targets) on
    a folder without one: it must be a diffusion_gemma folder whose config.json has a
    vision_config and whose weights hold the tower's tensors."""
    if not vision_registered(model.section):
        return
    folder = model.section.pretrained
    if folder is None:  # the section's own check refuses it first
        raise InputError(NO_TOWER)
    if not has_folder_tower(read_config(Path(folder)), tensor_names(Path(folder))):
        raise InputError(NO_TOWER)


def check_family_trains(model: ResolvedModel) -> None:
    """One line when the family's shape says no objective drives its forward yet
    (models/shape.py `trains`): the family built (a pretrained folder's), not the section's
    model_type."""
    if not model.shape.trains:
        raise InputError(
            f"model.model_type {model.family.name!r}: unmask reads and writes its folders and "
            "computes its logits (unmask.models.from_pretrained), but no objective trains it "
            "and the planner cannot trace it yet"
        )


def check_family_objective(cfg: RunConfig, model: ResolvedModel | None = None) -> None:
    """One line for an objective that does not train this kind of model: a canvas decoder
    (DiffusionGemma: no [MASK] token) only with an objective that says it trains one
    (`uniform`), and such an objective with no other family; for a canvas decoder also a
    canvas its rows and positions cannot hold; activation checkpointing of a family whose
    shape says its layers do not recompute (`recompute`), and diffusion.freeze_router on a
    model without routers."""
    model = model or resolve_model(cfg.model)
    objective = cfg.diffusion.objective
    canvas_objective = objective_spec(objective).canvas_decoder
    shape, name = model.shape, model.name
    if cfg.diffusion.freeze_router and (model.wrapped or not model.arch.num_experts):
        raise InputError(f"diffusion.freeze_router: true needs a mixture-of-experts model; "
                         f"model {name!r} has no router: drop the key")  # fmt: skip
    if canvas_objective and not shape.canvas_decoder:
        canvas = ", ".join(n for n, f in FAMILIES.items() if f.shape.canvas_decoder)
        raise InputError(
            f"diffusion.objective {objective!r} trains a prompt encoder and canvas decoder "
            f"(model_type {canvas}); model {name!r} has none: use a masked objective "
            f"(mdlm, llada, sft, ...) or model.model_type {canvas}"
        )
    if shape.canvas_decoder and not canvas_objective:
        raise InputError(
            f"model {name!r} (a canvas decoder) has no [MASK] token: diffusion.objective "
            f"{objective!r} needs one; train it with diffusion.objective "
            f"{names_that('canvas_decoder')}"
        )
    if shape.canvas_decoder:
        check_canvas_fits(cfg, model)
    if not shape.recompute and checkpointing_choice(cfg.train) is not False:
        raise InputError(f"train.activation_checkpointing: model_type {model.family.name}'s "
                         "layers do not recompute yet; set train.activation_checkpointing none "
                         "(or auto)")  # fmt: skip


def check_canvas_fits(cfg: RunConfig, model: ResolvedModel | None = None) -> None:
    """A canvas decoder's canvas within a row (the answer is cut into canvases) and the
    model's positions (the last canvas of a row may run past its end: positions up to
    L + C - 2)."""
    model = model or resolve_model(cfg.model)
    arch = model.arch
    canvas, length = arch.diffusion_gemma.canvas_length, cfg.data.packing_length
    positions = arch.max_position_embeddings
    key = "model.diffusion_gemma.canvas_length" + (" (model.pretrained's config.json)"
                                                   if cfg.model.pretrained else "")  # fmt: skip
    if canvas > length:
        raise InputError(f"{key} ({canvas}) is above data.packing_length ({length}): a row "
                         "cannot hold one canvas of its answer; raise data.packing_length or "
                         "lower the canvas length")  # fmt: skip
    if length + canvas - 1 > positions:
        raise InputError(f"{key} ({canvas}) with data.packing_length ({length}) needs "
                         f"{length + canvas - 1} positions (a row's last canvas runs past its "
                         f"end), above max_position_embeddings ({positions}); lower one of "
                         "them")  # fmt: skip


def check_model_fits(cfg: RunConfig) -> None:
    """Before anything is built: a pretrained folder reads (config.json, whole weight files)
    and rows fit the model's positions."""
    positions = max_positions(cfg.model)
    length = cfg.data.packing_length
    if length > positions:
        fix = ("(the limit of model.pretrained's config.json)" if cfg.model.pretrained
               else "or raise model.max_position_embeddings")  # fmt: skip
        raise InputError(
            f"data.packing_length ({length}) is above the model's max_position_embeddings "
            f"({positions}); lower data.packing_length {fix}"
        )


def check_context_request(cfg: RunConfig, world_size: int,
                          model: ResolvedModel | None = None) -> None:  # fmt: skip
    """parallel.context_parallel > 1: one-line InputError before any process group work for
    what context parallelism cannot serve. It splits the rows of native decoders trained
    with an objective that draws each row's noise on its own and normalizes by one global
    token count (a per-row normalization would need whole rows); no sampler runs
    context-parallel; the degree must fit the world size, heads and row length."""
    cp = cfg.parallel.context_parallel
    if cp == 1:
        return
    key = f"parallel.context_parallel={cp}"
    model = model or resolve_model(cfg.model)
    if model.wrapped:
        raise InputError(f"{key} needs a native decoder; model {model.name!r} "
                         "is a wrapped transformers model: set parallel.context_parallel=1")  # fmt: skip
    objective = cfg.diffusion.objective
    if not objective_spec(objective).accepts_context_parallel:  # its registry entry says
        raise InputError(
            f"{key} needs an objective that draws each row's noise on its own "
            f"({names_that('accepts_context_parallel')}); diffusion.objective {objective!r} "
            "draws for its batch: set parallel.context_parallel=1"
        )
    normalization = cfg.diffusion.loss_normalization
    if normalization not in ("auto", "token"):
        raise InputError(
            f"{key} needs diffusion.loss_normalization token (one global count), not "
            f"{normalization!r} (divides each whole row): set it to token or auto"
        )
    if cfg.eval.generate_accuracy:
        raise InputError(
            f"{key} splits training forwards only; eval.generate_accuracy samples with the model "
            "and no sampler runs context-parallel: set eval.generate_accuracy=false"
        )
    arch = model.arch
    check_context_parallel(cp, world_size=world_size, heads=arch.num_attention_heads,
                           kv_heads=arch.num_key_value_heads, length=cfg.data.packing_length,
                           tp=cfg.parallel.tensor_parallel)  # fmt: skip


def check_sequence_request(cfg: RunConfig) -> None:
    """parallel.sequence_parallel: one-line InputError before any process group work for what
    it cannot serve. It shards the tensor-parallel ranks' residual stream over the sequence,
    so it needs tensor_parallel > 1 and whole rows on each tp group (no context or pipeline
    parallelism); rows are padded to a multiple of the tp degree inside the model, which a
    sampler's KV cache cannot follow (no generation during training)."""
    if not cfg.parallel.sequence_parallel:
        return
    key = "parallel.sequence_parallel: true"
    if cfg.parallel.tensor_parallel == 1:
        raise InputError(f"{key} shards the residual stream over the tensor-parallel ranks and "
                         "needs parallel.tensor_parallel >= 2; set tensor_parallel or "
                         "sequence_parallel: false")  # fmt: skip
    for name in ("context_parallel", "pipeline_parallel"):
        if getattr(cfg.parallel, name) > 1:
            raise InputError(f"{key} does not combine with parallel.{name}="
                             f"{getattr(cfg.parallel, name)}; set "
                             f"one of them off")  # fmt: skip
    if cfg.eval.generate_accuracy or cfg.diffusion.objective == "grpo":
        what = ("eval.generate_accuracy: true" if cfg.eval.generate_accuracy
                else "diffusion.objective grpo (rollouts)")  # fmt: skip
        raise InputError(f"{key} serves training forwards only; {what} samples with a KV "
                         "cache, which sequence-sharded rows cannot serve: turn one off")  # fmt: skip


def check_pipeline_request(cfg: RunConfig, model: ResolvedModel | None = None) -> None:
    """parallel.pipeline_parallel > 1: one-line InputError before any process group work for
    what the pipeline cannot serve. It splits the layers of a native decoder with an
    untied head, trained with an objective whose count is known before the forward and
    whose loss is one call of the model (its registry entry says: accepts_pipeline_parallel);
    the stages' shapes are fixed, so rows keep their length."""
    pp = cfg.parallel.pipeline_parallel
    if pp == 1:
        return
    key = f"parallel.pipeline_parallel={pp}"
    model = model or resolve_model(cfg.model)
    if model.wrapped:
        raise InputError(f"{key} needs a native decoder; model {model.name!r} is a wrapped "
                         "transformers model: set parallel.pipeline_parallel=1")  # fmt: skip
    if not model.shape.staged:  # the family's shape says (models/shape.py)
        raise InputError(f"{key}: model_type {model.family.name!r} has no pipeline stages "
                         "(models/shape.py); set parallel.pipeline_parallel=1")  # fmt: skip
    if cfg.model.lora or cfg.model.load_in_4bit:
        raise InputError(f"{key} does not combine with model.lora / model.load_in_4bit; set "
                         "parallel.pipeline_parallel=1")  # fmt: skip
    if model.arch.tie_word_embeddings:
        raise InputError(
            f"{key} puts the embedding on the first stage and the LM head on the last; "
            "model.tie_word_embeddings makes them one matrix: set it to false or "
            "parallel.pipeline_parallel=1"
        )
    objective = cfg.diffusion.objective
    accepts = objective_spec(objective).accepts_pipeline_parallel
    if accepts is None or not accepts(cfg.diffusion):
        settings = " with these settings (a cutoff draws the layout)" if accepts else ""
        raise InputError(
            f"{key} needs an objective that says its loss's count before the forward "
            f"({names_that('accepts_pipeline_parallel')}); diffusion.objective {objective!r}"
            f"{settings} cannot: set parallel.pipeline_parallel=1"
        )
    if cfg.diffusion.adaptation is not None or cfg.diffusion.block_schedule is not None:
        raise InputError(f"{key} runs one fixed attention mask through the stages; "
                         "diffusion.adaptation / diffusion.block_schedule change it during the "
                         "run: set parallel.pipeline_parallel=1")  # fmt: skip
    if cfg.parallel.context_parallel > 1:
        raise InputError(f"{key} does not combine with parallel.context_parallel yet; set one of "
                         "them to 1")  # fmt: skip
    if cfg.diffusion.random_length_prob > 0:
        raise InputError(
            f"{key} runs stages of fixed shapes; diffusion.random_length_prob="
            f"{cfg.diffusion.random_length_prob} cuts rows to random lengths: set it to 0"
        )
    if cfg.eval.generate_accuracy:
        raise InputError(f"{key} splits training forwards only; no sampler runs through the "
                         "pipeline: set eval.generate_accuracy=false")  # fmt: skip


def pipeline_plan(cfg: RunConfig, dims: ParallelDims, rows: int,
                  model: ResolvedModel | None = None) -> PipelinePlan | None:  # fmt: skip
    """The run's stages and micro-batches (parallel/pipeline_plan.py `plan_pipeline`), None
    without pipeline parallelism: the layers as parallel.pipeline_split gives them, else cut by
    the architecture's estimated costs on rows of data.packing_length tokens with the LM
    head on the objective's share of them. rows: the rows one pipeline trains on per step.
    The trainer and `unmask plan` both call this, so the planned split is the run's."""
    p = cfg.parallel  # the pipeline's own keys; its degree is the layout's
    if dims.pp == 1:
        return None
    arch = (model or resolve_model(cfg.model)).arch
    costs = layer_costs(arch, cfg.data.packing_length,
                        head_share(cfg.diffusion.objective),
                        head_loss=schedule_spec(p.pipeline_schedule).head_loss)  # fmt: skip
    return plan_pipeline(dims.pp, p.pipeline_schedule, p.pipeline_stages_per_rank,
                         p.pipeline_microbatches, p.pipeline_split, costs, rows)  # fmt: skip


def prepare_tokenizer(cfg: RunConfig):
    """(tokenizer, the tokenizer as loaded, number of tokens added). The one as loaded is
    what token stores were made with; a LLaDA / Dream folder's mask id is adopted; a mask
    or EOS token is added when missing (refused under LoRA: the embeddings are frozen)."""
    tokenizer = build_tokenizer(cfg.data)
    as_loaded = copy.deepcopy(tokenizer)
    if cfg.model.pretrained is not None:
        folder_mask = folder_mask_token_id(cfg.model.pretrained)
        if folder_mask is not None:
            adopt_mask_token(tokenizer, folder_mask, f"model.pretrained {cfg.model.pretrained!r}")
    added = ensure_special_tokens(tokenizer)
    if added and cfg.model.lora:
        raise InputError(
            "the tokenizer has no mask (or EOS) token and one cannot be added under "
            "model.lora: true (the embeddings are frozen); use a tokenizer that has one"
        )
    return tokenizer, as_loaded, added


def checkpointing_is_auto(t) -> bool:
    """Whether train.activation_checkpointing is left to the planner (auto, and no
    gradient_checkpointing given in the config)."""
    return t.activation_checkpointing in (None, "auto") and (
        "gradient_checkpointing" not in t.model_fields_set
    )


def set_checkpointing(model: torch.nn.Module, flag: bool | int) -> None:
    """Set the checkpointing flag the model's forward reads (under a LoRA wrapper: the
    wrapped model's)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.gradient_checkpointing = flag


def checkpointing_choice(t) -> bool | int:
    """The model's activation checkpointing flag: False (none), True (every layer) or n
    (every n-th layer, selective); train.activation_checkpointing wins over the older
    train.gradient_checkpointing boolean. `auto` builds with the gradient_checkpointing
    boolean (default none); the trainer then decides from the built model's memory with the
    decider it is given (trainer.py `Trainer(cfg, decide_checkpointing)`)."""
    choice = t.activation_checkpointing
    if choice in (None, "auto"):
        return t.gradient_checkpointing
    if choice == "selective":
        return t.activation_checkpointing_every
    return choice == "full"


def build_train_model(cfg: RunConfig, tokenizer, added_tokens: int, device: torch.device,
                      parallel: ParallelPlan, mesh) -> torch.nn.Module:  # fmt: skip
    """The model on its device, in torchtitan's order: vocabulary resize, 4-bit base, the
    pipeline stages this rank holds (the plan's pipeline: a PipelineModel of them), tensor
    parallelism over the mesh's tp dim, activation checkpointing, per-block compile, LoRA,
    the experts on their grid, then FSDP2 (mesh None: one process; per stage under PP). The
    layout is the plan's (`parallel`, from `plan_parallel`; its dims built `mesh`), never
    re-read from cfg.parallel."""
    t, dims, pipeline = cfg.train, parallel.dims, parallel.pipeline
    # one process on a GPU, drawn weights (no pretrained folder, no 4-bit base quantized on
    # the host): built on the GPU, not drawn on the CPU and copied (98.8 s for a 1.91B-weight
    # slice on a 2-core host, issue 53)
    on_device = (device.type == "cuda" and mesh is None and pipeline is None
                 and cfg.model.pretrained is None and not cfg.model.load_in_4bit)  # fmt: skip
    with torch.device(device) if on_device else contextlib.nullcontext():
        model = build_model(cfg.model)
    if added_tokens or model.config.vocab_size < len(tokenizer):
        model.resize_token_embeddings(max(len(tokenizer), model.config.vocab_size))
    if cfg.model.load_in_4bit:  # QLoRA: frozen NF4 base, quantized onto the device
        compute = torch.bfloat16 if t.bf16 else torch.float32
        quantize_4bit(model, lora_targets(cfg.model, model), device, compute)
    if router_frozen(cfg):  # no gradient, no optimizer state
        freeze_routers(model)
    if pipeline is not None:  # every rank drew the whole model: the same weights as 1 process
        model = PipelineModel(model, pipeline, mesh["pp"].get_local_rank())
    if mesh is not None and dims.tp > 1:
        model.to(device)
        apply_tensor_parallel(model, mesh["tp"], decoder_layers(model),
                              sequence_parallel=parallel.sequence_parallel)  # fmt: skip
    model.gradient_checkpointing = checkpointing_choice(t)
    if t.float8 and device.type != "meta":  # torchao's float8 linears, before compile and
        convert_to_float8(model)  # FSDP2 (torchtitan's order); the planner plans bf16 ones
    if t.torch_compile:  # whole graphs, but where varlen attention may run (not CUDA)
        attention = cfg.model.attn_implementation
        traceable = attention in ("sdpa", "flex") or (attention == "auto" and device.type == "cuda")
        graphs = getattr(model, "compiled_layer_graphs", None)
        if graphs is not None:  # DiffusionGemma: dense sdpa masks only, its encoder and
            traceable = True  # decoder calls one graph each (models/diffusion_gemma.py)
            # dynamo's limit is per code object and process-wide (the layers share one
            # forward): raised, never lowered, for the rest of the process
            limit = torch._dynamo.config.recompile_limit
            torch._dynamo.config.recompile_limit = max(limit, graphs())
        # expert parallelism's dispatch reads its per-expert counts to the host (the
        # all-to-all splits): the expert blocks run eagerly between a layer's graphs
        # (parallel/expert.py shard_experts)
        traceable = traceable and dims.ep == 1
        compile_blocks(decoder_layers(model), fullgraph=traceable)
    if cfg.model.lora:  # peft wrapper: base frozen, LoRA factors train (AdamW)
        model = apply_lora(model, cfg.model)
    model.to(device)
    if mesh is not None:
        experts = []  # expert parallelism: expert stacks on their own (replica, ep) grid
        if dims.ep > 1:
            experts = shard_experts(model, dims.expert_mesh(mesh))
        units = model.stages if pipeline is not None else [model]
        # a split backward's weight pass (zero bubble's) finds the weights the forward used
        # among the module's parameters: they must stay gathered from the forward to it
        split = pipeline is not None and pipeline.spec.split_backward
        reshard = parallel.reshard_after_forward and not split
        for unit in units:  # under PP: each stage is an FSDP2 root of its own
            layers = decoder_layers(model) if pipeline is None else list(unit.layers)
            apply_fsdp(unit, dims.fsdp_mesh(mesh), layers, bf16=t.bf16, reshard_after_forward=reshard,
                       ignored_params=set(experts))  # fmt: skip
    return model


def router_frozen(cfg: RunConfig) -> bool:
    """diffusion.freeze_router, or when null the objective's choice: a canvas decoder's
    (`uniform`) router is frozen when fine-tuning a folder (NeMo AutoModel's DiffusionGemma
    recipe) and trained from scratch; every other objective trains it."""
    if cfg.diffusion.freeze_router is not None:
        return cfg.diffusion.freeze_router
    return objective_spec(cfg.diffusion.objective).canvas_decoder and bool(cfg.model.pretrained)


def freeze_routers(model: torch.nn.Module) -> int:
    """requires_grad False on every MoE router's parameters (modules marked `is_moe_router`:
    models/moe.py, models/diffusion_gemma.py); returns how many tensors."""
    frozen = [p for m in model.modules() if getattr(m, "is_moe_router", False)
              for p in m.parameters()]  # fmt: skip
    for param in frozen:
        param.requires_grad_(False)
    return len(frozen)


def objective_datasets(cfg: RunConfig, tokenizer, as_loaded) -> Datasets:
    """The training and eval rows: the objective's own kind (preference: chosen/rejected
    pairs) or the `data:` section's rows."""
    own = objective_spec(cfg.diffusion.objective).datasets
    if own is not None:
        return own(cfg, tokenizer, as_loaded)
    datasets = build_datasets(cfg.data, tokenizer, as_loaded, cfg.model.pretrained)
    if cfg.eval.generate_accuracy and isinstance(datasets.train, PictureRows):
        # its held-out prompts would be decoded without their pictures (or left out)
        raise InputError("eval.generate_accuracy decodes held-out prompts without pictures; "
                         f"data.dataset {cfg.data.dataset!r} holds rows with pictures: set "
                         "eval.generate_accuracy=false and score a checkpoint with unmask "
                         "generate --image or unmask eval --tasks (docs/multimodal.md)")  # fmt: skip
    return datasets


def objective_heldout(cfg: RunConfig, tokenizer) -> list[tuple[str, str]]:
    """Held-out (prompt, answer) pairs for eval.generate_accuracy: the objective's own
    (preference: the held-out pairs' prompts and chosen answers) or the data's."""
    own = objective_spec(cfg.diffusion.objective).heldout_examples
    if own is not None:
        return own(cfg.data, tokenizer)
    return heldout_examples(cfg.data)


def build_run_objective(cfg: RunConfig, tokenizer, added_tokens: int, device: torch.device,
                        parallel: ParallelPlan, mesh, notices: list[str]) -> Objective:  # fmt: skip
    """The run's objective from the registry, given what any objective may need: the run's
    sections, the tokenizer and, on request, a copy of the starting model (same seed and
    init_from, before any resume: preference's frozen reference, whole layers: no pipeline
    stages). Its start-up lines go to `notices`."""

    def starting_model() -> torch.nn.Module:
        torch.manual_seed(cfg.train.seed)  # the policy's initial weights
        whole = replace(parallel, pipeline=None)
        return build_train_model(cfg, tokenizer, added_tokens, device, whole, mesh)

    return build_objective(cfg.diffusion, tokenizer.mask_token_id, tokenizer.eos_token_id,
                           run=cfg, tokenizer=tokenizer, starting_model=starting_model,
                           notices=notices)  # fmt: skip
