"""A model family added from outside the package, as docs/architecture.md says (Where to add,
a new model family): an installed package's `unmask.plugins` module registers a `Family` with
its own blocks (`ModelShape`, builder), its own folder (`FolderLayout`) and mixture-of-experts
layers, and with no edit of unmask/ the family reads and writes its folders, trains (one
process; tensor, pipeline and expert parallel under one torchrun launch, each equal to one
process), samples through `unmask generate` and `unmask serve`, is planned by `unmask plan`
(its layers' saves traced, its FLOPs its own, its experts split over the ep ranks) and gets
the MFU's FLOP count right (torch's FlopCounterMode over a step).

The toy block is GPT-J's / PaLM's parallel block: one norm, whose output the attention and
an MLP read side by side, both added to the residual; the MLP is a plain GELU MLP (two
matrices, not SwiGLU's three) on the first layer and unmask's mixture of experts
(models/moe.py SparseMoE) on the others. Its folders are Llama-4-like: the text model's keys
under a nested `text_config` (the MoE fields under its own names), every tensor renamed,
q/k/v fused into one matrix and each expert stack's gate and up into one `gate_up_proj`."""

import json
import os
import subprocess
import sys

import httpx
import pytest
import torch
from conftest import installed_plugin, losses, train_in_process, write_run_config
from launch import TRAIN_WORKER, rank_env, torchrun
from test_serve import AUTH, KEY, generate, start_server

pytestmark = pytest.mark.slow
STEPS = 4

PLUGIN = r'''"""A toy MoE family: the parallel block (one norm; attention and an MLP side by side: a GELU
MLP on the first layer, a mixture of experts on the others) with a folder of its own."""
import re

import torch
from torch import nn

from unmask.models import (DiffusionTransformer, Family, ModelShape, TensorPlan,
                           register_family)
from unmask.models.layouts import FolderLayout
from unmask.models.moe import SparseMoE
from unmask.models.moe_layout import moe_tag, tagged_moe_fields
from unmask.models.transformer import Attention, RMSNorm

QKV = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(q|k|v)_proj\.weight$")
GATE_UP = re.compile(r"^model\.layers\.(\d+)\.moe\.experts\.(gate|up)_proj$")
FUSED_QKV = re.compile(r"^transformer\.h\.(\d+)\.attn\.qkv\.weight$")
FUSED_GATE_UP = re.compile(r"^transformer\.h\.(\d+)\.moe\.experts\.gate_up_proj$")
# its config.json's own names for the MoE fields, inside text_config
MOE_KEYS = {"num_local_experts": "num_experts", "num_experts_per_tok": "num_experts_per_tok",
            "intermediate_size_moe": "moe_intermediate_size",
            "first_k_dense_replace": "first_k_dense_replace"}


class GeluMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.fc_in = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.fc_out = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.fc_out(nn.functional.gelu(self.fc_in(x)))


class ParallelBlock(nn.Module):
    def __init__(self, cfg, index):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        if cfg.is_moe_layer(index):
            self.moe = SparseMoE(cfg)
        else:
            self.mlp = GeluMLP(cfg)

    def forward(self, x, cos, sin, mask, cache=None):
        h = self.input_layernorm(x)
        ffn = self.moe if hasattr(self, "moe") else self.mlp
        return x + self.self_attn(h, cos, sin, mask, cache) + ffn(h)


class ParallelModel(DiffusionTransformer):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.model.layers = nn.ModuleList(ParallelBlock(cfg, i)
                                          for i in range(cfg.num_hidden_layers))
        self.init_weights()


class ParallelShape(ModelShape):
    def mlp_params(self, arch, index):
        if arch.num_experts and arch.is_moe_layer(index):
            return super().mlp_params(arch, index)  # router + top-k SwiGLU experts
        return 2 * arch.hidden_size * arch.intermediate_size


class NestedLayout(FolderLayout):
    """Its folders: the text model's keys under text_config (its MoE fields under its own
    names), `transformer.h.N` for `model.layers.N`, q/k/v fused into one `attn.qkv` and
    each MoE layer's gate and up stacks into one `gate_up_proj`."""

    moe = True

    def fields(self, hf, family):
        text = hf["text_config"]
        fields = super().fields(text, family)
        fields.update({ours: text[theirs] for theirs, ours in MOE_KEYS.items() if theirs in text})
        fields.update(tagged_moe_fields(hf))
        return fields

    def config(self, cfg, family, dtype_name):
        text = super().config(cfg, family, dtype_name)
        tag = text.pop("unmask")
        tag.update(moe_tag(cfg))
        text.update({theirs: getattr(cfg, ours) for theirs, ours in MOE_KEYS.items()})
        return {"architectures": text.pop("architectures"), "model_type": text.pop("model_type"),
                "text_config": text, "unmask": tag}

    def to_folder(self, state):
        out, parts = {}, {}
        for key, value in state.items():
            if match := QKV.match(key) or GATE_UP.match(key):
                parts.setdefault((match.re is QKV, int(match[1])), {})[match[2]] = value
            else:
                out[key.replace("model.layers.", "transformer.h.", 1)
                    .replace("model.", "transformer.", 1)] = value
        for (attention, layer), got in parts.items():
            if attention:
                out[f"transformer.h.{layer}.attn.qkv.weight"] = torch.cat(
                    [got["q"], got["k"], got["v"]])
            else:  # (E, 2 I, H)
                out[f"transformer.h.{layer}.moe.experts.gate_up_proj"] = torch.cat(
                    [got["gate"], got["up"]], dim=1)
        return out

    def to_native(self, state, cfg, folder):
        out = {}
        head = cfg.resolved_head_dim
        sizes = [cfg.num_attention_heads * head, *[cfg.num_key_value_heads * head] * 2]
        for key, value in state.items():
            if match := FUSED_QKV.match(key):
                for name, part in zip("qkv", value.split(sizes), strict=True):
                    out[f"model.layers.{match[1]}.self_attn.{name}_proj.weight"] = part
            elif match := FUSED_GATE_UP.match(key):
                gate, up = value.chunk(2, dim=1)
                out[f"model.layers.{match[1]}.moe.experts.gate_proj"] = gate
                out[f"model.layers.{match[1]}.moe.experts.up_proj"] = up
            else:
                out[key.replace("transformer.h.", "model.layers.", 1)
                    .replace("transformer.", "model.", 1)] = value
        return out


SHAPE = ParallelShape("parallel_block", TensorPlan(
    colwise=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.fc_in"),
    rowwise=("self_attn.o_proj", "mlp.fc_out"),
    inputs={"self_attn": 5, "mlp": 1},
    per_head_norms=("self_attn.q_norm", "self_attn.k_norm"),
    sequence_norms=("input_layernorm",),
    replicated_experts=True,  # the MoE layers' router and experts whole on every tp rank
))
register_family(Family("parallel_dllm", "native", ("parallel_dllm",), "ParallelForDiffusion",
                       config_defaults={"num_experts": 4, "num_experts_per_tok": 2,
                                        "first_k_dense_replace": 1},
                       layout=NestedLayout(), shape=SHAPE), ParallelModel)
'''
BASE = {
    "model": {"model_type": "parallel_dllm", "num_hidden_layers": 4, "num_key_value_heads": 2,
              "attn_implementation": "sdpa"},
    "optim": {"name": "adamw"},
    "train": {"split_batches": True, "eval_steps": 0, "save_steps": 0, "logging_steps": 1,
              "max_steps": STEPS},
}  # fmt: skip


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    """The plug-in as an installed package, registered in this process too."""
    from unmask.models import unregister_family

    root = installed_plugin(tmp_path_factory.mktemp("family_plugin"), "toy_family", None,
                            PLUGIN)  # fmt: skip
    sys.path.insert(0, str(root))
    import toy_family  # noqa: F401  (registers it here: the one-process reference)

    yield root
    unregister_family("parallel_dllm")
    sys.path.remove(str(root))
    sys.modules.pop("toy_family")


def plugin_env(root) -> dict:
    return rank_env({"PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])})


def test_an_unregistered_family_is_refused_naming_the_registered_ones(tmp_path):
    from unmask.config import load_config

    path = write_run_config(tmp_path, "bad", BASE, {})
    with pytest.raises(Exception, match="model.model_type.*Input should be 'qwen3_dllm'"):
        load_config(path)


def test_its_shape_drives_the_flop_count_and_the_traced_saves(plugin, tmp_path):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from unmask.config import load_config
    from unmask.models import build_model
    from unmask.parallel.pipeline_plan import layer_costs
    from unmask.plan.memory import traced_layer_bytes
    from unmask.train.trainer import Trainer

    cfg = load_config(write_run_config(tmp_path, "one", BASE, {}))
    arch = cfg.model
    assert (arch.num_experts, arch.num_experts_per_tok, arch.first_k_dense_replace) == (4, 2, 1)
    # the pipeline's per-layer cost: the toy's two GELU matrices on layer 0, the router and
    # two of four SwiGLU experts on the MoE layers
    h, inner, length = arch.hidden_size, arch.intermediate_size, 32
    width = arch.num_attention_heads * arch.resolved_head_dim
    attention = 2 * h * width + 2 * h * arch.num_key_value_heads * arch.resolved_head_dim
    costs = layer_costs(arch, length, 0.5).layers
    assert costs[0] == 6 * (attention + 2 * h * inner) + 12 * width * length
    assert costs[1] == 6 * (attention + 4 * h + 2 * 3 * inner * h) + 12 * width * length
    # the MFU's count of a step equals torch's FlopCounterMode (the experts one matmul each:
    # the counter has no formula for torch._grouped_mm, as tests/unit/test_step_audit.py says)
    loop = {"model": {"moe_implementation": "loop"}}
    trainer = Trainer(load_config(write_run_config(tmp_path, "loop", BASE, loop)))
    batch = next(trainer.loader)
    trainer.train_step([batch])
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        stats = trainer.train_step([next(trainer.loader)])
    assert float(stats["flops"]) == pytest.approx(counter.get_total_flops(), rel=0.02)
    # the planner's traced saves of the dense and an MoE layer equal what autograd saves in a
    # real forward of that block (its input included; the RoPE tables, which the trace
    # counts on layer 0, which saves them first)
    from unmask.models.attention import build_attention_mask
    from unmask.models.transformer import rotary_cos_sin

    model = build_model(arch)
    traced = traced_layer_bytes(arch.model_dump_json(), 2, length, False, False)
    for index in (0, 1):
        cos, sin = rotary_cos_sin(torch.arange(length).expand(2, length), arch.rotary_dim,
                                  arch.rope_theta)  # fmt: skip
        seen = {t.untyped_storage().data_ptr() for t in [*model.parameters(), cos, sin]}
        saved: list[int] = []

        def pack(t, seen=seen, saved=saved):
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                saved.append(t.untyped_storage().nbytes())
            return t

        x = torch.randn(2, length, h, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.model.layers[index](x, cos, sin, build_attention_mask(None, "sdpa"))
        tables = 0 if index else cos.nbytes + sin.nbytes  # saved first by layer 0
        assert traced[index] == sum(saved) + tables > tables, index
    assert traced[1] > traced[0]  # the experts' routed copies


def test_it_reads_and_writes_its_own_folder(plugin, tmp_path):
    from safetensors.torch import load_file

    from unmask.models import ModelConfig, build_model, from_pretrained, save_pretrained

    torch.manual_seed(0)
    arch = ModelConfig(model_type="parallel_dllm", vocab_size=128, hidden_size=32,
                       intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                       num_key_value_heads=1, moe_intermediate_size=16)  # fmt: skip
    model = build_model(arch)
    save_pretrained(model, tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["model_type"] == "parallel_dllm" and "hidden_size" not in config
    text = config["text_config"]
    assert (text["hidden_size"], text["num_local_experts"], text["intermediate_size_moe"],
            text["first_k_dense_replace"]) == (32, 4, 16, 1)  # fmt: skip
    tensors = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert not any(key.startswith("model.") for key in tensors)
    assert tuple(tensors["transformer.h.0.attn.qkv.weight"].shape) == (32 + 2 * 16, 32)
    assert "transformer.h.0.mlp.fc_in.weight" in tensors  # the dense first layer
    assert tuple(tensors["transformer.h.2.moe.experts.gate_up_proj"].shape) == (4, 2 * 16, 32)
    assert not any("gate_proj" in key or "q_proj" in key for key in tensors)

    loaded = from_pretrained(tmp_path / "saved")
    assert loaded.config.model_type == "parallel_dllm" and loaded.config.num_experts == 4
    ours, theirs = model.state_dict(), loaded.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    save_pretrained(loaded, tmp_path / "again")  # the same folder again, bit for bit
    assert json.loads((tmp_path / "again" / "config.json").read_text()) == config
    again = load_file(str(tmp_path / "again" / "model.safetensors"))
    assert again.keys() == tensors.keys()
    assert all(torch.equal(again[k], tensors[k]) for k in tensors)


LAYOUTS = {"tp2": {"tensor_parallel": 2},
           "pp2": {"pipeline_parallel": 2, "pipeline_microbatches": 2},
           "ep2": {"expert_parallel": 2}}  # fmt: skip


def test_it_trains_under_tensor_pipeline_and_expert_parallelism_as_one_process(plugin,
                                                                               tmp_path):  # fmt: skip

    single = train_in_process(write_run_config(tmp_path, "one", BASE, {}), tmp_path / "ref")
    one = losses(single)
    assert sorted(one) == list(range(1, STEPS + 1))
    configs = [write_run_config(tmp_path, name, BASE, {"train": train})
               for name, train in LAYOUTS.items()]  # fmt: skip
    results = tmp_path / "results.json"
    # the three layouts in one launch (one process group), the plug-in found by its entry point
    path = os.pathsep.join([str(plugin), os.environ.get("PYTHONPATH", "")])
    torchrun(2, TRAIN_WORKER, results, *configs, env={"PYTHONPATH": path}, timeout=600)
    runs = json.loads(results.read_text())
    for name in LAYOUTS:
        assert runs[name]["rc"] == 0, runs[name]["stderr"][-3000:]
        split = losses(tmp_path / name)
        assert sorted(split) == sorted(one)
        for step in one:
            assert split[step] == pytest.approx(one[step], rel=1e-5), (name, step)


def plan_json(env, config, *overrides: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "unmask", "plan", str(config), *overrides,
                           "--world", "2", "--device", "cpu", "--json"], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_it_is_planned_generated_and_served(plugin, tmp_path):
    env = plugin_env(plugin)
    config = write_run_config(tmp_path, "run", BASE,
                              {"train": {"save_steps": STEPS, "max_steps": STEPS}})  # fmt: skip
    plan = plan_json(env, config, "parallel.tensor_parallel=2")
    rows = {row["name"]: row for row in plan["ranks"][0]["shards"]}
    assert rows["model.layers.0.mlp.fc_in.weight"]["local"] == [32, 32]  # column-parallel
    assert rows["model.layers.0.mlp.fc_out.weight"]["local"] == [32, 32]  # row-parallel
    assert rows["model.layers.1.moe.experts.gate_proj"]["local"] == [4, 64, 32]  # whole
    assert plan["ranks"][0]["memory"]["activations"] > 0
    # expert parallelism's plan, in this process (where the fixture registered the family)
    from unmask.config import load_config
    from unmask.plan.devices import DEVICES
    from unmask.plan.planner import make_run_plan

    ep = make_run_plan(load_config(config, ["parallel.expert_parallel=2"]), 2, DEVICES["h100"])
    plan = ep.to_json()
    for rank in (0, 1):  # each ep rank holds two of the four experts
        rows = {row["name"]: row for row in plan["ranks"][rank]["shards"]}
        assert rows["model.layers.1.moe.experts.down_proj"]["local"] == [2, 32, 64]
    assert plan["ranks"][0]["memory"]["activations"] > 0

    trained = train_in_process(config, tmp_path / "trained")
    folder = trained / "final"
    saved = json.loads((folder / "config.json").read_text())
    assert saved["model_type"] == "parallel_dllm" and saved["text_config"]["num_local_experts"] == 4
    expected = generate(folder, tmp_path, ["rev 12="], "--gen-length", "8", "--block-length",
                        "4")  # fmt: skip
    old = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(plugin), old])
    try:
        proc, base = start_server(folder, "--api-key", KEY)
    finally:
        os.environ["PYTHONPATH"] = old
    try:
        body = {"model": "tiny", "prompt": "rev 12=", "max_tokens": 8,
                "unmask": {"block_length": 4}}  # fmt: skip
        reply = httpx.post(base + "/v1/completions", json=body, headers=AUTH, timeout=120)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == expected[0]
    finally:
        proc.terminate()
        proc.wait(60)
