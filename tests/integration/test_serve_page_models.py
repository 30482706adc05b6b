"""The playground of `unmask serve` per loaded model, in headless Chromium (issue 55): the
presets and the first row come from the model's family and decoder (/api/info's
`playground`), none the model refuses; an error clears the canvas; joint_threshold's
edits are marked per token with an edit total equal to the canvas stream's own count;
DiffusionGemma's canvas speaks of renoising, never of masks or edits. One tiny llada2_moe
and one tiny DiffusionGemma server, one browser."""

import json
import re
import signal

import httpx
import pytest
from conftest import _AUDIT_MOE, save_tiny_diffusion_gemma, save_tiny_model
from test_serve import start_server
from test_serve_page import CHROMEDRIVER, CHROMIUM, By, chromium, wait_for

pytestmark = pytest.mark.usefixtures("one_thread")

if not (CHROMIUM and CHROMEDRIVER):
    pytest.skip("needs the system's chromium and chromedriver", allow_module_level=True)


@pytest.fixture(scope="module")
def browser():
    driver = chromium()
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def llada2(tmp_path_factory):
    folder = save_tiny_model(tmp_path_factory.mktemp("llada2") / "model",
                             model_type="llada2_moe", **_AUDIT_MOE)  # fmt: skip
    proc, base = start_server(folder)
    yield base
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    _, folder = save_tiny_diffusion_gemma(tmp_path_factory.mktemp("gemma") / "model")
    proc, base = start_server(folder)
    yield base
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0


def open_play(driver, base: str) -> None:
    driver.get("about:blank")
    driver.get(base + "/")
    wait_for(lambda: driver.find_element(By.ID, "model").text == "tiny"
             and driver.find_elements(By.CSS_SELECTOR, "#preset option"))  # fmt: skip


#: the page's form as shown: presets (value, label), the first row's options, the options
#: shown under "every option", the decoder menu, the legend
READ_FORM = """
const shown = (l) => !l.hidden;
return {
  presets: [...document.querySelectorAll('#preset option')].map((o) => [o.value, o.textContent]),
  top: [...document.querySelectorAll('#top-options label')].filter(shown).map((l) => l.dataset.optionLabel),
  every: [...document.querySelectorAll('#options label')].filter(shown).map((l) => l.dataset.optionLabel),
  decoders: [...document.querySelectorAll('#opt-decoder option')].map((o) => o.value),
  legend: document.getElementById('play-legend').textContent,
};
"""


def form(driver) -> dict:
    return driver.execute_script(READ_FORM)


def choose_preset(driver, name: str) -> None:
    from selenium.webdriver.support.ui import Select

    Select(driver.find_element(By.ID, "preset")).select_by_value(name)


def set_field(driver, field: str, value: str) -> None:
    element = driver.find_element(By.ID, field)
    element.clear()
    if value:
        element.send_keys(value)


def run_and_wait(driver) -> dict:
    driver.find_element(By.ID, "run").click()
    wait_for(lambda: driver.execute_script(
        "const c = document.getElementById('canvas');"
        "return c.dataset.done === '1' || c.dataset.error === '1';"), timeout=120)  # fmt: skip
    return driver.execute_script(
        "const c = document.getElementById('canvas');"
        "return {done: c.dataset.done, error: c.dataset.error, edits: c.dataset.edits,"
        "  status: document.getElementById('status').textContent,"
        "  spans: c.querySelectorAll('span').length, masks: c.querySelectorAll('.mask').length,"
        "  titles: [...c.querySelectorAll('.tok')].map((s) => s.title),"
        "  edited: [...c.querySelectorAll('.tok.edited')].map((s) => [s.title, Number(s.dataset.edits)])};"
    )  # fmt: skip


def canvas_edits(base: str, body: dict) -> int:
    """The oracle: edits in the canvas stream itself (a position holding a token that holds
    another token at the next step), counted here from POST /v1/unmask/canvas."""
    response = httpx.post(base + "/v1/unmask/canvas", json=body, timeout=120)
    assert response.status_code == 200
    frames = [json.loads(line[6:]) for line in response.text.split("\n\n")
              if line.startswith("data: ")]  # fmt: skip
    canvases = [f["canvas"] for f in frames if "canvas" in f]
    return sum(a is not None and b is not None and a != b
               for before, after in zip(canvases, canvases[1:])
               for a, b in zip(before, after))  # fmt: skip


def test_a_llada2_model_gets_llada21_and_masked_presets_each_of_which_it_takes(llada2, browser):
    driver = browser
    open_play(driver, llada2)
    shown = form(driver)
    assert [value for value, _ in shown["presets"]] == [
        "", "speedy", "quality", "llada", "dream", "fastdllm", "mdlm", "random"]  # fmt: skip
    assert shown["presets"][0][1] == "the model folder's (masked)"
    assert shown["presets"][1][1].startswith("LLaDA2.1 speedy")
    assert shown["top"] == ["max_tokens", "steps", "block_length", "temperature"]
    assert shown["decoders"] == ["", "masked", "blocks_from_start", "joint_threshold"]
    # a masked decoder's form holds no option of entropy_bound or joint_threshold
    assert "entropy_bound" not in shown["every"] and "edit_threshold" not in shown["every"]
    # speedy: decoder joint_threshold, whose first row has threshold; its refused options hide
    choose_preset(driver, "speedy")
    shown = form(driver)
    assert shown["top"] == ["max_tokens", "steps", "block_length", "threshold"]
    assert "edit_threshold" in shown["every"] and "remasking" not in shown["every"]
    value = lambda name: driver.find_element(By.ID, "opt-" + name).get_attribute("value")  # noqa: E731
    assert (value("decoder"), value("joint_preset")) == ("joint_threshold", "speedy")
    # every preset decodes (the model refuses none of them)
    set_field(driver, "delay", "0")
    for preset, _ in form(driver)["presets"]:
        choose_preset(driver, preset)
        set_field(driver, "opt-max_tokens", "8")
        result = run_and_wait(driver)
        assert result["done"] == "1" and not result["error"], (preset, result["status"])


def test_an_error_clears_the_canvas(llada2, browser):
    driver = browser
    open_play(driver, llada2)
    set_field(driver, "delay", "0")
    set_field(driver, "opt-max_tokens", "8")
    assert run_and_wait(driver)["spans"] == 9  # the prompt and 8 tokens
    set_field(driver, "opt-max_tokens", "100000")  # over the server's --max-tokens
    result = run_and_wait(driver)
    assert result["error"] == "1" and result["spans"] == 0, result
    assert re.search(r"error: the answer canvas \(100000 tokens\) is over", result["status"])


def test_joint_threshold_edits_are_marked_with_their_step_and_a_total(llada2, browser):
    """LLaDA2.1 speedy on a random tiny model edits many committed tokens: the page's total
    equals the edits of the canvas stream; each edited token says at which step it was
    edited and from which token; the status line gives the total."""
    driver = browser
    open_play(driver, llada2)
    choose_preset(driver, "speedy")
    set_field(driver, "delay", "0")
    set_field(driver, "opt-max_tokens", "8")
    set_field(driver, "opt-block_length", "8")
    result = run_and_wait(driver)
    expected = canvas_edits(llada2, {"prompt": "rev 90417=", "max_tokens": 8, "unmask": {
        "decoder": "joint_threshold", "joint_preset": "speedy", "block_length": 8}})  # fmt: skip
    assert expected > 0
    assert int(result["edits"]) == expected
    assert f"{expected} edits (" in result["status"]
    assert result["edited"] and sum(n for _, n in result["edited"]) == expected
    for title, count in result["edited"]:
        edits = re.findall(r"; edited at step (\d+) from (\".*?\")", title)
        assert len(edits) == count and title.startswith("committed at step "), title
        steps = [int(step) for step, _ in edits]
        assert steps == sorted(steps)


def test_a_diffusion_gemma_model_gets_entropy_bound_presets_and_a_canvas_without_masks(
        gemma, browser, tmp_path):  # fmt: skip
    driver = browser
    open_play(driver, gemma)
    shown = form(driver)
    assert [value for value, _ in shown["presets"]] == ["", "entropy_bound",
                                                        "entropy_bound_careful"]  # fmt: skip
    assert shown["presets"][0][1] == "the model folder's (entropy_bound)"
    # the first row: what entropy_bound takes; nothing it refuses anywhere in the form
    assert shown["top"] == ["max_tokens", "max_denoising_steps", "temperature_start",
                            "temperature_end"]  # fmt: skip
    for refused in ("temperature", "steps", "block_length", "remasking", "threshold",
                    "cache", "edit_threshold"):  # fmt: skip
        assert refused not in shown["top"] + shown["every"], refused
    assert shown["decoders"] == ["", "entropy_bound"]
    assert "mask" not in shown["legend"] and "edit" not in shown["legend"]
    assert "renoised" in shown["legend"]
    set_field(driver, "delay", "0")
    for preset, _ in shown["presets"]:
        choose_preset(driver, preset)
        set_field(driver, "opt-max_tokens", "8")
        result = run_and_wait(driver)
        assert result["done"] == "1" and not result["error"], (preset, result["status"])
        assert result["masks"] == 0 and not result["edited"]
        assert "edit" not in result["status"] and re.search(
            r"\d+ tokens? renoised", result["status"]
        )
        for title in result["titles"]:
            assert re.fullmatch(r"drawn at step \d+(, renoised \d+ times?)? \(p \d+\.\d%\)",
                                title), title  # fmt: skip
    driver.save_screenshot(str(tmp_path / "gemma.png"))


def test_each_preset_is_a_request_the_server_takes(llada2, gemma):
    """/api/info's presets, sent as the page sends them: 200 on both models."""
    for base in (llada2, gemma):
        for preset in httpx.get(base + "/api/info").json()["playground"]["presets"]:
            body = {"prompt": "rev 1=", "max_tokens": 8, "unmask": preset["options"]}
            response = httpx.post(base + "/v1/unmask/canvas", json=body, timeout=120)
            assert response.status_code == 200 and '"done": true' in response.text, (
                preset, response.text[-300:])  # fmt: skip
