"""Sampling options are declared once (SamplingConfig): the `unmask generate` flags, the
generation_config.json "unmask" entry and the lm-eval model_args accept exactly its fields,
and each reaches the sampler unchanged."""

import json

import pytest

from unmask.cli import SAMPLING_GROUP, build_parser, sampling_flags
from unmask.data.tokenizer import build_char_tokenizer, ensure_special_tokens
from unmask.errors import InputError
from unmask.sampling.config import RUNTIME_OPTIONS, SamplingConfig, resolve_sampling
from unmask.sampling.generation_file import GENERATION_FILE, generation_config_text, saved_sampling

FIELDS = set(SamplingConfig.model_fields)
FILE_FIELDS = FIELDS - set(RUNTIME_OPTIONS)  # hooks and history: never in a model folder
# a plug-in decoder's own options (a mapping its options model checks): no built-in decoder
# has one, so tests/integration/test_decoder_plugin.py takes them through the flag, the
# folder's file and a request with a plug-in's
PLUGIN_OPTIONS = {"decoder_options"}
# Valid settings that together give every file option a value other than its default.
SETTINGS = [
    dict(gen_length=8, steps=4, block_length=4, temperature=0.5, top_p=0.9, top_k=5,
         remasking="entropy", schedule="dream", eps=0.01, alg_temp=0.5, threshold=0.8,
         cfg_scale=0.5, cache="prefix", cache_refresh=2, shift_logits=True,
         growing_canvas=True, eos_penalty=1.5, logits_eos_inf=True, sub_block_length=2),
    dict(factor=1.0, block_causal=True, cache="dual", confidence_eos_eot_inf=True),
    dict(remasking="origin", ddpm_cache=True, row_length=24),
    dict(remasking="confidence_threshold", threshold=0.9),
    dict(gen_length="auto", block_length=4, gen_length_max=16, auto_eos_threshold=0.8),
    dict(autoregressive=True, top_k=3),
    dict(decoder="left_to_right", gen_length=6),
    dict(block_causal=True, shift_logits=True, blocks_from_start=True, block_length=4,
         threshold=0.9),
    dict(decoder="joint_threshold", edit_threshold=0.3, max_post_edit_steps=4,
         penalty_lambda=3.0, joint_preset="quality", edit_scope="all"),
    dict(uniform_canvas=True, entropy_bound=0.3, max_denoising_steps=12, temperature_start=0.6,
         temperature_end=0.2, stability_threshold=2, confidence_threshold=0.01),
    dict(block_origin="request", block_steps=4, minimal_topk=2, threshold=0.95,
         fill_rule="llada2", eos_early_stop=True, gen_length=10, block_length=4,
         multinomial_draws=True),
]  # fmt: skip
HOOKS = dict(logits_hook="json:dumps", tokens_hook="json:loads")  # any importable callable


def test_settings_cover_every_option_with_a_non_default_value():
    defaults = SamplingConfig()
    changed = {k for s in SETTINGS for k, v in s.items() if getattr(defaults, k) != v}
    assert changed == FILE_FIELDS - PLUGIN_OPTIONS
    assert FIELDS - FILE_FIELDS == {*HOOKS, "history"}


def _generate_parser():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices["generate"]


def _flags(options: dict) -> list[str]:
    args = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + flag[2:])
        else:
            args += [flag, str(value)]
    return args


def test_cli_flags_are_exactly_the_options():
    group = next(g for g in _generate_parser()._action_groups if g.title == SAMPLING_GROUP)
    assert {action.dest for action in group._group_actions} == FIELDS - {"history"}
    parser = build_parser()
    for options in [*SETTINGS, HOOKS]:
        ns = parser.parse_args(["generate", "--model", "m", *_flags(options)])
        given = {k: v for k, v in sampling_flags(ns).items() if v is not None}
        assert given == options
        assert resolve_sampling(given) == SamplingConfig(**options)
    ns = parser.parse_args(["generate", "--model", "m"])
    assert set(sampling_flags(ns)) == FIELDS - {"history"}
    assert not any(sampling_flags(ns).values())


def test_generation_config_file_round_trips_every_option_and_refuses_others(tmp_path):
    tok = build_char_tokenizer()
    ensure_special_tokens(tok)
    full = json.loads(generation_config_text(tok, {}, complete=True))
    assert set(full["unmask"]) == FILE_FIELDS and full["mask_token_id"] == tok.mask_token_id
    for options in SETTINGS:
        (tmp_path / GENERATION_FILE).write_text(generation_config_text(tok, options, True))
        assert resolve_sampling(saved_sampling(tmp_path)) == SamplingConfig(**options)
        (tmp_path / GENERATION_FILE).write_text(generation_config_text(tok, options, False))
        assert saved_sampling(tmp_path) == options
    with pytest.raises(InputError, match="unknown sampling options"):
        generation_config_text(tok, {"gen_lenght": 8}, complete=False)
    (tmp_path / GENERATION_FILE).write_text(json.dumps({"unmask": {"gen_lenght": 8}}))
    with pytest.raises(InputError, match="unknown sampling option 'gen_lenght'.*'gen_length'"):
        saved_sampling(tmp_path)
    # a folder never names code to run: hooks are refused, and never written
    (tmp_path / GENERATION_FILE).write_text(json.dumps({"unmask": {"logits_hook": "os:system"}}))
    with pytest.raises(InputError, match="'logits_hook' is not read from a model folder"):
        saved_sampling(tmp_path)
    written = json.loads(generation_config_text(tok, {**HOOKS, "history": True}, True))
    assert set(written["unmask"]) == FILE_FIELDS


def test_lm_eval_model_args_are_exactly_the_options(tmp_path):
    pytest.importorskip("lm_eval")
    from conftest import save_tiny_model

    from unmask.eval.harness import UnmaskLM

    folder = save_tiny_model(tmp_path / "model")
    for options in SETTINGS:
        args = ",".join(f"{k}={v}" for k, v in options.items())
        lm = UnmaskLM.create_from_arg_string(f"pretrained={folder},{args}")
        assert lm.options == SamplingConfig(**options)
    with pytest.raises(ValueError, match="unknown model_args"):
        UnmaskLM.create_from_arg_string(f"pretrained={folder},gen_lenght=8")


def test_bad_values_are_one_line_errors():
    with pytest.raises(InputError, match="bad value for sampling option 'top_p'"):
        resolve_sampling({"top_p": 1.5})
    with pytest.raises(InputError, match="unknown sampling option 'gen_lenght'.*'gen_length'"):
        resolve_sampling({"gen_lenght": 8})
    with pytest.raises(InputError, match="bad sampling options: .*threshold or factor"):
        resolve_sampling({"threshold": 0.9, "factor": 1.0})


def test_zero_means_off_where_the_reference_code_says_so():
    # Dream passes alg_temp=0. and top_k=0 for "off"; Fast-dLLM's factor rule takes 0
    config = SamplingConfig(top_k=0, alg_temp=0.0, factor=0.0)
    assert (config.top_k, config.alg_temp, config.factor) == (0, 0.0, 0.0)


def test_row_length_fits_the_canvas_and_a_later_gen_length_wins():
    fitted = SamplingConfig(row_length=20).fitted(8)
    assert (fitted.gen_length, fitted.resolved_block_length, fitted.steps) == (12, 12, 12)
    assert fitted.row_length is None and fitted.fitted(3) == fitted
    blocks = SamplingConfig(row_length=20, block_length=4, steps=6).fitted(8)
    assert (blocks.gen_length, blocks.block_length, blocks.steps) == (12, 4, 6)
    causal = SamplingConfig(row_length=20, block_length=5, block_causal=True).fitted(8)
    assert (causal.gen_length, causal.block_length) == (15, 5)  # whole blocks, rounded up
    assert resolve_sampling({"row_length": 20}, {"gen_length": 8}).row_length is None
    assert resolve_sampling({"gen_length": 8}, {"row_length": 20}).fitted(5).gen_length == 15
    with pytest.raises(InputError, match="leaves no room for an answer in the 20-token rows"):
        SamplingConfig(row_length=20).fitted(20)


# SamplingConfig's fields, in their order, as they were before the built-in decoders'
# options moved into the decoders' modules (issue 54): the flags, the playground's options
# and a folder's generation_config.json list them in this order
FIELD_ORDER = [
    "gen_length", "row_length", "steps", "block_length", "temperature", "top_p", "top_k",
    "eos_penalty", "logits_eos_inf", "confidence_eos_eot_inf", "remasking", "schedule", "eps",
    "alg_temp", "threshold", "sub_block_length", "factor", "cfg_scale", "cache",
    "cache_refresh", "shift_logits", "block_causal", "autoregressive", "uniform_canvas",
    "blocks_from_start", "decoder", "decoder_options", "edit_threshold", "max_post_edit_steps",
    "penalty_lambda", "joint_preset", "edit_scope", "entropy_bound", "max_denoising_steps",
    "temperature_start", "temperature_end", "stability_threshold", "confidence_threshold",
    "block_origin", "block_steps", "minimal_topk", "fill_rule", "multinomial_draws",
    "eos_early_stop", "ddpm_cache", "gen_length_max", "auto_eos_threshold", "growing_canvas",
    "logits_hook", "tokens_hook", "history",
]  # fmt: skip


def test_built_in_decoders_declare_their_option_fields_in_their_own_modules():
    from unmask.sampling.decoders import DECODERS, decoder_names
    from unmask.sampling.editing import JointThreshold, JointThresholdOptions
    from unmask.sampling.entropy_bound import (
        ENTROPY_BOUND_DEFAULTS,
        EntropyBound,
        EntropyBoundOptions,
    )
    from unmask.sampling.masked import MaskedBlockDecoder, MaskedOptions

    assert list(SamplingConfig.model_fields) == FIELD_ORDER
    assert decoder_names()[:5] == ("masked", "left_to_right", "blocks_from_start",
                                   "joint_threshold", "entropy_bound")  # fmt: skip
    owned = {MaskedBlockDecoder: MaskedOptions, JointThreshold: JointThresholdOptions,
             EntropyBound: EntropyBoundOptions}  # fmt: skip
    for kind, model in owned.items():
        assert model.__module__ == kind.__module__  # declared with the decoder
        assert kind.options == tuple(model.model_fields)
        assert model.model_config == SamplingConfig.model_config
        for name, field in model.model_fields.items():
            flat = SamplingConfig.model_fields[name]  # a flat key, as before
            assert flat.get_default() == field.get_default(), name
            assert flat.description == field.description and field.description, name
            assert flat.annotation == field.annotation and flat.metadata == field.metadata
    # entropy_bound's None-means defaults name exactly its fields
    assert tuple(ENTROPY_BOUND_DEFAULTS) == EntropyBound.options
    # the other built-ins own none; every owned option is a field of one of those models
    assert all(not DECODERS[name].options for name in ("left_to_right", "blocks_from_start"))
    assert {o for kind in owned for o in kind.options} == {
        o for name in decoder_names()[:5] for o in DECODERS[name].options}  # fmt: skip
    # SamplingConfig's settings hold for the composed fields: unknown keys, infinities
    with pytest.raises(ValueError, match="Extra inputs are not permitted"):
        SamplingConfig(edit_thresold=0.5)
    with pytest.raises(ValueError, match="finite number"):
        SamplingConfig(uniform_canvas=True, entropy_bound=float("inf"))
    with pytest.raises(ValueError, match="less than or equal to 1"):
        SamplingConfig(decoder="joint_threshold", edit_threshold=1.5)
    with pytest.raises(ValueError, match="unknown fill_rule 'lada2'.*'llada2'"):
        SamplingConfig(fill_rule="lada2")
