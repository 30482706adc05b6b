"""`unmask generate --image` on a DiffusionGemma folder with a vision tower (a tiny random
transformers model, the char tokenizer and transformers' Gemma 4 image processor saved in
the folder): every prompt's text after the pictures' tokens, decoded as transformers'
`generate` decodes the same ids with the same pixel_values after torch.manual_seed(seed + row),
alone and in batches; bad pictures are one line, exit 2, nothing written."""

import json
import threading
from dataclasses import replace
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
import transformers
from conftest import DIFFUSION_GEMMA_TEXT, huge_png, save_tiny_model
from PIL import Image

from unmask.checkpoint import load_for_sampling
from unmask.cli import main
from unmask.sampling.images import prompt_images
from unmask.sampling.texts import before_eos

pytestmark = pytest.mark.usefixtures("one_thread")

EOS, PAD, IMAGE, BOI, EOI = 1, 0, 125, 126, 127
VISION = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
          "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "patch_size": 2,
          "position_embedding_size": 64, "pooling_kernel_size": 2}  # fmt: skip
PROMPTS = ["what is it?", "a", "describe:", "color=", "count 3=", "the cat", "q", "x y z",
           "rev 12=", "sort 31=", "hello", "ok", "b+c", "9", "long prompt with words", "zz",
           "max 3 9=", "min 4 2=", "dup ab=", "shape?", "sum 1 2=", "where"]  # fmt: skip
FLAGS = ["--gen-length", "16", "--max-denoising-steps", "8", "--temperature-start", "0.3",
         "--temperature-end", "0.1", "--confidence-threshold", "0.3"]  # fmt: skip
THEIRS = dict(max_new_tokens=16, max_denoising_steps=8, t_max=0.3, t_min=0.1,
              confidence_threshold=0.3)  # fmt: skip


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(transformers' model, its folder, two picture files of different sizes)."""
    from unmask.data.tokenizer import build_char_tokenizer, ensure_special_tokens

    root = tmp_path_factory.mktemp("dg_images")
    torch.manual_seed(0)
    config = transformers.DiffusionGemmaConfig(
        text_config=DIFFUSION_GEMMA_TEXT, vision_config=VISION, canvas_length=8,
        initializer_range=0.02, image_token_id=IMAGE, boi_token_id=BOI, eoi_token_id=EOI)  # fmt: skip
    hf = transformers.DiffusionGemmaForBlockDiffusion(config).eval()
    with torch.no_grad():  # decisive, as conftest's decisive_diffusion_gemma
        hf.get_input_embeddings().weight.mul_(20.0)
        hf.get_input_embeddings().weight[EOS].mul_(1.3)
        for name, param in hf.named_parameters():
            if "vision" in name and "norm" not in name:
                param.normal_(0.0, 0.3)
    folder = root / "model"
    hf.save_pretrained(str(folder))
    tokenizer = build_char_tokenizer()
    ensure_special_tokens(tokenizer)
    tokenizer.save_pretrained(str(folder))
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    Gemma4ImageProcessorPil(patch_size=2, max_soft_tokens=70,
                            pooling_kernel_size=2).save_pretrained(str(folder))  # fmt: skip
    g = torch.Generator().manual_seed(4)
    pictures = []
    for index, (width, height) in enumerate(((24, 24), (40, 20))):
        pixels = (torch.rand(height, width, 3, generator=g) * 255).to(torch.uint8).numpy()
        path = root / f"picture{index}.png"
        Image.fromarray(pixels).save(path)
        pictures.append(str(path))
    return hf, folder, pictures


@torch.no_grad()
def transformers_text(hf, sm, prefix, images, prompt: str, seed: int) -> str:
    ids = torch.tensor([prefix + sm.tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    torch.manual_seed(seed)
    out = hf.generate(ids, pixel_values=images.pixel_values,
                      image_position_ids=images.position_ids,
                      mm_token_type_ids=(ids == IMAGE).long(), eos_token_id=EOS,
                      pad_token_id=PAD, **THEIRS)  # fmt: skip
    answer = before_eos(out.sequences[0, ids.shape[1] :].tolist()[:16], EOS)
    return sm.tokenizer.decode(answer, skip_special_tokens=True)


def test_generate_with_images_gives_transformers_texts(saved, tmp_path):
    hf, folder, pictures = saved
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    sm = load_for_sampling(folder, device="cpu")
    opened = [Image.open(p).convert("RGB") for p in pictures]
    given = prompt_images(sm.model, folder, opened)
    assert given.prefix.count(IMAGE) == int((given.images.position_ids[..., 0] >= 0).sum()) // 4
    expected = [transformers_text(hf, sm, given.prefix, given.images, p, 11 + r)
                for r, p in enumerate(PROMPTS)]  # fmt: skip
    assert len(set(expected)) >= 15  # the rows differ
    out = tmp_path / "out.jsonl"
    images = [a for p in pictures for a in ("--image", p)]
    for batch in ("16", "4"):
        assert main(["generate", "--model", str(folder), "--prompts", str(prompts), "--out",
                     str(out), "--seed", "11", "--batch-size", batch, *images, *FLAGS]) == 0  # fmt: skip
        got = [json.loads(line)["completion"] for line in out.read_text().splitlines()]
        assert got == expected, batch
    # the pictures are read: one picture only, other texts
    assert main(["generate", "--model", str(folder), "--prompts", str(prompts), "--out",
                 str(out), "--seed", "11", "--image", pictures[1], *FLAGS]) == 0  # fmt: skip
    assert [json.loads(line)["completion"] for line in out.read_text().splitlines()] != expected


def test_bad_pictures_are_one_line_exit_2_nothing_written(saved, tmp_path, capsys):
    _, folder, pictures = saved
    text = tmp_path / "notes.png"
    text.write_text("not a picture")
    masked = str(save_tiny_model(tmp_path / "masked"))
    no_processor = tmp_path / "bare"
    no_processor.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        if (folder / name).exists():
            (no_processor / name).write_bytes((folder / name).read_bytes())
    out = tmp_path / "out.jsonl"
    base = ["generate", "--prompt", "a", "--out", str(out)]
    assert main([*base, "--model", str(folder), "--image", str(tmp_path / "nope.png")]) == 2
    assert main([*base, "--model", str(folder), "--image", str(text)]) == 2
    assert main([*base, "--model", masked, "--image", pictures[0]]) == 2
    assert main([*base, "--model", str(no_processor), "--image", pictures[0]]) == 2
    captured = capsys.readouterr()
    err = [line for line in captured.err.strip().splitlines() if "warning" not in line]
    assert captured.out == "" and not out.exists() and len(err) == 4, err
    assert "nope.png' does not exist; give an image file" in err[0]
    assert "notes.png' is not an image PIL can read" in err[1]
    assert "this model has no vision tower" in err[2]
    assert "has no image processor (preprocessor_config.json)" in err[3]


def test_the_server_answers_a_data_url_picture_as_generate_does(saved, tmp_path):
    """The openai client's chat request with an image_url part (a data: URL) gets the text
    `unmask generate --image` gives the same prompt; a remote URL, an oversized picture and
    bytes that are no picture are HTTP 400 with OpenAI's error body; with remote pictures
    allowed (--allow-remote-images) the URL of the same file (a server on this machine)
    gets the same text."""
    import asyncio
    import base64

    import httpx
    import openai

    from unmask.serve.app import Server, _chat_prompt, build_app
    from unmask.serve.engine import Engine
    from unmask.serve.protocol import ChatMessage

    _, folder, pictures = saved
    sm = load_for_sampling(folder, device="cpu")
    question = "what is it?"
    prompt = _chat_prompt(sm.tokenizer, [ChatMessage(role="user", content=question)])
    dst = tmp_path / "out.jsonl"
    assert main(["generate", "--model", str(folder), "--prompt", prompt, "--out", str(dst),
                 "--seed", "5", "--image", pictures[0], *FLAGS]) == 0  # fmt: skip
    expected = json.loads(dst.read_text())["completion"]
    assert expected  # an answer to compare
    encoded = base64.b64encode(open(pictures[0], "rb").read()).decode()
    engine = Engine(sm)
    server = Server(sm, engine, "tiny")
    app = build_app(server)
    unmask = {"max_denoising_steps": 8, "temperature_start": 0.3, "temperature_end": 0.1,
              "confidence_threshold": 0.3}  # fmt: skip

    def ask(client, url, seed=5):
        content = [{"type": "text", "text": question},
                   {"type": "image_url", "image_url": {"url": url}}]  # fmt: skip
        return client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": content}], max_tokens=16,
            seed=seed, extra_body={"unmask": unmask})  # fmt: skip

    async def ask_all():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            client = openai.AsyncOpenAI(base_url="http://127.0.0.1/v1", api_key="none",
                                        http_client=http, max_retries=0)  # fmt: skip
            reply = await ask(client, f"data:image/png;base64,{encoded}")
            refused = []
            for url in (
                remote,
                f"data:image/png;base64,{encoded}",
                "data:image/png;base64," + base64.b64encode(b"no picture").decode(),
            ):
                if url != remote:
                    server.limits = replace(server.limits, max_image_bytes=64)
                with pytest.raises(openai.BadRequestError) as err:
                    await ask(client, url)
                refused.append(err.value.body)
            # --allow-remote-images: the same picture fetched from a local server
            server.limits = replace(server.limits, max_image_bytes=2**20, remote_images=True)
            fetched = await ask(client, remote)
            # a few bytes of PNG saying 7000 x 7000 (over --max-image-pixels); 9 pictures
            # (over --max-images)
            bomb = base64.b64encode(huge_png(7000, 7000)).decode()
            for urls in ([f"data:image/png;base64,{bomb}"],
                         [f"data:image/png;base64,{encoded}"] * 9):  # fmt: skip
                content = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
                with pytest.raises(openai.BadRequestError) as err:
                    await client.chat.completions.create(
                        model="tiny", messages=[{"role": "user", "content": content}],
                        max_tokens=16)  # fmt: skip
                assert err.value.status_code == 400
                refused.append(err.value.body)
            return reply, refused, fetched

    files = ThreadingHTTPServer(("127.0.0.1", 0), partial(SimpleHTTPRequestHandler,
                                                          directory=str(folder.parent)))  # fmt: skip
    threading.Thread(target=files.serve_forever, daemon=True).start()
    remote = f"http://127.0.0.1:{files.server_port}/{Path(pictures[0]).name}"
    try:
        reply, refused, fetched = asyncio.run(ask_all())
    finally:
        engine.close()
        files.shutdown()
    assert reply.choices[0].message.content == expected
    assert fetched.choices[0].message.content == expected
    assert all(body["type"] == "invalid_request_error" and body["param"] == "messages"
               for body in refused), refused  # fmt: skip
    assert (
        "only data: URLs are taken (http URLs are not fetched without unmask serve "
        "--allow-remote-images)" in refused[0]["message"]
    )
    assert "image_url 1 is over this server's 64 bytes per picture" in refused[1]["message"]
    assert "image_url 1 is not an image PIL can read" in refused[2]["message"]
    assert refused[3]["message"] == (
        "image_url 1 is 7000 x 7000 = 49,000,000 pixels, over "
        "the 40,000,000 a picture may have; shrink it"
    )
    assert (
        refused[4]["message"] == "9 pictures in one request are over this server's 8 (--max-images)"
    )


@pytest.fixture(scope="module")
def live(saved):
    """A real server on 127.0.0.1 (uvicorn in a thread of this process, so the test can
    count the vision tower's forwards): (base URL, the engine, the SamplingModel, the
    app's Server)."""
    import socket

    import uvicorn

    from unmask.serve.app import Server, build_app
    from unmask.serve.engine import Engine

    _, folder, _ = saved
    sm = load_for_sampling(folder, device="cpu")
    engine = Engine(sm, max_batch=8)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    served = Server(sm, engine, "tiny")
    config = uvicorn.Config(build_app(served), log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        thread.join(0.05)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", engine, sm, served
    server.should_exit = True
    thread.join(30)
    engine.close()


def data_url(path) -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode()


def chat(base: str, question: str, pictures: list[str], seed: int) -> str:
    """The answer of a chat request with the pictures as image_url parts (data: URLs)."""
    import httpx

    content = [{"type": "text", "text": question},
               *({"type": "image_url", "image_url": {"url": data_url(p)}} for p in pictures)]  # fmt: skip
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}],
            "max_tokens": 16, "seed": seed, "unmask": UNMASK}  # fmt: skip
    reply = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["message"]["content"]


UNMASK = {"max_denoising_steps": 8, "temperature_start": 0.3, "temperature_end": 0.1,
          "confidence_threshold": 0.3}  # fmt: skip


def test_rows_with_and_without_pictures_share_batches_each_as_generate_alone(saved, live,
                                                                             tmp_path,
                                                                             monkeypatch):  # fmt: skip
    """Six concurrent chat requests on a real server, three with a picture (two with both),
    three without, each seeded: every answer is the one `unmask generate` gives its prompt
    alone (--batch-size 1, the same seed); the requests shared the decoder's forwards (more
    rows than forwards), and the vision tower ran once per prompt with pictures."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from unmask.models.diffusion_gemma_vision import VisionTower
    from unmask.serve.app import _chat_prompt
    from unmask.serve.protocol import ChatMessage

    _, folder, pictures = saved
    base, engine, sm, _ = live
    questions = ["what is it?", "describe:", "color=", "the cat", "count 3=", "q"]
    shown = [[pictures[0]], [pictures[0], pictures[1]], [], [pictures[1], pictures[0]], [], []]
    seeds = [21 + i for i in range(len(questions))]
    expected = []
    for question, images, seed in zip(questions, shown, seeds):
        prompt = _chat_prompt(sm.tokenizer, [ChatMessage(role="user", content=question)])
        out = tmp_path / "out.jsonl"
        flags = [a for p in images for a in ("--image", p)]
        assert main(["generate", "--model", str(folder), "--prompt", prompt, "--out", str(out),
                     "--seed", str(seed), *flags, *FLAGS]) == 0  # fmt: skip
        expected.append(json.loads(out.read_text())["completion"])
    assert len(set(expected)) >= 4
    runs = []
    forward = VisionTower.forward

    def counted(self, pixels, positions):
        runs.append(pixels.shape[0])
        return forward(self, pixels, positions)

    monkeypatch.setattr(VisionTower, "forward", counted)
    before = (engine.stats.forwards, engine.stats.row_forwards, engine.stats.pictures_encoded)

    def ask(index):
        return chat(base, questions[index], shown[index], seeds[index])

    with ThreadPoolExecutor(len(questions)) as pool:
        got = list(pool.map(ask, range(len(questions))))
    assert got == expected
    forwards = engine.stats.forwards - before[0]
    row_forwards = engine.stats.row_forwards - before[1]
    assert row_forwards > forwards, (row_forwards, forwards)  # rows shared forwards
    with_pictures = [len(images) for images in shown if images]
    assert sorted(runs) == sorted(with_pictures)  # one tower forward per prompt
    assert engine.stats.pictures_encoded - before[2] == sum(with_pictures)
    metrics = httpx.get(base + "/metrics").text
    assert f"unmask_pictures_encoded_total {engine.stats.pictures_encoded}" in metrics


def test_the_playground_sends_an_uploaded_picture_and_refuses_one_over_the_cap(saved, live):
    """In Chromium: a PNG chosen in the playground's file input goes with the prompt (a
    data: URL) and the answer is the chat API's for the same picture and seed; the server
    refuses it over its cap (the page shows the server's line), and the page itself
    refuses it before sending once /api/info says the smaller cap."""
    page = pytest.importorskip("test_serve_page")  # skipped without chromium
    from selenium.webdriver.common.by import By

    from unmask.serve.app import _chat_prompt
    from unmask.serve.protocol import ChatMessage

    _, _, pictures = saved
    base, engine, sm, served = live
    question, seed = "what is it?", 31
    expected = chat(base, question, [pictures[0]], seed)
    assert expected != chat(base, question, [], seed)  # the picture changes the answer
    prompt = _chat_prompt(sm.tokenizer, [ChatMessage(role="user", content=question)])
    options = {"max_tokens": 16, **UNMASK}
    driver = page.chromium()
    limits = served.limits
    try:

        def open_page():
            driver.get(base + "/")
            page.wait_for(lambda: driver.find_element(By.ID, "model").text == "tiny"
                          and not driver.find_element(By.ID, "picture-label").get_attribute("hidden"))  # fmt: skip
            driver.execute_script(
                "document.getElementById('prompt').value = arguments[0];"
                "document.getElementById('seed').value = arguments[1];"
                "document.getElementById('delay').value = '0';"
                "for (const [name, value] of Object.entries(arguments[2]))"
                "  document.getElementById('opt-' + name).value = String(value);",
                prompt, str(seed), options)  # fmt: skip

        def run() -> dict:
            driver.find_element(By.ID, "run").click()
            page.wait_for(lambda: driver.execute_script(
                "const c = document.getElementById('canvas');"
                "return c.dataset.done === '1' || c.dataset.error === '1';"), timeout=120)  # fmt: skip
            return driver.execute_script(
                "const c = document.getElementById('canvas');"
                "return {text: c.dataset.text, error: c.dataset.error,"
                "  status: document.getElementById('status').textContent};")  # fmt: skip

        open_page()
        driver.find_element(By.ID, "picture").send_keys(pictures[0])
        page.wait_for(lambda: "goes with the prompt" in driver.find_element(By.ID, "status").text)
        shown = run()
        assert shown["error"] != "1" and shown["text"] == expected, shown
        served.limits = replace(limits, max_image_bytes=64)  # the page still says the old cap
        refused = run()
        assert refused["error"] == "1"
        assert "image_url 1 is over this server's 64 bytes per picture" in refused["status"]
        before = engine.stats.prompts_encoded
        open_page()  # /api/info: 64 bytes
        driver.find_element(By.ID, "picture").send_keys(pictures[0])
        status = page.wait_for(lambda: driver.find_element(By.ID, "status").text)
        assert status == ("error: picture0.png is over this server's 64 bytes per picture; "
                          "send a smaller picture")  # fmt: skip
        assert driver.find_element(By.ID, "picture-shown").get_attribute("hidden")
        assert engine.stats.prompts_encoded == before
    finally:
        served.limits = limits
        driver.quit()


def picture_task(folder: Path, name: str, rows: list[dict]) -> None:
    """An lm-eval generate_until task `name` (a YAML file in `folder`) over a local JSONL of
    rows {"question", "images": paths relative to the JSONL, "answer"}."""
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / f"{name}.yaml").write_text(f"""task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
doc_to_image: images
target_delimiter: ""
output_type: generate_until
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 16
metric_list:
  - metric: exact_match
""")


def test_unmask_eval_gives_each_document_its_pictures_as_generate_does(saved, tmp_path,
                                                                       offline, capsys):  # fmt: skip
    """`unmask eval --tasks` on a task whose JSONL rows name pictures (lm-eval's
    doc_to_image; paths relative to the JSONL): document i's answer is `unmask generate
    --image` on its prompt with seed + i; a missing picture is one line, exit 2, no file."""
    pytest.importorskip("lm_eval")
    import shutil

    _, folder, pictures = saved
    tasks = tmp_path / "tasks"
    (tasks / "pics").mkdir(parents=True)
    for path in pictures:
        shutil.copy(path, tasks / "pics")
    names = [f"pics/{Path(p).name}" for p in pictures]
    rows = [{"question": "what is it?", "images": [names[0]], "answer": "a"},
            {"question": "describe:", "images": [names[1], names[0]], "answer": "b"},
            {"question": "color=", "images": [], "answer": "c"}]  # fmt: skip
    picture_task(tasks, "pictures", rows)
    out = tmp_path / "results.json"
    flags = FLAGS[2:]  # the task gives the length (max_gen_toks 16)
    assert main(["eval", "--model", str(folder), "--tasks", "pictures", "--include-path",
                 str(tasks), "--preset", "instruct", "--seed", "7", "--log-samples",
                 "--out", str(out), *flags]) == 0  # fmt: skip
    samples = json.loads(out.read_text())["samples"]["pictures"]
    assert [s["doc_id"] for s in samples] == [0, 1, 2]
    answers = []
    for index, sample in enumerate(samples):
        context, _, visual = sample["arguments"][0]
        assert visual == {"visual": rows[index]["images"]}
        images = [a for name in rows[index]["images"] for a in ("--image", str(tasks / name))]
        dst = tmp_path / "one.jsonl"
        assert main(["generate", "--model", str(folder), "--prompt", context, "--out",
                     str(dst), "--seed", str(7 + index), *images, *FLAGS]) == 0  # fmt: skip
        expected = json.loads(dst.read_text())["completion"].split("\n\n")[0]
        assert sample["resps"][0][0] == expected, index
        answers.append(expected)
    assert len(set(answers)) == 3
    capsys.readouterr()
    missing = tmp_path / "missing"
    missing.mkdir()
    picture_task(missing, "missing", [{"question": "q", "images": ["nope.png"], "answer": "a"}])
    out2 = tmp_path / "missing.json"
    assert main(["eval", "--model", str(folder), "--tasks", "missing", "--include-path",
                 str(missing), "--preset", "instruct", "--out", str(out2), *flags]) == 2  # fmt: skip
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "arning" not in line]
    assert len(err) == 1 and not out2.exists(), err
    assert "task 'missing' document 0: image 'nope.png' does not exist" in err[0]


def test_a_row_length_fitted_canvas_counts_the_pictures_tokens(saved, tmp_path, capsys):
    """--row-length R fits the canvas to R less the prompt, its pictures' tokens counted:
    a row exactly as long as the pictures' and the text's tokens leaves no room (one line
    naming that count, exit 2); 8 more give an 8-token canvas."""
    _, folder, pictures = saved
    sm = load_for_sampling(folder, device="cpu")
    opened = [Image.open(p).convert("RGB") for p in pictures]
    prefix = prompt_images(sm.model, folder, opened).prefix
    prompt = "what is it?"
    length = len(prefix) + len(sm.tokenizer(prompt, add_special_tokens=False)["input_ids"])
    assert len(prefix) > 50  # the pictures' tokens are most of the prompt
    out = tmp_path / "out.jsonl"
    images = [a for p in pictures for a in ("--image", p)]
    base = ["generate", "--model", str(folder), "--prompt", prompt, "--out", str(out),
            "--seed", "3", *images, *FLAGS[2:]]  # fmt: skip
    assert main([*base, "--row-length", str(length)]) == 2
    err = capsys.readouterr().err
    assert f"a prompt of {length} tokens leaves no room for an answer in the {length}-token" in err
    assert main([*base, "--row-length", str(length + 8)]) == 0
    fitted = json.loads(out.read_text())
    assert fitted["completion"] == expected_text(folder, prompt, pictures, 8)


def expected_text(folder, prompt: str, pictures: list[str], gen_length: int) -> str:
    """`unmask generate --gen-length N` on the prompt and pictures (seed 3)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.jsonl"
        images = [a for p in pictures for a in ("--image", p)]
        assert main(["generate", "--model", str(folder), "--prompt", prompt, "--out", str(out),
                     "--seed", "3", *images, *FLAGS[2:], "--gen-length", str(gen_length)]) == 0  # fmt: skip
        return json.loads(out.read_text())["completion"]


def test_unmask_export_keeps_the_image_processor(saved, tmp_path):
    """`unmask export` of a folder with an image processor writes its
    preprocessor_config.json, so the exported folder takes pictures as the source does (a
    2-process DCP checkpoint's export: test_uniform_train.py)."""
    from unmask.checkpoint import export

    _, folder, _ = saved
    source = (Path(folder) / "preprocessor_config.json").read_text()
    out = export.export_model(folder, tmp_path / "out")
    assert (out / "preprocessor_config.json").read_text() == source
