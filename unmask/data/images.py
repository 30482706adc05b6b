"""Image-text rows for training a model with a vision tower (DiffusionGemma): pictures read
from local files, turned into patches by the model folder's own image processor, and the
tokens that stand for them in the prompt.

Where the pictures come from (docs/data.md, Pictures):

- a column `data.image_field` ("image") of a jsonl / json / parquet file or a save_to_disk
  folder: a path, a list of paths, or `datasets`' Image value ({"bytes", "path"}); a
  relative path is under `data.image_folder` (default: the dataset file's folder), and
  every path (absolute, `~`, `..` and links resolved) must stay under it;
- LLaVA-style rows: `image` (a path or a list) and `conversations`, a list of
  {"from": "human" | "gpt" | "system", "value": ...} turns, the last one the answer.

A row's prompt holds one `<image>` placeholder per picture (or none: the pictures then go
before the prompt, as `unmask generate --image` puts them); each placeholder becomes the
folder's begin-of-image token, one image token per soft token the tower gives that
picture, and the end-of-image token (config.json's boi_token_id / image_token_id /
eoi_token_id). The soft token count depends only on the picture's size, read from its
header at start-up (every file is opened and checked then); the pixels are decoded and
resized when a batch is gathered, in the DataLoader worker processes when
train.dataloader_num_workers > 0 (data/loader.py Prefetcher), else in the training
process before the step.

A gathered batch carries its rows' pictures as two tensors, `image_pixels` (B, M, P, D)
and `image_positions` (B, M, P, 2): row b's pictures in its slots, in order, M the most
pictures a row of the batch has (at least 1), P the processor's patches per picture (smaller
pictures padded with (-1, -1) positions), empty slots all padding. Rows stay rows (a
batch slices, moves and pins as text batches do); `with_images` turns them into the
model's `Images` (every picture of the batch in row order) where the batch is fed
(train/step.py `with_images`).
Bad input is one line (InputError): a missing or unreadable file, more placeholders than
pictures (or pictures left over), a model without a vision tower, packed rows.
"""

from __future__ import annotations

import io
import json
import warnings
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from unmask.data.packing import TokenizedExample, _encode_many, pad_examples
from unmask.data.rows import RowStore
from unmask.data.sft import check_messages, format_pair
from unmask.errors import InputError

PLACEHOLDER = "<image>"
"""Where a picture goes in a row's prompt text."""

IMAGE_KEYS = ("image_pixels", "image_positions")
"""The batch keys holding a gathered batch's pictures (module docstring)."""

LLAVA_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
               "system": "system"}  # fmt: skip


MAX_IMAGE_PIXELS = 40_000_000
"""The most pixels (width x height) a picture may have: an 8K picture (7680 x 4320, 33 MP)
fits; a larger one is refused from its header before it is decoded (a few KB of PNG can
say 20000 x 10000). Under PIL's own limit (89 MP), whose warning is an error here too."""


def _opened(data: bytes, name: str, max_pixels: int):
    """PIL's lazy image (header read, nothing decoded) once its size is under `max_pixels`;
    one line naming `name` otherwise. PIL's decompression-bomb warning is an error."""
    from PIL import Image

    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data))
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            limit = min(max_pixels, Image.MAX_IMAGE_PIXELS)
            raise InputError(f"{name} has over {Image.MAX_IMAGE_PIXELS:,} pixels, more than "
                             f"PIL decodes safely (a picture may have {limit:,}); shrink "
                             "it") from None  # fmt: skip
    width, height = image.size
    if width * height > max_pixels:
        image.close()
        raise InputError(f"{name} is {width} x {height} = {width * height:,} pixels, over the "
                         f"{max_pixels:,} a picture may have; shrink it") from None  # fmt: skip
    return image


def open_image(data: bytes, name: str, max_pixels: int = MAX_IMAGE_PIXELS):
    """A PIL RGB image from bytes; one line naming `name` when PIL cannot read them or the
    header says more than `max_pixels` pixels (checked before decoding)."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = _opened(data, name, max_pixels)
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image.load()
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError,
            Image.DecompressionBombWarning) as err:  # fmt: skip
        raise InputError(f"{name} is not an image PIL can read ({type(err).__name__}); give a "
                         "PNG, JPEG, GIF or WebP file") from None  # fmt: skip
    return image.convert("RGB")


def image_processor(folder: str | Path):
    """The folder's own image processor (offline), or one line when it has none."""
    import transformers

    if not (Path(folder) / PROCESSOR_FILE).is_file():
        raise InputError(f"{str(folder)!r} has no image processor (preprocessor_config.json); "
                         "save the model's processor into the folder to give it images")  # fmt: skip
    try:
        return transformers.AutoImageProcessor.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as err:
        raise InputError(f"{str(folder)!r}: its image processor does not load ({err})") from None


PROCESSOR_FILE = "preprocessor_config.json"


def processor_files(folder: str | Path | None) -> dict[str, str]:
    """{PROCESSOR_FILE: its text} of a model folder that has an image processor, for a
    run's checkpoints and final/ (so a folder trained from it takes pictures as it does);
    {} for none."""
    path = Path(folder) / PROCESSOR_FILE if folder else None
    return {PROCESSOR_FILE: path.read_text()} if path is not None and path.is_file() else {}


@dataclass(frozen=True)
class Picture:
    """One picture of a row: a file (`path`) or bytes (`data`, a datasets Image value);
    `name` says which in messages."""

    name: str
    path: str | None = None
    data: bytes | None = None

    def read_bytes(self) -> bytes:
        if self.data is not None:
            return self.data
        try:
            return Path(self.path).read_bytes()
        except OSError as err:
            raise InputError(f"{self.name} cannot be read ({err.strerror})") from None

    def image(self):
        """The decoded RGB picture."""
        return open_image(self.read_bytes(), self.name)

    def size(self) -> tuple[int, int]:
        """(width, height) from the header, after checking the file (one line when PIL
        cannot read it or it has over MAX_IMAGE_PIXELS pixels)."""
        from PIL import UnidentifiedImageError

        data = self.read_bytes()
        try:
            with _opened(data, self.name, MAX_IMAGE_PIXELS) as image:
                size = image.size
                image.verify()
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as err:
            raise InputError(f"{self.name} is not an image PIL can read "
                             f"({type(err).__name__}); give a PNG, JPEG, GIF or WebP "
                             "file") from None  # fmt: skip
        return size


def soft_token_count(positions: torch.Tensor, pooling: int) -> int:
    """Soft tokens the vision tower gives a picture whose patches sit at `positions` (P, 2),
    (-1, -1) on padding patches: (patch columns // k) x (patch rows // k), k the config's
    `pooling_kernel_size` (the tower's pooling, models/diffusion_gemma_vision.py). The one
    count a prompt's image tokens follow, in training rows and in sampling."""
    real = positions[(positions != -1).any(dim=-1)]
    columns, lines = int(real[:, 0].max()) + 1, int(real[:, 1].max()) + 1
    return (columns // pooling) * (lines // pooling)


class FolderVision:
    """What a model folder says about pictures: the image, begin- and end-of-image token
    ids (config.json) and its image processor (preprocessor_config.json)."""

    def __init__(self, folder: str | None, what: str) -> None:
        if folder is None:
            raise InputError(f"data: {what} holds pictures but the model is built without a "
                             "vision tower; set model.pretrained to a DiffusionGemma folder "
                             "with one (vision_config), or drop the pictures")  # fmt: skip
        config_file = Path(folder) / "config.json"
        source = json.loads(config_file.read_text()) if config_file.is_file() else {}
        if "vision_config" not in source:
            raise InputError(f"data: {what} holds pictures but model.pretrained {folder!r} has "
                             "no vision tower (no vision_config in its config.json); give a "
                             "folder with one, or drop the pictures")  # fmt: skip
        self.folder = folder
        self.image_token_id = int(source.get("image_token_id", 258_880))
        self.boi_token_id = int(source.get("boi_token_id", 255_999))
        self.eoi_token_id = int(source.get("eoi_token_id", 258_882))
        self.special = {self.image_token_id, self.boi_token_id, self.eoi_token_id}
        self._counts: dict[tuple[int, int], int] = {}
        self.processor  # noqa: B018 - one line now when the folder has no processor

    @cached_property
    def processor(self):
        return image_processor(self.folder)

    def __getstate__(self) -> dict:  # DataLoader workers load the processor themselves
        return {k: v for k, v in self.__dict__.items() if k != "processor"}

    def patches(self, pictures: list) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """PIL pictures -> (pixels (N, P, D) float, positions (N, P, 2) long, soft tokens
        of each picture)."""
        out = self.processor(images=pictures, return_tensors="pt")
        positions = out["image_position_ids"].long()
        counts = [soft_token_count(row, self._pooling) for row in positions]
        return out["pixel_values"].float(), positions, counts

    @cached_property
    def _pooling(self) -> int:
        source = json.loads((Path(self.folder) / "config.json").read_text())
        return int(source["vision_config"].get("pooling_kernel_size") or 3)

    @cached_property
    def patch_shape(self) -> tuple[int, int]:
        """(P, D) of every picture the processor gives."""
        from PIL import Image

        pixels, _, _ = self.patches([Image.new("RGB", (32, 32))])
        return pixels.shape[1], pixels.shape[2]

    def soft_tokens(self, size: tuple[int, int]) -> int:
        """Soft tokens of a picture of `size` (width, height): the processor's resize
        depends on the size only, so a blank picture of that size tells (cached)."""
        if size not in self._counts:
            from PIL import Image

            self._counts[size] = self.patches([Image.new("RGB", size)])[2][0]
        return self._counts[size]

    def tokens(self, size: tuple[int, int]) -> list[int]:
        return [self.boi_token_id, *[self.image_token_id] * self.soft_tokens(size),
                self.eoi_token_id]  # fmt: skip


def has_pictures(row: dict[str, Any], image_field: str) -> bool:
    value = row.get(image_field)
    return value is not None and value != [] and value != ""


def has_tower(folder: str | None) -> bool:
    """Whether a model folder's config.json has a vision tower (vision_config)."""
    config_file = Path(folder) / "config.json" if folder else None
    try:
        return config_file is not None and "vision_config" in json.loads(config_file.read_text())
    except (OSError, ValueError):
        return False


def picture_row(row: dict[str, Any], image_field: str, tower: bool) -> bool:
    """Whether a row is read as one with pictures: a LLaVA `conversations` row, or one with
    `image_field` set when the model has a vision tower or the row's text holds `<image>`
    (for a text-only model, an `image` column of a text dataset, URLs say, is not read)."""
    if row.get("conversations") is not None:
        return True
    if not has_pictures(row, image_field):
        return False
    rest = {k: v for k, v in row.items() if k != image_field}
    return tower or PLACEHOLDER in json.dumps(rest, default=str)


def picture_record(row: dict[str, Any], where: str, image_field: str, image_folder: Path,
                   prompt_field: str, response_field: str) -> dict[str, Any]:  # fmt: skip
    """A row with pictures as a record: its pair (`prompt`/`response`) or chat (`messages`,
    LLaVA `conversations` turned into them) and `images`, a list of Pictures."""
    value = row.get(image_field)
    values = value if isinstance(value, list) else [] if value is None else [value]
    pictures = []
    for item in values:
        if isinstance(item, dict) and (item.get("bytes") is not None or item.get("path")):
            if item.get("bytes") is not None:
                pictures.append(Picture(f"data: {where}: picture {item.get('path') or ''!r}",
                                        data=item["bytes"]))  # fmt: skip
                continue
            item = item["path"]
        if not isinstance(item, str) or not item:
            raise InputError(f"data: {where}: {image_field!r} must be a path, a list of paths "
                             f"or an Image value; got {type(item).__name__}")  # fmt: skip
        if item.startswith(("http://", "https://")):
            raise InputError(f"data: {where}: picture {item!r} is a URL; pictures are read "
                             "from local files (download them under data.image_folder), or "
                             f"set data.image_field (now {image_field!r}) to another column "
                             "to train the rows as text")  # fmt: skip
        path = Path(item).expanduser()
        path = path if path.is_absolute() else image_folder / path
        root = image_folder.expanduser().resolve()
        if root not in path.resolve().parents:
            raise InputError(f"data: {where}: picture {item!r} is outside data.image_folder "
                             f"{str(image_folder)!r}; pictures are read from under it only "
                             "(set data.image_folder to a folder holding them)")  # fmt: skip
        if not path.is_file():
            raise InputError(f"data: {where}: picture {str(path)!r} does not exist; give "
                             "data.image_folder the folder the paths are under")  # fmt: skip
        pictures.append(Picture(f"data: {where}: picture {str(path)!r}", path=str(path)))
    if row.get("conversations") is not None:
        turns = row["conversations"]
        if not isinstance(turns, list):
            raise InputError(f"data: {where}: 'conversations' must be a list of turns")
        messages = [{"role": LLAVA_ROLES.get(str(t.get("from")), str(t.get("from"))),
                     "content": t.get("value")} for t in turns if isinstance(t, dict)]  # fmt: skip
        record = {"messages": check_messages(messages, where)}
    elif row.get("messages") is not None:
        record = {"messages": check_messages(row["messages"], where)}
    elif row.get(prompt_field) is not None and row.get(response_field) is not None:
        record = {"prompt": str(row[prompt_field]), "response": str(row[response_field])}
    else:
        raise InputError(f"data: {where}: a row with pictures needs {prompt_field!r} and "
                         f"{response_field!r}, 'messages' or LLaVA 'conversations' (fields: "
                         f"{', '.join(map(str, row))})")  # fmt: skip
    return {**record, "images": pictures}


def tokenize_picture_records(records: list[dict[str, Any]], tokenizer, eos_id: int,
                             chat_template: bool, vision: FolderVision,
                             length: int) -> list[TokenizedExample]:  # fmt: skip
    """Prompt ids with each picture's tokens at its placeholder (module docstring), answer
    ids, EOS; prompts (pictures included) not maskable. One line for a row whose
    placeholders and pictures differ in number, whose text holds image tokens itself, or
    whose pictures' tokens do not fit the row."""
    out = []
    for index, record in enumerate(records):
        where = f"row {index}"
        pictures = record.get("images") or []
        prompt, answer = format_pair(tokenizer, record, chat_template)
        pieces = prompt.split(PLACEHOLDER)
        if PLACEHOLDER in answer:
            raise InputError(f"data: {where}: its answer holds {PLACEHOLDER!r}; pictures go "
                             "in the prompt")  # fmt: skip
        holes = len(pieces) - 1
        if holes and holes != len(pictures):
            raise InputError(f"data: {where} has {holes} {PLACEHOLDER} placeholder(s) but "
                             f"{len(pictures)} picture(s); give one picture per "
                             "placeholder")  # fmt: skip
        if not holes:
            pieces = [""] * len(pictures) + [prompt]
        texts = _encode_many(tokenizer, [*pieces, answer])
        inside = sum(1 for piece in texts for t in piece if t in vision.special)
        if inside:
            raise InputError(f"data: {where}: its text holds {inside} image token(s) of its "
                             "own beyond its pictures'; write pictures as "
                             f"{PLACEHOLDER}")  # fmt: skip
        ids: list[int] = list(texts[0])
        for picture, piece in zip(pictures, texts[1 : len(pieces)]):
            ids += vision.tokens(picture.size()) + piece
        if len(ids) >= length:
            raise InputError(f"data: {where}: its prompt with its pictures is {len(ids)} "
                             f"tokens, not below data.packing_length {length}; raise "
                             "data.packing_length or give smaller pictures")  # fmt: skip
        full = ids + texts[-1] + [eos_id]
        out.append(TokenizedExample(full, [False] * len(ids) + [True] * (len(full) - len(ids))))
    return out


class PictureRows:
    """Padded rows (packing.py pad_examples) and each row's pictures, decoded and resized
    by the folder's processor when a batch is gathered (module docstring)."""

    def __init__(self, rows: RowStore, pictures: list[list[Picture]], vision: FolderVision,
                 slots: int | None = None) -> None:  # fmt: skip
        self.rows, self.pictures, self.vision = rows, pictures, vision
        self.slots = slots  # None: the most pictures a row of the gathered batch has

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def row_length(self) -> int:
        return self.rows.row_length

    def gather(self, indices: torch.Tensor) -> dict[str, torch.Tensor]:
        """Rows at `indices`, with their pictures' patches in `image_pixels` and
        `image_positions` (module docstring)."""
        batch = self.rows.gather(indices)
        patches, width = self.vision.patch_shape
        n, chosen_rows = len(indices), indices.tolist()
        most = self.slots or max([len(self.pictures[i]) for i in chosen_rows] + [1])
        pixels = torch.zeros(n, most, patches, width)
        positions = torch.full((n, most, patches, 2), -1, dtype=torch.long)
        chosen = [(row, slot, picture) for row, index in enumerate(chosen_rows)
                  for slot, picture in enumerate(self.pictures[index])]  # fmt: skip
        if chosen:
            got, where, _ = self.vision.patches([p.image() for _, _, p in chosen])
            rows = torch.tensor([r for r, _, _ in chosen])
            slots = torch.tensor([s for _, s, _ in chosen])
            pixels[rows, slots] = got
            positions[rows, slots] = where
        return {**batch, "image_pixels": pixels, "image_positions": positions}


def picture_rows(records: list[dict[str, Any]], tokenizer, eos_id: int, chat_template: bool,
                 vision: FolderVision, length: int, supervise_padding: bool,
                 slots: int | None = None) -> PictureRows:  # fmt: skip
    """PictureRows of records (pairs or chats, some with pictures): one example per row."""
    examples = tokenize_picture_records(records, tokenizer, eos_id, chat_template, vision,
                                        length)  # fmt: skip
    rows = pad_examples(examples, length, eos_id, supervise_padding)
    return PictureRows(rows, [r.get("images") or [] for r in records], vision, slots)


__all__ = ["IMAGE_KEYS", "PLACEHOLDER", "FolderVision", "Picture", "PictureRows",
           "MAX_IMAGE_PIXELS", "PROCESSOR_FILE", "has_pictures", "has_tower", "image_processor", "processor_files", "open_image", "picture_record", "picture_row", "picture_rows",
           "tokenize_picture_records"]  # fmt: skip
