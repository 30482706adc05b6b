"""SFT records: chat `messages` and prompt/response pairs, formatted with a chat template.

A chat record `{"messages": [{"role": ..., "content": ...}, ...]}` becomes one prompt/answer
pair: the answer is the last message (it must be the assistant's), the prompt is every
message before it plus the template's generation prompt. With a tokenizer that has a chat
template (and `data.chat_template: true`), prompt/response pairs are formatted the same way
as a user turn and an assistant turn. The border between prompt and answer is kept exact:
prompt and answer are tokenized separately, so packing/padding carry it per row as
`maskable` (see packing.py).
"""

from __future__ import annotations

from typing import Any

from unmask.errors import InputError


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def check_messages(messages: Any, where: str) -> list[dict[str, str]]:
    """Validated list of {"role", "content"} dicts ending with an assistant message."""
    if not isinstance(messages, list) or not messages:
        raise InputError(f"data: {where}: 'messages' must be a non-empty list of turns")
    out = []
    for turn in messages:
        if not isinstance(turn, dict) or "role" not in turn or "content" not in turn:
            raise InputError(
                f"data: {where}: every message needs 'role' and 'content' (got {turn!r})"
            )
        out.append({"role": str(turn["role"]), "content": str(turn["content"])})
    if out[-1]["role"] != "assistant":
        raise InputError(
            f"data: {where}: the last message must be the assistant's answer "
            f"(got role {out[-1]['role']!r})"
        )
    return out


def split_chat(tokenizer, messages: list[dict[str, str]]) -> tuple[str, str]:
    """(prompt text, answer text) of a conversation; the answer is the last message.

    With a chat template: prompt = template(messages[:-1], add_generation_prompt=True) and
    answer = what template(messages) adds after it. Without one: "role: content" lines, then
    "assistant: " as the prompt's end and the bare answer.
    """
    if has_chat_template(tokenizer):
        prompt = tokenizer.apply_chat_template(
            messages[:-1], tokenize=False, add_generation_prompt=True
        )
        full = tokenizer.apply_chat_template(messages, tokenize=False)
        if not full.startswith(prompt):
            raise InputError(
                "data: the tokenizer's chat template does not render the conversation as the "
                "prompt followed by the answer; set data.chat_template: false"
            )
        return prompt, full[len(prompt) :]
    lines = "".join(f"{m['role']}: {m['content']}\n" for m in messages[:-1])
    return lines + "assistant: ", messages[-1]["content"]


def format_pair(tokenizer, record: dict[str, Any], use_template: bool) -> tuple[str, str]:
    """(prompt, answer) texts of a record holding `messages` or `prompt`/`response`."""
    if "messages" in record:
        return split_chat(tokenizer, record["messages"])
    if use_template and has_chat_template(tokenizer):
        turns = [
            {"role": "user", "content": record["prompt"]},
            {"role": "assistant", "content": record["response"]},
        ]
        return split_chat(tokenizer, turns)
    return record["prompt"], record["response"]
