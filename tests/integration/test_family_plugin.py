"""A model family with a new block shape added from outside the package, as
docs/architecture.md says (Where to add, a new model family): an installed package's
`unmask.plugins` module registers a `Family` with its own `ModelShape` and builder, and with
no edit of unmask/ the family trains (one process, tensor parallel and pipeline parallel
under torchrun, each equal to one process), samples through `unmask generate` and
`unmask serve`, is planned by `unmask plan` (its layers' saves traced, its FLOPs its own)
and gets the MFU's FLOP count right (torch's FlopCounterMode over a step).

The toy block is GPT-J's / PaLM's parallel block: one norm, whose output the attention and
a plain GELU MLP (two matrices, not SwiGLU's three) read side by side, both added to the
residual."""

import json
import os
import subprocess
import sys
import textwrap

import httpx
import pytest
import torch
from conftest import installed_plugin, losses, train_in_process, write_run_config
from launch import rank_env, torchrun_command
from test_serve import AUTH, KEY, generate, start_server

pytestmark = pytest.mark.slow
STEPS = 4

PLUGIN = textwrap.dedent('''
    """A toy family: the parallel block (one norm; attention and a GELU MLP side by side)."""
    from torch import nn

    from unmask.models import (DiffusionTransformer, Family, ModelShape, TensorPlan,
                               register_family)
    from unmask.models.transformer import Attention, RMSNorm


    class GeluMLP(nn.Module):
        def __init__(self, cfg):
            super().__init__()
            self.fc_in = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
            self.fc_out = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

        def forward(self, x):
            return self.fc_out(nn.functional.gelu(self.fc_in(x)))


    class ParallelBlock(nn.Module):
        def __init__(self, cfg):
            super().__init__()
            self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.self_attn = Attention(cfg)
            self.mlp = GeluMLP(cfg)

        def forward(self, x, cos, sin, mask, cache=None):
            h = self.input_layernorm(x)
            return x + self.self_attn(h, cos, sin, mask, cache) + self.mlp(h)


    class ParallelModel(DiffusionTransformer):
        def __init__(self, cfg):
            super().__init__(cfg)
            self.model.layers = nn.ModuleList(ParallelBlock(cfg)
                                              for _ in range(cfg.num_hidden_layers))
            self.init_weights()


    class ParallelShape(ModelShape):
        def mlp_params(self, arch, index):
            return 2 * arch.hidden_size * arch.intermediate_size


    SHAPE = ParallelShape("parallel_block", TensorPlan(
        colwise=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.fc_in"),
        rowwise=("self_attn.o_proj", "mlp.fc_out"),
        inputs={"self_attn": 5, "mlp": 1},
        per_head_norms=("self_attn.q_norm", "self_attn.k_norm"),
        sequence_norms=("input_layernorm",),
    ))
    register_family(Family("parallel_dllm", "native", ("parallel_dllm",),
                           "ParallelForDiffusion", shape=SHAPE), ParallelModel)
''')
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
    # the pipeline's per-layer cost: the toy's two MLP matrices, not SwiGLU's three
    h, inner, length = arch.hidden_size, arch.intermediate_size, 32
    width = arch.num_attention_heads * arch.resolved_head_dim
    attention = 2 * h * width + 2 * h * arch.num_key_value_heads * arch.resolved_head_dim
    assert layer_costs(arch, length, 0.5).layers[0] == 6 * (attention + 2 * h * inner) + (
        12 * width * length)  # fmt: skip
    # the MFU's count of a step equals torch's FlopCounterMode
    trainer = Trainer(cfg)
    batch = next(trainer.loader)
    trainer.train_step([batch])
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        stats = trainer.train_step([next(trainer.loader)])
    assert float(stats["flops"]) == pytest.approx(counter.get_total_flops(), rel=0.02)
    # the planner's traced saves of a middle layer equal what autograd saves in a real
    # forward of that block (its input included; the RoPE tables, which layer 0 saved
    # first, left out)
    from unmask.models.attention import build_attention_mask
    from unmask.models.transformer import rotary_cos_sin

    model = build_model(arch)
    cos, sin = rotary_cos_sin(torch.arange(length).expand(2, length), arch.rotary_dim,
                              arch.rope_theta)  # fmt: skip
    seen = {t.untyped_storage().data_ptr() for t in [*model.parameters(), cos, sin]}
    saved: list[int] = []

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            saved.append(t.untyped_storage().nbytes())
        return t

    x = torch.randn(2, length, h, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model.layers[1](x, cos, sin, build_attention_mask(None, "sdpa"))
    traced = traced_layer_bytes(arch.model_dump_json(), 2, length, False, False)
    assert traced[1] == sum(saved) > 0


def test_it_trains_under_tensor_and_pipeline_parallelism_as_one_process(plugin, tmp_path):
    env = plugin_env(plugin)
    single = train_in_process(write_run_config(tmp_path, "one", BASE, {}), tmp_path / "ref")
    one = losses(single)
    assert sorted(one) == list(range(1, STEPS + 1))
    for name, train in {"tp2": {"tensor_parallel": 2},
                        "pp2": {"pipeline_parallel": 2, "pipeline_microbatches": 2}}.items():  # fmt: skip
        config = write_run_config(tmp_path, name, BASE, {"train": train})
        run = subprocess.run(torchrun_command(2, "-m", "unmask.cli", "train", config), env=env,
                             capture_output=True, text=True, timeout=600)  # fmt: skip
        assert run.returncode == 0, run.stderr[-3000:]
        split = losses(tmp_path / name)
        assert sorted(split) == sorted(one)
        for step in one:
            assert split[step] == pytest.approx(one[step], rel=1e-5), (name, step)


def test_it_is_planned_generated_and_served(plugin, tmp_path):
    env = plugin_env(plugin)
    config = write_run_config(tmp_path, "run", BASE,
                              {"train": {"save_steps": STEPS, "max_steps": STEPS}})  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "unmask", "plan", str(config),
                           "parallel.tensor_parallel=2", "--world", "2", "--device", "cpu",
                           "--json"], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    rows = {row["name"]: row for row in plan["ranks"][0]["shards"]}
    assert rows["model.layers.0.mlp.fc_in.weight"]["local"] == [32, 32]  # column-parallel
    assert rows["model.layers.0.mlp.fc_out.weight"]["local"] == [32, 32]  # row-parallel
    assert plan["ranks"][0]["memory"]["activations"] > 0

    trained = train_in_process(config, tmp_path / "trained")
    folder = trained / "final"
    assert json.loads((folder / "config.json").read_text())["model_type"] == "parallel_dllm"
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
