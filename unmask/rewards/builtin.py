"""The built-in rewards that run no user code, so they run in the training process:
exact_match, numeric_match (GSM8K-style final-answer extraction) and format.

Each is `fn(completion, record, options) -> float`; a record without what the reward needs
raises RecordError (the caller scores 0 and counts a failure; RewardSet.check refuses it
before training).
"""

from __future__ import annotations

import re
from fractions import Fraction

#: record keys searched, in this order, for the reference answer
REFERENCE_KEYS = ("answer", "target", "response", "completion", "solution")


class RecordError(ValueError):
    """A record lacks what a reward needs (e.g. its reference answer)."""


def reference_key(record: dict, answer_key: str | None = None) -> str | None:
    """The key of the record's reference answer: `answer_key` when given (and present),
    else the first of REFERENCE_KEYS the record holds as a string; None if none."""
    keys = (answer_key,) if answer_key else REFERENCE_KEYS
    return next((k for k in keys if isinstance(record.get(k), str)), None)


def reference_answer(record: dict, answer_key: str | None = None) -> str:
    key = reference_key(record, answer_key)
    if key is None:
        wanted = f"'{answer_key}'" if answer_key else "one of " + ", ".join(REFERENCE_KEYS)
        raise RecordError(f"the record has no reference answer ({wanted}; it has {list(record)})")
    return record[key]


def exact_match(completion: str, record: dict, options: dict) -> float:
    """1.0 when the stripped completion equals the stripped reference answer."""
    got, want = completion.strip(), reference_answer(record, options.get("answer_key")).strip()
    if options.get("ignore_case"):
        got, want = got.casefold(), want.casefold()
    return float(got == want)


# a number: optional sign (not after a word character, so "3-5" gives 3 and 5), digits with
# optional thousands commas (1,234), optional decimals; a trailing "." is not part of it
_NUMBER = r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|(?<![\w.])-?\.\d+"
_NUMBER_RE = re.compile(_NUMBER)
_FRACTION_RE = re.compile(rf"\s*({_NUMBER})\s*/\s*({_NUMBER})\s*")
_LATEX_FRACTION_RE = re.compile(r"\s*(-?)\s*\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}\s*")


def _to_fraction(text: str) -> Fraction:
    return Fraction(text.replace(",", ""))


def _boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (nested braces matched), or None."""
    start = text.rfind("\\boxed")
    while start != -1:
        i = text.find("{", start)
        if i != -1 and not text[start + 6 : i].strip():
            depth = 0
            for j in range(i, len(text)):
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                if depth == 0:
                    return text[i + 1 : j]
        start = text.rfind("\\boxed", 0, start)
    return None


def _fraction(content: str) -> Fraction | None:
    """The value of a text that is one fraction (3/4, \\frac{3}{4}, \\frac34, $-1/2$), or
    None. Dollar signs, percent signs, \\text{} and LaTeX spaces are ignored."""
    content = re.sub(r"\\[!,;: ]|\$|\\%|%|\\text\{[^{}]*\}", "", content).strip().rstrip(".")
    content = re.sub(r"\\([dt]?frac)\s*(\d)\s*(\d)", r"\\\1{\2}{\3}", content)  # \frac34
    for pattern in (_LATEX_FRACTION_RE, _FRACTION_RE):
        if m := pattern.fullmatch(content):
            sign, num, den = m.groups() if len(m.groups()) == 3 else ("", *m.groups())
            try:
                value = _to_fraction(num.strip()) / _to_fraction(den.strip())
            except (ValueError, ZeroDivisionError):
                return None  # \frac{x}{2}, 1/0: not a number
            return -value if sign else value
    return None


def extract_number(text: str) -> Fraction | None:
    """The final answer of a worked solution, GSM8K style: the first number after the last
    `####`, else the number in the last `\\boxed{}` (a fraction, or its first number), else
    the text's value when all of it is one fraction (3/4), else the last number in the text;
    None when there is none. Thousands commas (1,234) and a trailing period are fine."""
    if "####" in text:
        m = _NUMBER_RE.search(text.rsplit("####", 1)[1])
        if m:
            return _to_fraction(m.group())
    content = _boxed(text)
    if content is not None:
        if (number := _fraction(content)) is not None:
            return number
        if m := _NUMBER_RE.search(content.replace("$", "")):
            return _to_fraction(m.group())
    if (number := _fraction(text)) is not None:
        return number
    numbers = _NUMBER_RE.findall(text)
    return _to_fraction(numbers[-1]) if numbers else None


def numeric_match(completion: str, record: dict, options: dict) -> float:
    """1.0 when the completion's final number equals the reference answer's (within
    `tolerance`); 0.0 when it differs or the completion holds no number."""
    reference = reference_answer(record, options.get("answer_key"))
    want = extract_number(reference)
    if want is None:
        raise RecordError(f"the reference answer {_short(reference)} holds no number")
    got = extract_number(completion)
    if got is None:
        return 0.0
    return float(abs(got - want) <= Fraction(options.get("tolerance", 0.0)))


def format_match(completion: str, record: dict, options: dict) -> float:
    """1.0 when the stripped completion matches the pattern (fullmatch or search)."""
    flags = re.DOTALL if options.get("dotall", True) else 0
    match = getattr(re, options.get("match", "fullmatch"))
    return float(match(options["pattern"], completion.strip(), flags) is not None)


IN_PROCESS = {"exact_match": exact_match, "numeric_match": numeric_match, "format": format_match}


def _short(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")
