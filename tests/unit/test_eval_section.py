"""The run config's `eval:` section (unmask/config/eval.py): its sampler is a whole
SamplingConfig (`eval.sampling`), the keys that moved there are still read (with a notice),
and the held-out generation decodes the same tokens as the loop it replaced."""

import pytest
import torch
import yaml
from conftest import save_tiny_model

from unmask.checkpoint import load_for_sampling
from unmask.config import EvalConfig, dump_config, load_config
from unmask.data import heldout_examples
from unmask.data.config import DataConfig
from unmask.errors import InputError
from unmask.sampling import SamplingConfig, generate
from unmask.sampling.accuracy import decode_answer, heldout_accuracy

pytestmark = pytest.mark.usefixtures("one_thread")
ROW = 20  # data.packing_length of the held-out rows


def test_moved_keys_are_read_into_eval_sampling_with_a_notice(tmp_path):
    old = load_config(None, ["eval.temperature=0.5", "eval.block_length=4",
                             "eval.remasking=random", "eval.steps_per_token=0.5"])  # fmt: skip
    new = load_config(None, ["eval.sampling.temperature=0.5", "eval.sampling.block_length=4",
                             "eval.sampling.remasking=random", "eval.steps_per_token=0.5"])  # fmt: skip
    assert old.model_dump() == new.model_dump() and old.eval.sampling == SamplingConfig(
        temperature=0.5, block_length=4, remasking="random"
    )
    assert old.notices == [
        "unmask: config keys that moved, read under their new name (write them there): "
        "eval.temperature -> eval.sampling.temperature, eval.block_length -> "
        "eval.sampling.block_length, eval.remasking -> eval.sampling.remasking"
    ]
    assert new.notices == []
    # the resolved config is written in the new spelling and reads back the same, silently
    path = tmp_path / "config.yaml"
    path.write_text(dump_config(old))
    tree = yaml.safe_load(path.read_text())["eval"]
    assert "temperature" not in tree and tree["sampling"]["temperature"] == 0.5
    again = load_config(path)
    assert again.eval == old.eval and again.notices == []
    # both spellings: the same value is fine, two values are one line
    same = EvalConfig.model_validate({"temperature": 0.5, "sampling": {"temperature": 0.5}})
    assert same.sampling.temperature == 0.5
    with pytest.raises(InputError) as err:
        load_config(None, ["eval.temperature=0.5", "eval.sampling.temperature=0.7"])
    assert str(err.value) == (
        "bad value for config key 'eval': eval.temperature (0.5) and eval.sampling.temperature "
        "(0.7) disagree; keep eval.sampling.temperature only"
    )


def test_eval_sampling_refuses_what_the_heldout_rows_decide():
    with pytest.raises(InputError, match=r"eval.sampling.steps is not used: the answers differ "
                       r"in length; remove it and set eval.steps_per_token"):  # fmt: skip
        load_config(None, ["eval.sampling.steps=8"])
    for key, value in (("gen_length", 8), ("gen_length", "auto"), ("row_length", 12)):
        with pytest.raises(InputError, match=rf"eval.sampling.{key} is not used: each answer "
                           r"fills the training row"):  # fmt: skip
            load_config(None, [f"eval.sampling.{key}={value}", "eval.sampling.block_length=4",
                               "eval.sampling.gen_length_max=16"])  # fmt: skip
    with pytest.raises(InputError, match="unknown config key 'eval.sampling.temprature'"):
        load_config(None, ["eval.sampling.temprature=0.5"])
    with pytest.raises(InputError) as err:  # a sampling key in the wrong section
        load_config(None, ["train.temperature=0.5"])
    assert str(err.value) == (
        "unknown config key 'train.temperature' (it belongs in 'eval.sampling': "
        "'eval.sampling.temperature')"
    )
    # the full sampler: any remasking (the old section took two), threshold, cache, ...
    cfg = load_config(None, ["eval.sampling.remasking=topk_margin", "eval.sampling.cache=dual"])
    assert (cfg.eval.sampling.remasking, cfg.eval.sampling.cache) == ("topk_margin", "dual")


def reference_heldout(model, tokenizer, examples, cfg: EvalConfig, fixed):
    """The held-out loop as it was before eval.sampling (sampling/accuracy.py at commit
    74dd763: the old section's steps_per_token, block_length, temperature, remasking), kept
    here as the oracle the new loop must equal token for token."""
    old = {"block_length": cfg.sampling.block_length, "temperature": cfg.sampling.temperature,
           "remasking": cfg.sampling.remasking}  # fmt: skip
    groups = {}
    encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] for p, _ in examples]
    for index, ids in enumerate(encoded):
        groups.setdefault(len(ids), []).append(index)
    answers = {}
    for prompt_len, indices in sorted(groups.items()):
        gen_length = ROW - prompt_len
        block = (old["block_length"] if old["block_length"]
                 and gen_length % old["block_length"] == 0 else gen_length)  # fmt: skip
        if fixed.get("block_causal"):
            block = fixed["block_length"]
            gen_length = -(-gen_length // block) * block
        blocks = gen_length // block
        steps = max(blocks, round(gen_length * cfg.steps_per_token / blocks) * blocks)
        config = SamplingConfig.model_validate(
            {**fixed, "steps": steps, "gen_length": gen_length, "block_length": block,
             "temperature": old["temperature"], "remasking": old["remasking"]}
        )  # fmt: skip
        for start in range(0, len(indices), cfg.batch_size):
            chunk = indices[start : start + cfg.batch_size]
            prompt = torch.tensor([encoded[i] for i in chunk])
            out = generate(model, prompt, config, mask_id=tokenizer.mask_token_id)
            for row, index in zip(out[:, prompt_len:].tolist(), chunk):
                answers[index] = decode_answer(tokenizer, row)
    return [answers[i] for i in range(len(examples))]


@pytest.mark.parametrize(
    "settings, fixed",
    [
        ({}, {}),  # the defaults: the quickstart's held-out evaluation
        ({"steps_per_token": 0.5, "block_length": 4}, {}),
        ({"block_length": 3, "remasking": "random"}, {"shift_logits": True}),
        ({"temperature": 0.7}, {}),  # the draws too: the same batches in the same order
        ({}, {"block_causal": True, "block_length": 4}),  # BD3LM: whole blocks, rounded up
    ],
)
def test_heldout_generation_decodes_as_before(tmp_path, settings, fixed):
    folder = save_tiny_model(tmp_path / "model")
    sm = load_for_sampling(folder, device="cpu")
    data = DataConfig(dataset="synthetic", packing=False, packing_length=ROW,
                      synthetic_eval_size=12)  # fmt: skip
    examples = heldout_examples(data)[:12]
    assert len({len(p) for p, _ in examples}) > 1  # several prompt lengths, several groups
    cfg = EvalConfig.model_validate({"max_examples": 12, "batch_size": 5, **settings})
    torch.manual_seed(0)
    _, rows = heldout_accuracy(sm.model, sm.tokenizer, examples, cfg, ROW, sm.device, fixed)
    torch.manual_seed(0)
    expected = reference_heldout(sm.model, sm.tokenizer, examples, cfg, fixed)
    assert [got for _, _, got in rows] == expected


def test_every_sampling_option_reaches_the_heldout_generation(tmp_path):
    folder = save_tiny_model(tmp_path / "model")
    sm = load_for_sampling(folder, device="cpu")
    examples = [("rev 123=", "321"), ("rev 4567=", "7654")]
    options = {"threshold": 0.3, "cache": "prefix", "block_length": 4, "top_k": 3}
    cfg = EvalConfig(sampling=SamplingConfig(**options))
    _, rows = heldout_accuracy(sm.model, sm.tokenizer, examples, cfg, ROW, sm.device)
    for (prompt, _), (_, _, got) in zip(examples, rows):
        ids = sm.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        gen = ROW - len(ids)
        block = 4 if gen % 4 == 0 else gen
        config = SamplingConfig(gen_length=gen, steps=gen, **{**options, "block_length": block})
        out = generate(sm.model, torch.tensor([ids]), config, mask_id=sm.mask_id)
        assert got == decode_answer(sm.tokenizer, out[0, len(ids) :].tolist())
    plain = heldout_accuracy(sm.model, sm.tokenizer, examples, EvalConfig(), ROW, sm.device)[1]
    assert plain != rows  # the options changed the answers (they are not ignored)
