"""`unmask serve` (issue 55): the served id is the run's name (runs/NAME/final -> NAME,
`--served-name` overrides it) in /v1/models, /api/info and every answer; OpenAI's
`temperature` and `top_p` reach DiffusionGemma's entropy_bound as its own schedule or are
left out with a `notices` line, never a 400; joint_threshold's edits are counted in the
usage's `edits` and, on a model whose run trained with edit_fraction 0, warned of in
`notices`. Real servers (subprocesses) and the real openai client."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from conftest import save_tiny_diffusion_gemma, save_tiny_model
from test_serve import free_port

from unmask.cli.serve import served_name
from unmask.sampling.entropy_bound import ENTROPY_BOUND_DEFAULTS
from unmask.serve.protocol import entropy_bound_named

pytestmark = pytest.mark.usefixtures("one_thread")


def serve(model_dir: Path, *flags: str):
    """`unmask serve` of model_dir with no name given; (process, base URL) once /health
    answers."""
    import time

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path.cwd()), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "unmask", "serve", "--model", str(model_dir),
                             "--port", str(port), *flags], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"unmask serve exited: {proc.stdout.read()}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("unmask serve did not answer /health in 300 s")


def stop(proc) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0


def test_served_name_is_the_runs_name(tmp_path):
    assert served_name(tmp_path / "runs" / "quickstart" / "final") == "quickstart"
    assert served_name(tmp_path / "runs" / "quickstart" / "checkpoint-200") == "quickstart"
    assert served_name(tmp_path / "exported") == "exported"
    assert served_name(tmp_path / "runs" / "final-ish") == "final-ish"


def test_entropy_bound_takes_temperature_as_its_schedule():
    start, end = ENTROPY_BOUND_DEFAULTS["temperature_start"], ENTROPY_BOUND_DEFAULTS[
        "temperature_end"]  # fmt: skip
    named, notices = entropy_bound_named({"gen_length": 8, "temperature": 0.5, "top_p": 0.9},
                                         {}, {})  # fmt: skip
    assert named == {"gen_length": 8, "temperature_start": start * 0.5,
                     "temperature_end": end * 0.5}  # fmt: skip
    assert "mapped onto decoder entropy_bound's schedule" in notices[0]
    assert notices[1].startswith("top_p ignored")
    named, notices = entropy_bound_named({"temperature": 0.0}, {}, {"temperature_start": 1.2})
    assert named == {} and "1.2 -> 0.4 is kept" in notices[0]
    named, notices = entropy_bound_named({"temperature": 1.5}, {"temperature_end": 0.1}, {})
    assert named == {} and "unmask.temperature_end sets" in notices[0]


def test_a_run_folder_is_served_by_its_name_and_its_edits_are_counted_and_warned(tmp_path):
    run = tmp_path / "runs" / "reverse"
    folder = save_tiny_model(run / "final", seed=0)
    (run / "config.yaml").write_text(yaml.safe_dump({"diffusion": {"objective": "mdlm",
                                                                   "edit_fraction": 0.0}}))  # fmt: skip
    proc, base = serve(folder)
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["reverse"]
        assert httpx.get(base + "/api/info").json()["model"] == "reverse"
        edits = {"decoder": "joint_threshold", "threshold": 0.2, "block_length": 8}
        answer = client.completions.create(model="reverse", prompt="rev 12=", max_tokens=8,
                                           extra_body={"unmask": edits})  # fmt: skip
        assert answer.model == "reverse"
        usage = answer.usage.model_dump()
        assert usage["edits"] > 0  # the random tiny model edits
        (notice,) = answer.model_extra["notices"]
        assert "diffusion.edit_fraction 0" in notice and "joint_threshold" in notice
        plain = client.completions.create(model="reverse", prompt="rev 12=", max_tokens=8)
        assert plain.usage.model_dump()["edits"] == 0 and "notices" not in plain.model_extra
        with pytest.raises(openai.NotFoundError, match="serves 'reverse'"):
            client.completions.create(model="final", prompt="rev 12=", max_tokens=8)
    finally:
        stop(proc)
    proc, base = serve(folder, "--served-name", "my-model")
    try:
        assert httpx.get(base + "/v1/models").json()["data"][0]["id"] == "my-model"
    finally:
        stop(proc)


def test_openai_temperature_on_diffusion_gemma_gets_200(tmp_path):
    _, folder = save_tiny_diffusion_gemma(tmp_path / "gemma" / "final")
    proc, base = serve(folder)
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        answer = client.completions.create(model="gemma", prompt="rev 12=", max_tokens=8,
                                           temperature=0.7, top_p=0.9, seed=1)  # fmt: skip
        assert answer.choices[0].finish_reason in ("stop", "length")
        notices = answer.model_extra["notices"]
        assert notices[0].startswith("temperature 0.7 mapped onto decoder entropy_bound's")
        assert notices[1].startswith("top_p ignored")
        chat = client.chat.completions.create(
            model="gemma", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
            temperature=0, seed=1)  # fmt: skip
        assert chat.choices[0].message.role == "assistant"
        assert chat.model_extra["notices"][0].startswith("temperature 0 ignored")
        whole = client.completions.create(model="gemma", prompt="rev 12=", max_tokens=8,
                                          temperature=1.0, seed=1)  # fmt: skip
        streamed = client.completions.create(model="gemma", prompt="rev 12=", max_tokens=8,
                                             temperature=1.0, stream=True, seed=1)  # fmt: skip
        chunks = list(streamed)
        assert chunks[0].model_extra["notices"] == whole.model_extra["notices"]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    finally:
        stop(proc)
