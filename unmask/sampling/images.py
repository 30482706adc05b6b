"""Pictures for a prompt (`unmask generate --image PATH`, `unmask serve`'s image_url parts):
files or bytes read with PIL, turned into patches by the model folder's own image processor
(transformers' `AutoImageProcessor`, offline: preprocessor_config.json in the folder), and
the tokens that stand for them in the prompt.

Where a picture goes: before the prompt's text, in the order given, each as the folder's
begin-of-image token, one image token per soft token the tower gives it, and the
end-of-image token (config.json's boi_token_id / image_token_id / eoi_token_id), as
Gemma 4's processor expands an image placeholder. Every prompt of a call gets the same
pictures. Bad input is one line (InputError): a missing or unreadable file, a folder
without an image processor, a model without a vision tower.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from pathlib import Path

from unmask.data.images import image_processor, open_image, soft_token_count
from unmask.errors import InputError
from unmask.models.diffusion_gemma_vision import Images, require_vision


@dataclass
class PromptImages:
    """A prompt's pictures: the tokens that go before its text, and their patches (one row
    of images, in order)."""

    prefix: list[int]
    images: Images

    def for_rows(self, rows: int) -> Images:
        """The patches of `rows` prompts that each have these pictures."""
        return Images(self.images.pixel_values.repeat(rows, 1, 1),
                      self.images.position_ids.repeat(rows, 1, 1))  # fmt: skip


MAX_IMAGE_BYTES = 3 * 2**20
"""The served pictures' default size cap (bytes of one picture)."""


def fetch_image_bytes(url: str, name: str, limit: int = MAX_IMAGE_BYTES,
                      seconds: float = 10.0) -> bytes:  # fmt: skip
    """The bytes at an http(s) URL (`unmask serve --allow-remote-images`); one line when the
    fetch fails or the answer is over `limit` bytes."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=seconds) as answer:  # noqa: S310 (http(s) only)
            data = answer.read(limit + 1)
    except (urllib.error.URLError, OSError, ValueError) as err:
        raise InputError(f"{name}: fetching {url!r} failed ({err})") from None
    if len(data) > limit:
        raise InputError(f"{name} is over this server's {limit} bytes per picture; send a "
                         "smaller picture")  # fmt: skip
    return data


def data_url_bytes(url: str, name: str, limit: int = MAX_IMAGE_BYTES) -> bytes:
    """The bytes of a `data:image/...;base64,...` URL; one line for a remote URL (not
    fetched), another form, bad base64 or more than `limit` bytes."""
    if not url.startswith("data:"):
        scheme = url.split(":", 1)[0] if ":" in url else "no scheme"
        raise InputError(f"{name}: only data: URLs are taken ({scheme} URLs are not fetched "
                         "without unmask serve --allow-remote-images); send the picture as "
                         "data:image/png;base64,...")  # fmt: skip
    head, _, payload = url.partition(",")
    if not head.endswith(";base64") or not head[5:].startswith("image/"):
        raise InputError(f"{name}: expected data:image/<type>;base64,<data>, got {head[:40]!r}")
    if len(payload) * 3 // 4 > limit + 3:
        raise InputError(f"{name} is over this server's {limit} bytes per picture; send a "
                         "smaller picture")  # fmt: skip
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InputError(f"{name}: its base64 data does not decode") from None
    if len(data) > limit:
        raise InputError(f"{name} is over this server's {limit} bytes per picture; send a "
                         "smaller picture")  # fmt: skip
    return data


def read_image_files(paths: list[str]) -> list:
    """PIL images of the --image paths (one line for a missing or unreadable one)."""
    out = []
    for path in paths:
        if not Path(path).is_file():
            raise InputError(f"--image {path!r} does not exist; give an image file")
        out.append(open_image(Path(path).read_bytes(), f"--image {path!r}"))
    return out


def prompt_images(model, folder: str | Path, pictures: list) -> PromptImages:
    """The prefix tokens and patches of PIL `pictures` for `model`, through `folder`'s image
    processor (one line when the model has no vision tower or the folder no processor)."""
    vision = require_vision(model)
    batch = image_processor(folder)(images=pictures, return_tensors="pt")
    pixels, positions = batch["pixel_values"], batch["image_position_ids"]
    images = Images(pixels.float(), positions.long())
    k = vision.vision_tower.cfg["pooling_kernel_size"]
    prefix: list[int] = []
    for row in positions.long():
        count = soft_token_count(row, k)
        prefix += [vision.boi_token_id, *[vision.image_token_id] * count, vision.eoi_token_id]
    return PromptImages(prefix, images)


def with_prefix(ids: list[int], pictures: PromptImages | None) -> list[int]:
    """A prompt's token ids after its pictures' tokens."""
    return ids if pictures is None else [*pictures.prefix, *ids]


__all__ = ["MAX_IMAGE_BYTES", "PromptImages", "data_url_bytes", "fetch_image_bytes",
           "image_processor",
           "open_image", "prompt_images", "read_image_files", "with_prefix"]  # fmt: skip
