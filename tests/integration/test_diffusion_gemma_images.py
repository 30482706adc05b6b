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
from conftest import DIFFUSION_GEMMA_TEXT, save_tiny_model
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
