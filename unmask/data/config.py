"""The `data:` section of a run config: where documents come from and how they become rows."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DatasetFormat = Literal["auto", "text", "jsonl", "parquet", "hf_dataset", "indexed"]
PadPolicy = Literal["eos", "single_eos", "packed"]
#: (packing, supervise_padding) of each pad policy (docs/data.md, Pad policy)
PAD_POLICIES: dict[str, tuple[bool, bool]] = {
    "eos": (False, True),
    "single_eos": (False, False),
    "packed": (True, True),
}


class SourceConfig(BaseModel):
    """One source of a blend (`data.sources`): where its documents are and its share."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    path: str
    """Anything `data.dataset` accepts except "synthetic": a local file or folder, or a
    token store prefix (PREFIX.bin + PREFIX.idx)."""

    weight: float = Field(default=1.0, gt=0)
    """This source's share of the training rows (weights are normalized to sum to 1)."""

    dataset_format: DatasetFormat = "auto"
    """How to read `path` (as data.dataset_format)."""

    text_field: str | None = None
    """Column holding a plain document (None = data.text_field)."""


class DataConfig(BaseModel):
    """Data source, tokenizer and row layout for one run."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    dataset: str = "synthetic"
    """"synthetic" (built-in offline tasks) or a local path: a .txt file (one document per
    non-empty line), .jsonl/.json, .parquet (text and JSON files also compressed: .gz, .zst),
    a file of a format added with `unmask.data.formats.register_format`, a folder written by
    `save_to_disk` (the "train" split of a DatasetDict), a folder of such files, or the prefix
    of a token store written by `unmask preprocess` or Megatron (PREFIX.bin + PREFIX.idx,
    memory-mapped: start-up reads only the index)."""

    dataset_format: DatasetFormat = "auto"
    """How to read `dataset`; "auto" guesses from the file extension or folder contents
    ("indexed" when PREFIX.idx and PREFIX.bin exist)."""

    streaming: bool = False
    """Read `dataset` (or each of `sources`) as a stream: documents are read, tokenized and
    packed as training needs them, in DataLoader workers, each rank reading its own share;
    start-up and memory do not depend on the corpus size. `dataset` is then a local file or
    folder of jsonl / parquet / text shards (.gz, .zst too), or a hub dataset id (where the
    hub is reachable). Needs train.max_steps. The first eval_split documents (a count; a fraction
    means 100) are held out for the eval loss unless eval_dataset is set."""

    sources: list[SourceConfig] = []
    """Blend several sources instead of one `dataset`: a list of {path, weight,
    dataset_format, text_field}. Rows are drawn from each in proportion to its weight,
    deterministically from the seed; each source holds out its own eval documents."""

    text_field: str = "text"
    """Column holding a plain document."""

    prompt_field: str = "prompt"
    """Column holding the prompt of a prompt/answer pair (kept clean, never masked)."""

    response_field: str = "response"
    """Column holding the answer of a prompt/answer pair (the part the loss trains)."""

    image_field: str = "image"
    """Column holding a row's pictures (docs/data.md, Pictures): a path, a list of paths, or
    a `datasets` Image value; rows holding it train a model with a vision tower (its
    folder's image processor turns them into patches). LLaVA-style rows (`image` and
    `conversations` of human / gpt turns, `<image>` placeholders) are read as chats."""

    image_folder: str | None = None
    """Folder the pictures' relative paths are under (None: the dataset file's folder, or
    the folder itself for a folder of files). Every picture path, absolute ones included,
    must resolve to a file under it (a run started from the page then reads only the runs
    folder)."""

    chat_template: bool = True
    """Format prompt/response pairs as a user and an assistant turn with the tokenizer's chat
    template when it has one. Rows with a `messages` list (chat turns, the last one the
    assistant's answer) are always formatted as a chat (the template, or "role: content"
    lines without one)."""

    eval_dataset: str | None = None
    """Separate local eval data (same formats as `dataset`); None holds out `eval_split`."""

    eval_split: float = Field(default=0.05, ge=0)
    """Documents held out for eval when `eval_dataset` is None: a fraction < 1, or a count
    when >= 1. A document is never in both train and eval."""

    tokenizer: str = "char"
    """"char" (built-in character tokenizer) or a local Hugging Face tokenizer folder."""

    packing_length: int = Field(default=256, ge=2)
    """Row length in tokens."""

    packing: bool = True
    """True: concatenate documents (EOS after each) and cut into rows, with per-token document
    ids. False: one example per row, truncated, then padded with EOS to `packing_length`."""

    supervise_padding: bool = True
    """Padded rows only: the EOS padding after an answer is maskable (trained, as in LLaDA
    SFT), which teaches the model where the answer ends. False keeps padding out of the loss."""

    pad_policy: PadPolicy | None = None
    """How a prompt/answer example ends (docs/data.md, Pad policy). `eos`: one example per
    row, the answer padded with EOS to the row length, every padding EOS maskable and trained
    (LLaDA's SFT guide). `single_eos`: one example per row, the answer's one EOS trained, the
    padding after it neither masked nor in the loss. `packed`: no padding, examples packed
    back to back (each ends with its trained EOS) under their own document ids. Setting it
    sets `packing` and `supervise_padding`; None leaves those two as given (padded rows
    default to `eos`, the policy that stops best: benchmarks/results/stopping.md)."""

    synthetic_tasks: list[Literal["reverse", "sort", "add", "repeat"]] = ["reverse", "sort", "add"]
    """Built-in tasks used when `dataset` is "synthetic" (`repeat`: "rep 3x41=" -> "414141",
    an answer whose length depends on the prompt; the stopping benchmark's task)."""

    synthetic_min_digits: int = Field(default=2, ge=1)
    """Shortest digit string of reverse, sort and repeat."""

    synthetic_max_digits: int = Field(default=6, ge=1)
    """Longest digit string of reverse, sort and repeat."""

    synthetic_add_digits: int = Field(default=2, ge=1, le=6)
    """Width of both addition operands, zero-padded ("add 07+45=052")."""

    synthetic_train_size: int = Field(default=50000, ge=1)
    """Number of synthetic training examples."""

    synthetic_eval_size: int = Field(default=300, ge=1)
    """Number of held-out synthetic examples (prompts never seen in training)."""

    seed: int = 0
    """Seed for the eval split, synthetic examples and shuffling."""

    @model_validator(mode="after")
    def _apply_pad_policy(self) -> DataConfig:
        if self.pad_policy is None:
            return self
        packing, supervise = PAD_POLICIES[self.pad_policy]
        given = self.model_fields_set
        for key, want in (("packing", packing), ("supervise_padding", supervise)):
            if key in given and getattr(self, key) != want and (key == "packing" or not packing):
                raise ValueError(
                    f"pad_policy {self.pad_policy!r} means {key}: {str(want).lower()}; "
                    f"drop {key} or the pad_policy"
                )
        # assignment without re-validation (validate_assignment is off)
        object.__setattr__(self, "packing", packing)
        object.__setattr__(self, "supervise_padding", supervise)
        return self

    @model_validator(mode="after")
    def _check_ranges(self) -> DataConfig:
        if self.sources and self.dataset != "synthetic":
            raise ValueError("set data.dataset or data.sources, not both")
        if self.synthetic_min_digits > self.synthetic_max_digits:
            raise ValueError(
                f"synthetic_min_digits={self.synthetic_min_digits} is above "
                f"synthetic_max_digits={self.synthetic_max_digits}"
            )
        if self.eval_split >= 1 and self.eval_split != int(self.eval_split):
            raise ValueError(
                f"eval_split={self.eval_split}: use a fraction below 1 or a whole count of documents"
            )
        if not self.synthetic_tasks:
            raise ValueError(
                "synthetic_tasks is empty; name at least one of reverse, sort, add, repeat"
            )
        return self
