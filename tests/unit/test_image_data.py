"""Image-text rows (data/images.py): LLaVA-style JSONL and a save_to_disk folder with an
Image column become padded rows whose prompts hold each picture's tokens where its
`<image>` placeholder was, and batches whose pictures are what `unmask generate --image`
gives the model for the same files (sampling/images.py prompt_images: the same tokens, the
same patches); the batch's `Images` are the rows' pictures in row order; bad input is one
line, exit 2, nothing written."""

import json
from pathlib import Path

import pytest
import torch
import yaml
from conftest import (
    PICTURE_BOI,
    PICTURE_EOI,
    PICTURE_IMAGE,
    TINY,
    deep_update,
    huge_png,
    save_vision_gemma,
    write_picture_rows,
)
from PIL import Image

from unmask.cli import main
from unmask.data import DataConfig, build_datasets
from unmask.data.tokenizer import build_tokenizer
from unmask.errors import InputError
from unmask.train.step import with_images

pytestmark = pytest.mark.usefixtures("one_thread")

LENGTH = 96


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(the model folder, the LLaVA rows file)."""
    root = tmp_path_factory.mktemp("picture_data")
    return save_vision_gemma(root / "model"), write_picture_rows(root / "data", 6)


def config(data, folder, **extra) -> DataConfig:
    return DataConfig(dataset=str(data), tokenizer=str(folder), packing=False,
                      packing_length=LENGTH, eval_split=2, **extra)  # fmt: skip


def rows_of(data, folder, model_folder=None):
    cfg = config(data, folder)
    tokenizer = build_tokenizer(cfg)
    return build_datasets(cfg, tokenizer, model_folder=str(model_folder or folder)), tokenizer


def test_llava_rows_hold_the_pictures_tokens_and_generates_patches(saved):
    from unmask.data import split_records
    from unmask.models import from_pretrained
    from unmask.sampling.images import prompt_images

    folder, data = saved
    built, tokenizer = rows_of(data, folder)
    train = built.train
    assert len(train) == 4 and len(built.eval) == 2
    records, _ = split_records(config(data, folder))
    model = from_pretrained(folder)
    batch = train.gather(torch.arange(len(train)))

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    own = []
    for b, record in enumerate(records):
        ids, maskable = batch["input_ids"][b].tolist(), batch["maskable"][b].tolist()
        (picture,) = record["images"]
        given = prompt_images(model, folder, [Image.open(picture.path).convert("RGB")])
        assert given.prefix[0] == PICTURE_BOI and given.prefix[-1] == PICTURE_EOI
        prompt = encode("user: ") + given.prefix + encode("\ncolor?\nassistant: ")
        answer = encode(record["messages"][-1]["content"]) + [tokenizer.eos_token_id]
        assert ids[: len(prompt) + len(answer)] == prompt + answer
        assert maskable == [False] * len(prompt) + [True] * (LENGTH - len(prompt))
        own.append(given.images)
    images = with_images(batch)["images"]
    assert torch.equal(images.position_ids, torch.cat([g.position_ids for g in own]))
    assert torch.equal(images.pixel_values, torch.cat([g.pixel_values for g in own]))


def test_a_save_to_disk_folder_with_an_image_column_gives_the_jsonl_rows(saved, tmp_path):
    import datasets

    folder, data = saved
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    pairs = [{"image": r["image"], "prompt": "<image> color?", "response":
              r["conversations"][1]["value"]} for r in rows]  # fmt: skip
    (data.parent / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    table = {"image": [{"bytes": (data.parent / p["image"]).read_bytes(), "path": None}
                       for p in pairs],
             "prompt": [p["prompt"] for p in pairs], "response": [p["response"] for p in pairs]}  # fmt: skip
    features = datasets.Features({"image": datasets.Image(), "prompt": datasets.Value("string"),
                                  "response": datasets.Value("string")})  # fmt: skip
    datasets.Dataset.from_dict(table, features=features).save_to_disk(str(tmp_path / "hf"))
    from_jsonl, _ = rows_of(data.parent / "pairs.jsonl", folder)
    from_folder, _ = rows_of(tmp_path / "hf", folder)
    every = torch.arange(len(from_jsonl.train))
    a, b = from_jsonl.train.gather(every), from_folder.train.gather(every)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert int((a["input_ids"] == PICTURE_IMAGE).sum()) > 0


def test_the_batch_images_are_the_rows_pictures_in_row_order():
    pixels = torch.arange(4 * 2 * 3 * 1, dtype=torch.float).view(4, 2, 3, 1)
    positions = torch.full((4, 2, 3, 2), -1)
    # row 0: two pictures, row 1: none, row 2: one (slot 0), row 3: one of 1 patch
    for row, slot, patches in ((0, 0, 3), (0, 1, 2), (2, 0, 3), (3, 0, 1)):
        positions[row, slot, :patches] = 0
    out = with_images({"input_ids": torch.zeros(4, 5), "image_pixels": pixels,
                       "image_positions": positions})  # fmt: skip
    assert set(out) == {"input_ids", "images"}
    assert torch.equal(out["images"].pixel_values, pixels[[0, 0, 2, 3], [0, 1, 0, 0]])
    assert torch.equal(out["images"].position_ids, positions[[0, 0, 2, 3], [0, 1, 0, 0]])
    none = with_images({"image_pixels": pixels[1:2], "image_positions": positions[1:2]})
    assert none == {}


def write_rows(tmp_path, rows: list[dict]):
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows * 4))
    return path


def test_bad_pictures_are_one_line(saved, tmp_path):
    folder, data = saved
    picture = str(data.parent / "pictures" / "0.png")
    chat = [{"from": "human", "value": "<image> and <image>?"}, {"from": "gpt", "value": "x"}]
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot a picture")
    (tmp_path / "0.png").write_bytes(Path(picture).read_bytes())
    (tmp_path / "away").symlink_to(data.parent / "pictures")
    outside = "is outside data.image_folder .*; pictures are read from under it only"
    cases = {
        # every path must stay under data.image_folder (here the rows file's folder)
        "absolute": ({"image": picture, "conversations": chat}, f"picture '{picture}' {outside}"),
        "parent": ({"image": "../x.png", "conversations": chat}, f"picture '../x.png' {outside}"),
        "home": ({"image": "~/x.png", "conversations": chat}, f"picture '~/x.png' {outside}"),
        "link": ({"image": "away/0.png", "conversations": chat}, f"'away/0.png' {outside}"),
        "missing": ({"image": "nowhere.png", "conversations": chat},
                    "picture '.*nowhere.png' does not exist"),
        "unreadable": ({"image": str(tmp_path / "broken.png"), "prompt": "<image>",
                        "response": "x"}, "broken.png' is not an image PIL can read"),
        "placeholders": ({"image": "0.png", "conversations": chat},
                         "row 0 has 2 <image> placeholder\\(s\\) but 1 picture\\(s\\)"),
    }  # fmt: skip
    for row, message in cases.values():
        with pytest.raises(InputError, match=message):
            rows_of(write_rows(tmp_path, [row]), folder)
    with pytest.raises(InputError, match="data.streaming does not read pictures yet"):
        cfg = config(data, folder).model_copy(update={"streaming": True})
        build_datasets(cfg, build_tokenizer(cfg), model_folder=str(folder))
    with pytest.raises(InputError, match="set data.packing: false"):
        cfg = config(data, folder).model_copy(update={"packing": True})
        build_datasets(cfg, build_tokenizer(cfg), model_folder=str(folder))
    text_only = tmp_path / "text_only"
    text_only.mkdir()
    source = json.loads((folder / "config.json").read_text())
    source.pop("vision_config")
    (text_only / "config.json").write_text(json.dumps(source))
    with pytest.raises(InputError, match="has no vision tower"):
        rows_of(data, folder, text_only)
    with pytest.raises(InputError, match="the model is built without a vision tower"):
        build_datasets(config(data, folder), build_tokenizer(config(data, folder)))


def picture_run(tmp_path, folder, dataset, image_folder, extra: dict | None = None):
    """tmp_path/run.yaml: the folder fine-tuned (`uniform`) on `dataset`'s picture rows, its
    output in tmp_path/run."""
    tree = deep_update(TINY, {"data": {"dataset": str(dataset), "tokenizer": str(folder),
                                       "image_folder": str(image_folder),
                                       "packing_length": LENGTH, "eval_split": 2},
                              "diffusion": {"objective": "uniform"},
                              "train": {"output_dir": str(tmp_path / "run")}})  # fmt: skip
    tree["model"] = {"pretrained": str(folder)}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(deep_update(tree, extra or {})))
    return path


def test_a_missing_picture_stops_unmask_train_in_one_line_before_writing(saved, tmp_path,
                                                                         capsys):  # fmt: skip
    folder, data = saved
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    rows[3]["image"] = "pictures/gone.png"
    bad = tmp_path / "rows.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["train", str(picture_run(tmp_path, folder, bad, data.parent))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "row 3: picture" in err[0] and "gone.png' does not exist" in err[0]
    assert not (tmp_path / "run").exists()


def test_held_out_accuracy_on_rows_with_pictures_is_refused_before_writing(saved, tmp_path,
                                                                           capsys):  # fmt: skip
    """eval.generate_accuracy would decode the held-out prompts without their pictures:
    refused in one line at start-up, the run folder not made."""
    folder, data = saved
    path = picture_run(tmp_path, folder, data, data.parent, {"eval": {"generate_accuracy": True}})
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "eval.generate_accuracy decodes held-out prompts without" in err[0]
    assert not (tmp_path / "run").exists()


def test_a_picture_over_the_pixel_cap_is_one_line_before_decoding(saved, tmp_path):
    """A few bytes of PNG saying 7000 x 7000 (over the cap), 10000 x 10000 (over PIL's own
    89 MP, whose warning is an error here) or 20000 x 10000 (PIL's error) are refused from
    the header by open_image and by a training row."""
    from unmask.data.images import MAX_IMAGE_PIXELS, open_image

    folder, _ = saved
    bomb = huge_png(7000, 7000)
    assert len(bomb) < 100 and MAX_IMAGE_PIXELS == 40_000_000
    with pytest.raises(InputError, match=r"^x is 7000 x 7000 = 49,000,000 pixels, over the "
                       r"40,000,000 a picture may have; shrink it$"):  # fmt: skip
        open_image(bomb, "x")
    for width in (10000, 20000):  # PIL's warning (> 89 MP), PIL's error (> 179 MP)
        with pytest.raises(
            InputError,
            match=r"^y has over 89,478,485 pixels, more than PIL "
            r"decodes safely \(a picture may have 89,478,485\); shrink it$",
        ):
            open_image(huge_png(width, 10000), "y", max_pixels=10**9)
    (tmp_path / "bomb.png").write_bytes(huge_png(20000, 10000))
    row = {"image": str(tmp_path / "bomb.png"), "prompt": "<image>", "response": "x"}
    with pytest.raises(InputError, match=r"bomb.png' has over 89,478,485 pixels, more than "
                       r"PIL decodes safely \(a picture may have 40,000,000\)"):  # fmt: skip
        rows_of(write_rows(tmp_path, [row]), folder)


def test_a_text_dataset_with_an_image_column_trains_as_text_on_a_text_only_model(saved,
                                                                                  tmp_path):  # fmt: skip
    """Rows {"text", "image": URL} are text rows for a model without a vision tower (as
    before pictures were read); for one with a tower the URL is refused as a URL, in one
    line naming data.image_field."""
    folder, _ = saved
    rows = [{"text": f"a cat, number {i}", "image": "http://example.com/cat.jpg"}
            for i in range(6)]  # fmt: skip
    data = tmp_path / "captions.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = config(data, folder)
    tokenizer = build_tokenizer(cfg)
    text = build_datasets(cfg, tokenizer)
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps({"text": r["text"]}) + "\n" for r in rows))
    reference = build_datasets(config(plain, folder), tokenizer)
    for got, want in ((text.train, reference.train), (text.eval, reference.eval)):
        assert len(got) == len(want) > 0
        indices = torch.arange(len(want))
        assert torch.equal(got.gather(indices)["input_ids"], want.gather(indices)["input_ids"])
    with pytest.raises(InputError, match=r"picture 'http://example.com/cat.jpg' is a URL; "
                       r".*set data.image_field \(now 'image'\) to another column"):  # fmt: skip
        build_datasets(cfg, tokenizer, model_folder=str(folder))


def test_a_stream_refuses_pictures_wherever_they_start(saved, tmp_path):
    """data.streaming: a row with pictures (or a LLaVA conversations row) past the rows
    read at start-up is refused in one line when the stream reaches it; an image URL
    column on a text-only model streams as text."""
    folder, _ = saved
    rows = [{"text": f"plain text row {i}"} for i in range(12)]
    rows[10] = {"image": "pictures/0.png", "conversations": [
        {"from": "human", "value": "<image>"}, {"from": "gpt", "value": "x"}]}  # fmt: skip
    data = tmp_path / "mixed.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = config(data, folder).model_copy(update={"streaming": True})
    stream = build_datasets(cfg, build_tokenizer(cfg)).train.dataset()
    with pytest.raises(InputError, match=r"^data.streaming does not read pictures yet \(the "
                       r"stream's row 10 has 'image' or 'conversations'\)"):  # fmt: skip
        list(stream)
    urls = tmp_path / "urls.jsonl"
    urls.write_text("".join(json.dumps({"text": f"a cat {i}", "image": "http://x/c.jpg"}) + "\n"
                            for i in range(12)))  # fmt: skip
    cfg = config(urls, folder).model_copy(update={"streaming": True})
    assert len(list(build_datasets(cfg, build_tokenizer(cfg)).train.dataset())) == 10


def test_a_batch_has_as_many_picture_slots_as_its_rows_need(saved, tmp_path):
    """The slots of a gathered batch are the most pictures one of its rows has (not the
    dataset's most), and its Images equal those of the dataset-wide slots."""
    from unmask.data.images import PictureRows

    folder, data = saved
    for i in range(3):
        (tmp_path / f"{i}.png").write_bytes((data.parent / "pictures" / f"{i}.png").read_bytes())
    rows = [{"image": [], "prompt": "none", "response": "x"},
            {"image": ["0.png"], "prompt": "<image> one", "response": "x"},
            {"image": ["0.png", "1.png", "2.png"], "prompt": "three", "response": "x"}]  # fmt: skip
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows * 2))
    cfg = config(path, folder).model_copy(update={"eval_split": 0, "packing_length": 256})
    source = build_datasets(cfg, build_tokenizer(cfg), model_folder=str(folder)).train
    counts = [len(p) for p in source.pictures]
    index = {n: counts.index(n) for n in (0, 1, 3)}
    wide = PictureRows(source.rows, source.pictures, source.vision, slots=3)
    for chosen, slots in (([0], 1), ([1, 0], 1), ([0, 3, 1], 3)):
        indices = torch.tensor([index[n] for n in chosen])
        batch, reference = source.gather(indices), wide.gather(indices)
        assert batch["image_pixels"].shape[1] == batch["image_positions"].shape[1] == slots
        got, want = with_images(batch), with_images(reference)
        assert set(got) == set(want)
        if "images" in want:
            assert torch.equal(got["images"].pixel_values, want["images"].pixel_values)
            assert torch.equal(got["images"].position_ids, want["images"].position_ids)
