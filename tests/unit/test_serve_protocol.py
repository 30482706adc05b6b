"""The request checks of `unmask serve` as functions: strict JSON, the limits of one request
(a growing canvas's cap too), NaN served as null, Host names."""

import json
import re
from pathlib import Path

import pytest

import unmask.serve
from unmask.sampling.config import SamplingConfig
from unmask.serve.guard import allowed_host_names, host_name
from unmask.serve.protocol import Limits, RequestError, check_lengths, finite_json, parse_json


def refused(call, *args) -> str:
    with pytest.raises(RequestError) as caught:
        call(*args)
    assert caught.value.status == 400
    return caught.value.message


def test_parse_json_takes_json_and_refuses_what_json_is_not():
    assert parse_json(b'{"a": [1, 2.5, "\\u00e9", null]}') == {"a": [1, 2.5, "\u00e9", None]}
    assert "nested too deeply" in refused(parse_json, b"[" * 100_000 + b"]" * 100_000)
    assert "NaN is not JSON" in refused(parse_json, b'{"x": NaN}')
    assert "-Infinity is not JSON" in refused(parse_json, b"[-Infinity]")
    assert "lone UTF-16 surrogate" in refused(parse_json, b'{"k": ["ok", {"\\ud800": 1}]}')
    assert "lone UTF-16 surrogate" in refused(parse_json, b'"\\udc00"')
    assert parse_json(b'"\\ud83d\\ude00"') == "\U0001f600"  # a pair is a character
    assert "not valid JSON" in refused(parse_json, b"\xff")


def test_limits_bound_the_canvas_and_the_steps_a_fixed_or_growing_canvas_asks():
    limits = Limits(max_tokens=64, max_steps=128)
    assert check_lengths(SamplingConfig(gen_length=64, steps=128), limits).gen_length == 64
    assert "canvas (65 tokens) is over this server's 64" in refused(
        check_lengths, SamplingConfig(gen_length=65), limits)  # fmt: skip
    assert "unmask.steps (256) is over this server's 128" in refused(
        check_lengths, SamplingConfig(gen_length=64, steps=256), limits)  # fmt: skip
    auto = SamplingConfig(gen_length="auto", block_length=4, gen_length_max=10**7)
    assert "canvas (10000000 tokens)" in refused(check_lengths, auto, limits)
    # within the limits, the block split is still checked
    assert "multiple of block_length" in refused(
        check_lengths, SamplingConfig(gen_length=6, block_length=4), limits)  # fmt: skip


def test_non_finite_numbers_are_served_as_null():
    value = {"loss": [[1, float("nan")], [2, 1.5]], "eta": float("inf"), "ok": [True, "x"]}
    assert finite_json(value) == {"loss": [[1, None], [2, 1.5]], "eta": None, "ok": [True, "x"]}
    json.dumps(finite_json(value), allow_nan=False)  # what the response renders


def test_host_names_and_the_allow_list():
    assert host_name("127.0.0.1:8000") == "127.0.0.1"
    assert host_name("[::1]:8000") == "::1" and host_name("::1") == "::1"
    assert host_name("LocalHost.:80") == "localhost"
    loopback = allowed_host_names("127.0.0.1")
    assert loopback == {"localhost", "127.0.0.1", "::1"}
    assert allowed_host_names("10.0.0.5", ["box.lan"]) == {*loopback, "10.0.0.5", "box.lan"}
    assert allowed_host_names("0.0.0.0") is None  # a wildcard bind: any name reaches it
    assert allowed_host_names("0.0.0.0", ["box.lan"]) == {*loopback, "box.lan"}


def test_the_page_has_no_html_sinks_and_nothing_inline():
    """What the page draws from the server goes in as text; the Content-Security-Policy
    (script-src 'self', style-src 'self') has nothing inline to allow."""
    static = Path(unmask.serve.__file__).parent / "static"
    scripts = sorted(static.glob("*.js"))
    assert len(scripts) >= 4  # common, play, runs, main at least
    for path in scripts:
        script = path.read_text()
        for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(",
                     "new Function", "setAttribute(\"on", "setAttribute(\"style"):  # fmt: skip
            assert sink not in script, (path.name, sink)
    page = (static / "index.html").read_text()
    assert "<style" not in page and " style=" not in page
    tags = re.findall(r"<script[^>]*>", page)
    assert tags and all(re.fullmatch(r'<script src="/static/[a-z]+\.js">', t) for t in tags)
    assert {t.split("/static/")[1][:-2] for t in tags} == {p.name for p in scripts}
    assert not re.search(r"\son[a-z]+=", page)  # no inline event handlers
