"""The page of `unmask serve` in a real headless Chromium (the system's chromium and
chromedriver, driven by Selenium): the playground draws the canvas filling in step by step,
the runs view lists a finished run (trained here), a running one (its metrics.jsonl
growing while the page is open) and hand-written ones, and draws one chart per chosen
metric with the runs overlaid: a legend, log scale, markers, held-out accuracy, the run
filter. Screenshots go to the test's temporary folder (UNMASK_DOCS_SCREENSHOTS=1: the
runs page's and the playground's also to docs/serving-runs.png, docs/serving-playground.png)."""

import json
import math
import os
import re
import shutil
import signal
import time
from pathlib import Path

import httpx
import pytest
import yaml
from conftest import train_in_process, write_run_config
from test_serve import start_server

pytestmark = pytest.mark.usefixtures("one_thread")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
if not (CHROMIUM and CHROMEDRIVER):  # CI installs both (.ci/run): apt-get install chromium
    pytest.skip("needs the system's chromium and chromedriver", allow_module_level=True)

webdriver = pytest.importorskip("selenium.webdriver")
By = pytest.importorskip("selenium.webdriver.common.by").By
NoSuchElementException = pytest.importorskip("selenium.common").NoSuchElementException


#: a run folder's name that is HTML: the page must draw it as text and run nothing
HOSTILE = "<img src=x onerror=window.pwned=1>"


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory):
    """runs/finished: a real 6-step run; runs/running: a run still logging (its config
    plans 100 steps; the test writes its metrics); runs/HOSTILE: a run whose name and
    metric keys are HTML; runs/decades: a finished 30-step run whose loss falls from 10 to
    0.011, with eval points, MFU and a held-out exact match of 80%; runs/one-point: a run
    that has logged one step."""
    configs, root = tmp_path_factory.mktemp("configs"), tmp_path_factory.mktemp("runs")
    config = write_run_config(configs, "tiny", {}, {})
    train_in_process(config, root / "finished")
    running = root / "running"
    running.mkdir()
    tree = yaml.safe_load((root / "finished" / "config.yaml").read_text())
    tree["train"] = {**tree["train"], "max_steps": 100, "output_dir": str(running)}
    (running / "config.yaml").write_text(yaml.safe_dump(tree))
    # its heartbeat names this test's process: alive, so the run is running
    from unmask.runs.heartbeat import this_host

    now = time.time()
    (running / "heartbeat.json").write_text(json.dumps({
        "status": "running", "pid": os.getpid(), "host": this_host(), "started": now,
        "updated": now, "step": None, "step_time": None}))  # fmt: skip
    hostile = root / HOSTILE
    hostile.mkdir()
    records = [{"step": 1, "loss": 2.0}, {"step": 2, "eval_loss": 1.5, HOSTILE: 1},
               {"step": 3, "loss": 1.0, "<script>window.pwned=2</script>": "<b>x</b>"}]  # fmt: skip
    (hostile / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    decades = root / "decades"
    (decades / "final").mkdir(parents=True)
    (decades / "final" / "config.json").write_text("{}")
    tree["train"] = {**tree["train"], "max_steps": 30, "output_dir": str(decades)}
    (decades / "config.yaml").write_text(yaml.safe_dump(tree))
    records = [{"step": s, "loss": 10.0 / s**2, "learning_rate": 1e-3, "mfu": 0.3 + s / 100}
               for s in range(1, 31)]  # fmt: skip
    for s in (10, 20, 30):
        records[s - 1]["eval_loss"] = 12.0 / s**2
    records.append({"step": 30, "heldout_exact_match": 0.8})  # as the trainer ends a run
    (decades / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    one = root / "one-point"
    one.mkdir()
    (one / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 3.0}) + "\n")
    return root


def append_metrics(run, steps) -> None:
    """Records as the trainer logs them: loss, tokens/s, elapsed seconds; eval every 5."""
    with open(run / "metrics.jsonl", "a") as handle:
        for step in steps:
            record = {"step": step, "loss": 4.0 / step ** 0.5, "learning_rate": 1e-3,
                      "tokens_per_second": 1000.0, "elapsed_seconds": 0.5 * step}  # fmt: skip
            if step % 5 == 0:
                record["eval_loss"] = 4.2 / step**0.5
            handle.write(json.dumps(record) + "\n")


def chromium(width: int = 1200, height: int = 800):
    """A headless Chromium of the system's chromium and chromedriver."""
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu",
                 f"--window-size={width},{height}", "--disable-dev-shm-usage"):  # fmt: skip
        options.add_argument(flag)
    return webdriver.Chrome(options=options,
                            service=webdriver.ChromeService(executable_path=CHROMEDRIVER))  # fmt: skip


@pytest.fixture(scope="module")
def page(runs_dir):
    proc, base = start_server(runs_dir / "finished" / "final", "--runs", str(runs_dir))
    driver = chromium()
    yield driver, base
    driver.quit()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0


def wait_for(condition, timeout: float = 30.0, every: float = 0.02):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            value = condition()
        except NoSuchElementException:
            value = None
        if value:
            return value
        time.sleep(every)
    raise AssertionError("timed out")


def test_playground_shows_the_canvas_filling_in(page, tmp_path):
    driver, base = page
    driver.get(base + "/")
    wait_for(lambda: driver.find_element(By.ID, "model").text == "tiny")
    fields = (("opt-max_tokens", "12"), ("opt-block_length", "4"), ("delay", "250"))
    for field, value in fields:
        element = driver.find_element(By.ID, field)
        element.clear()
        element.send_keys(value)
    driver.find_element(By.ID, "run").click()
    canvas = driver.find_element(By.ID, "canvas")
    states = {}  # step -> masks left, as the DOM showed them
    read = (  # the step and the masks drawn, in one script: the page redraws in between
        "const c = document.getElementById('canvas');"
        "return [Number(c.dataset.step || 0), c.querySelectorAll('.mask').length,"
        "        c.dataset.done === '1'];"
    )
    done = False
    while not done:
        step, masks, done = driver.execute_script(read)
        if step and step not in states:
            states[step] = masks
            if step == 2:
                driver.save_screenshot(str(tmp_path / "playground-mid.png"))
        time.sleep(0.02)
    final, states[step] = step, masks
    # one token per step, blocks of 4; the answer may end (EOS) after any block
    assert final in (4, 8, 12), states
    assert len(states) >= 3, states  # frames 250 ms apart: the steps were seen one by one
    assert all(states[s] == 12 - s for s in states), states  # one mask fewer per step
    prompt = canvas.find_element(By.CSS_SELECTOR, ".prompt").text
    assert prompt == "rev 90417="
    assert "forward passes" in driver.find_element(By.ID, "status").text
    driver.save_screenshot(str(tmp_path / "playground.png"))
    assert (tmp_path / "playground.png").stat().st_size > 10_000


def test_playground_offers_every_option_a_legend_and_each_tokens_probability(page, tmp_path):
    from selenium.webdriver.support.ui import Select

    from unmask.serve.protocol import sampling_options

    driver, base = page
    driver.get(base + "/")
    wait_for(lambda: driver.find_element(By.ID, "model").text == "tiny")
    # every option a request takes (unmask generate's flags less the hooks) has a field
    names = [option["name"] for option in sampling_options({})]
    assert len(names) >= 41 and "decoder" in names and "entropy_bound" in names
    for name in names:
        driver.find_element(By.ID, "opt-" + name)
    assert len(driver.find_elements(By.CSS_SELECTOR, "[data-option]")) == len(names)
    legend = driver.find_element(By.ID, "play-legend").get_attribute("textContent")
    for words in ("prompt", "mask", "new this step", "low confidence", "end of text", "hover"):
        assert words in legend
    # a preset (a published sampler) sets its options in the form; the request sends them
    decoders = Select(driver.find_element(By.ID, "preset"))
    assert [o.text.split(":")[0] for o in decoders.options] == [
        "the model folder's (masked)", "LLaDA", "Dream", "Fast-dLLM", "MDLM", "random order"]  # fmt: skip
    decoders.select_by_value("fastdllm")
    value = lambda name: driver.find_element(By.ID, "opt-" + name).get_attribute("value")  # noqa: E731
    assert (value("threshold"), value("cache"), value("remasking")) == ("0.9", "dual", "")
    decoders.select_by_value("dream")
    assert (value("threshold"), value("remasking"), value("schedule")) == ("", "entropy", "dream")
    decoders.select_by_value("llada")
    for field, text in (("opt-max_tokens", "8"), ("opt-block_length", "8"), ("opt-steps", "8"),
                        ("delay", "0")):  # fmt: skip
        element = driver.find_element(By.ID, field)
        element.clear()
        element.send_keys(text)
    driver.find_element(By.ID, "run").click()
    wait_for(lambda: driver.find_element(By.ID, "canvas").get_attribute("data-done") == "1")
    # hovering a committed token says its step and the probability it was committed with
    tokens = driver.find_elements(By.CSS_SELECTOR, "#canvas .tok")
    assert tokens
    steps = []
    for token in tokens:
        title = token.get_attribute("title")
        match = re.fullmatch(r"committed at step (\d+) \(p (\d+\.\d)%\)", title)
        assert match, title
        p = float(token.get_attribute("data-p"))
        assert 0 < p <= 1 and match.group(2) == f"{p * 100:.1f}"
        assert ("low" in token.get_attribute("class").split()) == (p < 0.5)
        steps.append(int(match.group(1)))
    assert sorted(steps) == list(range(1, 9))  # one token a step (llada, 8 steps)
    driver.find_element(By.CSS_SELECTOR, "#all-options summary").click()  # open: every option
    time.sleep(0.2)
    path = tmp_path / "serving-playground.png"
    driver.save_screenshot(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("UNMASK_DOCS_SCREENSHOTS") == "1":
        shutil.copy(path, Path(__file__).resolve().parents[2] / "docs" / "serving-playground.png")


def test_runs_view_lists_runs_and_draws_their_curves(page, runs_dir, tmp_path):
    driver, base = page
    append_metrics(runs_dir / "running", range(1, 11))  # written just now: running
    driver.get(base + "/")
    driver.find_element(By.ID, "tab-runs").click()
    wait_for(lambda: len(table(driver)) == 5)
    rows = table(driver)
    assert rows["finished"][1] == "finished" and rows["finished"][2] == "6/6"
    assert rows["running"][1] == "running" and rows["running"][2] == "10/100"
    assert rows["running"][4] == f"{4.2 / 10**0.5:.4f}"  # eval loss at step 10
    assert rows["running"][7] == "45s"  # 0.5 s a step, 90 steps left
    assert line_points(driver) == {"finished": 6, "running": 10, HOSTILE: 2, "decades": 30,
                                   "one-point": 0}  # fmt: skip
    driver.save_screenshot(str(tmp_path / "runs.png"))
    append_metrics(runs_dir / "running", range(11, 21))  # the run goes on: the page follows
    wait_for(lambda: table(driver)["running"][2] == "20/100", timeout=20)
    assert line_points(driver)["running"] == 20


def test_runs_are_overlaid_in_one_chart_per_metric_with_a_legend(page):
    """The loss chart holds every run that logged a loss, each its own colour, and a
    legend naming each (its text: the run's name)."""
    driver, base = page
    open_runs(driver, base)
    loss = charts(driver)["loss"]
    assert {"finished", "decades", "running", "one-point", HOSTILE} <= set(loss["series"])
    assert set(loss["legend"]) == set(loss["series"])
    colours = {run: s["colour"] for run, s in loss["series"].items()}
    assert len(set(colours.values())) == len(colours)  # one colour a run
    order = driver.execute_script(
        "return [...document.querySelectorAll('#plots .runs-chart')].map((c) => c.dataset.metric);"
    )
    assert order == ["loss", "eval_loss", "heldout_exact_match"]  # the defaults, in this order
    assert len(loss["xticks"]) >= 4 and loss["xticks"][0] in ("0", "1", "5")  # steps


def test_a_loss_that_spans_decades_is_drawn_on_a_log_scale(page):
    """decades' loss falls from 10 to 0.011: a log y axis, ticked at powers of ten; the
    chart's scale menu forces linear (ticks at 1, 2 or 5 times a power of ten) and back."""
    driver, base = page
    open_runs(driver, base)
    loss = charts(driver)["loss"]
    assert loss["scale"] == "log" and loss["caption"] == "step   (log y)"
    assert loss["yticks"] == ["0.01", "0.1", "1", "10"]
    assert loss["menu"] == "auto (log)"
    # y positions: equal steps for each power of ten
    ys = loss["ytick_y"]
    assert max(ys[i] - ys[i + 1] for i in range(3)) - min(ys[i] - ys[i + 1] for i in range(3)) < 1
    choose_scale(driver, "loss", "linear")
    loss = charts(driver)["loss"]
    assert loss["scale"] == "linear" and loss["yticks"] == ["0", "2", "4", "6", "8", "10"]
    choose_scale(driver, "loss", "auto")
    assert charts(driver)["loss"]["scale"] == "log"
    # a metric within a factor of 30 stays linear: learning rates 7.5e-4 to 3e-3
    tick_metric(driver, "learning_rate")
    rate = wait_for(lambda: charts(driver).get("learning_rate"))
    assert rate["scale"] == "linear" and rate["menu"] == "auto (linear)"
    assert len(rate["yticks"]) >= 3 and all(float(t) < 0.01 for t in rate["yticks"])


def test_a_one_point_run_and_sparse_eval_points_are_drawn_as_markers(page):
    driver, base = page
    open_runs(driver, base)
    loss, evals = charts(driver)["loss"], charts(driver)["eval_loss"]
    one = loss["series"]["one-point"]
    assert (one["points"], one["markers"]) == (0, 1)  # no line: a circle
    assert loss["series"]["decades"]["markers"] == 0  # a dense series: a line
    # eval every 10 of 30 steps: a line through 3 markers; every 5 of >= 20: markers too
    assert evals["series"]["decades"]["markers"] == 3 and evals["series"]["decades"]["points"] == 3
    assert evals["series"]["running"]["markers"] == evals["series"]["running"]["points"] >= 2
    # each marker says its run, step and value on hover
    tips = driver.execute_script(
        "return [...document.querySelectorAll('.runs-chart[data-metric=eval_loss] circle title')]"
        "  .map((t) => t.textContent);"
    )
    assert f"decades: step 30, {12 / 900:.6g}"[:24] in [t[:24] for t in tips]


def test_held_out_accuracy_is_a_column_and_a_metric(page):
    driver, base = page
    open_runs(driver, base)
    rows = table(driver)
    assert rows["decades"][5] == "80.0%" and rows["finished"][5] == "-"
    heldout = charts(driver)["heldout_exact_match"]
    assert heldout["title"] == "held-out exact match (heldout_exact_match)"
    assert list(heldout["series"]) == ["decades"]
    assert heldout["series"]["decades"]["markers"] == 1  # one measurement: a marker
    metrics = driver.execute_script(
        "return [...document.querySelectorAll('#runs-metrics input')]"
        "  .map((i) => [i.value, i.checked]);"
    )
    assert ["heldout_exact_match", True] in metrics and ["mfu", False] in metrics
    assert {"loss", "eval_loss", "learning_rate", "tokens_per_second", "elapsed_seconds",
            "mfu"} <= {key for key, _ in metrics}  # fmt: skip
    tick_metric(driver, "heldout_exact_match")  # unticked: its chart goes
    wait_for(lambda: "heldout_exact_match" not in charts(driver))


def test_the_filter_and_the_run_boxes_hide_runs(page, runs_dir):
    """Typing in the filter keeps the runs whose name holds the text (table and charts);
    unticking a run's box (or clicking its legend entry) hides its series everywhere; the
    choices survive the refresh of a running run."""
    driver, base = page
    open_runs(driver, base)
    driver.find_element(By.ID, "runs-filter").send_keys("dec")
    wait_for(lambda: list(charts(driver)["loss"]["series"]) == ["decades"])
    shown = driver.execute_script(
        "return [...document.querySelectorAll('#runs-table tbody tr')]"
        "  .filter((tr) => tr.offsetParent !== null).map((tr) => tr.dataset.run);"
    )
    assert shown == ["decades"]
    driver.find_element(By.ID, "runs-filter").clear()
    driver.find_element(By.ID, "runs-filter").send_keys(" ")  # an input event, then empty
    driver.find_element(By.ID, "runs-filter").send_keys("\b")
    wait_for(lambda: "finished" in charts(driver)["loss"]["series"])
    box = driver.execute_script(
        "return [...document.querySelectorAll('#runs-table input.runs-show')]"
        "  .find((b) => b.dataset.run === 'finished');"
    )
    box.click()
    wait_for(lambda: "finished" not in charts(driver)["loss"]["series"])
    assert "finished" in charts(driver)["loss"]["legend"]  # struck through, not gone
    tick_metric(driver, "mfu")
    # the running run logs on: after the refresh, finished is still hidden, mfu still shown
    step = int(table(driver)["running"][2].split("/")[0])
    append_metrics(runs_dir / "running", range(step + 1, step + 6))
    wait_for(lambda: table(driver)["running"][2] == f"{step + 5}/100", timeout=20)
    drawn = charts(driver)
    assert "mfu" in drawn and "finished" not in drawn["loss"]["series"]
    legend = driver.execute_script(
        "return [...document.querySelectorAll('.runs-chart[data-metric=loss] .runs-entry')]"
        "  .find((b) => b.dataset.run === 'finished');"
    )
    legend.click()  # the legend entry shows it again
    wait_for(lambda: "finished" in charts(driver)["loss"]["series"])


def test_a_hostile_run_name_and_metric_keys_render_as_text_and_run_nothing(page, tmp_path):
    """The folder named HOSTILE (and its HTML metric keys and values): its name is the
    text of its table cell and its legend entries; its HTML keys are not served; no element
    was made of them, no script ran (an onerror handler would set window.pwned), the page's
    own script still works."""
    driver, base = page
    open_runs(driver, base)
    assert table(driver)[HOSTILE][0] == HOSTILE
    assert HOSTILE in charts(driver)["loss"]["legend"]
    keys = driver.execute_script(
        "return [...document.querySelectorAll('#runs-metrics input')].map((i) => i.value);"
    )
    assert not [key for key in keys if "<" in key]
    time.sleep(0.5)  # an injected image would have failed to load and fired by now
    assert driver.execute_script("return window.pwned === undefined;")
    # the playground's own picture preview (#picture-thumb) is the page's one <img>
    assert driver.find_elements(By.CSS_SELECTOR, "img:not(#picture-thumb), script:not([src])") == []
    driver.save_screenshot(str(tmp_path / "hostile.png"))


def test_a_screenshot_of_the_runs_page(runs_dir, tmp_path):
    """The Runs page of docs/serving.md: the runs above, less the hostile one, in a server
    of their own; with UNMASK_DOCS_SCREENSHOTS=1 the PNG replaces docs/serving-runs.png."""
    if not (runs_dir / "running" / "metrics.jsonl").exists():  # this test alone
        append_metrics(runs_dir / "running", range(1, 21))
    shown = tmp_path / "runs"
    shown.mkdir()
    for name in ("decades", "finished", "one-point", "running"):
        (shown / name).symlink_to(runs_dir / name)
    proc, base = start_server(runs_dir / "finished" / "final", "--runs", str(shown))
    driver = chromium(1200, 1200)
    try:
        driver.get(base + "/#runs")
        wait_for(lambda: len(charts(driver)) == 3)
        time.sleep(0.3)
        path = tmp_path / "serving-runs.png"
        driver.save_screenshot(str(path))
    finally:
        driver.quit()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 20_000
    if os.environ.get("UNMASK_DOCS_SCREENSHOTS") == "1":
        shutil.copy(path, Path(__file__).resolve().parents[2] / "docs" / "serving-runs.png")


def open_runs(driver, base: str) -> None:
    """The page loaded afresh (not a jump to #runs of the page shown), its charts drawn."""
    driver.get("about:blank")
    driver.get(base + "/#runs")
    wait_for(lambda: len(table(driver)) == 5 and "loss" in charts(driver))


def table(driver) -> dict[str, list[str]]:
    """The runs table's cells by run, read in one script (the page swaps rows in whole)."""
    return driver.execute_script(
        "const out = {};"
        "for (const tr of document.querySelectorAll('#runs-table tbody tr'))"
        "  out[tr.dataset.run] = [...tr.children].map((td) => td.textContent);"
        "return out;"
    )


#: each chart as drawn: its scale, title, menu, ticks, legend, and per run its line's points,
#: its markers and its colour (read in one script: the page redraws in between)
READ_CHARTS = """
const out = {};
for (const chart of document.querySelectorAll('#plots .runs-chart')) {
  const series = {};
  for (const g of chart.querySelectorAll('g.runs-series')) {
    const line = g.querySelector('polyline'), dot = g.querySelector('circle');
    series[g.dataset.run] = {
      points: line ? line.getAttribute('points').split(' ').length : 0,
      markers: g.querySelectorAll('circle').length,
      colour: line ? line.getAttribute('stroke') : dot.getAttribute('fill'),
    };
  }
  const major = [...chart.querySelectorAll('text.runs-ytick:not(.runs-minor)')];
  const select = chart.querySelector('select.runs-scale');
  out[chart.dataset.metric] = {
    scale: chart.dataset.scale, series, title: chart.querySelector('h3').textContent,
    menu: select.options[select.selectedIndex].textContent,
    legend: [...chart.querySelectorAll('.runs-entry')].map((e) => e.textContent),
    yticks: major.map((t) => t.textContent),
    ytick_y: major.map((t) => Number(t.getAttribute('y'))),
    xticks: [...chart.querySelectorAll('text.runs-xtick')].map((t) => t.textContent),
    caption: chart.querySelector('text.runs-caption')?.textContent,
  };
}
return out;
"""


def charts(driver) -> dict[str, dict]:
    return driver.execute_script(READ_CHARTS)


def line_points(driver) -> dict[str, int]:
    """Points of each run's drawn loss line (0: markers only)."""
    return {run: s["points"] for run, s in charts(driver)["loss"]["series"].items()}


def choose_scale(driver, metric: str, value: str) -> None:
    from selenium.webdriver.support.ui import Select

    menu = driver.find_element(By.CSS_SELECTOR, f'.runs-chart[data-metric="{metric}"] select')
    Select(menu).select_by_value(value)


def tick_metric(driver, key: str) -> None:
    driver.find_element(By.CSS_SELECTOR, f'#runs-metrics input[value="{key}"]').click()


# ------------------------------------------------------------- the chart's tracker tools

#: twelve runs for the chart's tools: r00 ... r08 logging loss, wall time and tokens every
#: step (r00 noisy, and the keys a label table must name), and three whose heartbeat says
#: how they are: live (this test's own pid: alive), killed (a pid that has exited),
#: stopped (checkpoint-29 saved after the step-20 log, of 200 planned)
TRACKED = [f"r{i:02d}" for i in range(9)] + ["live", "killed", "stopped"]
STEPS = 40


def tracked_loss(index: int, step: int) -> float:
    noise = 0.3 * math.sin(7.0 * step) if index == 0 else 0.0
    return round(3.0 / (1.0 + 0.05 * step * (index + 1)) + noise, 6)


def tracked_records(index: int, steps: int = STEPS) -> list[dict]:
    records = []
    for step in range(1, steps + 1):
        record = {"step": step, "loss": tracked_loss(index, step),
                  "elapsed_seconds": round(1.5 * step, 3), "tokens_seen": 1000 * step}  # fmt: skip
        if index == 0:
            record |= {"mfu_model_only": 0.2, "save_stall_seconds": 0.0}
        records.append(record)
    return records


@pytest.fixture(scope="module")
def tracker(page, tmp_path_factory):
    """A second server: its runs folder holds TRACKED, its model a tiny random one."""
    import subprocess
    import sys

    from conftest import save_tiny_model

    from unmask.runs.heartbeat import this_host

    root = tmp_path_factory.mktemp("tracked")
    model = save_tiny_model(tmp_path_factory.mktemp("tracked-model") / "model")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its pid: a process that has exited
    now = time.time()
    for index, name in enumerate(TRACKED):
        run = root / name
        run.mkdir()
        steps = 20 if name == "stopped" else STEPS
        (run / "metrics.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in tracked_records(index, steps))
        )
        (run / "config.yaml").write_text(yaml.safe_dump({"train": {"max_steps": 200}}))
        status = {"live": ("running", os.getpid()), "killed": ("running", gone.pid),
                  "stopped": ("stopped", gone.pid)}.get(name)  # fmt: skip
        if status:
            (run / "heartbeat.json").write_text(json.dumps({
                "status": status[0], "pid": status[1], "host": this_host(), "started": now,
                "updated": now, "step": steps, "step_time": now}))  # fmt: skip
    (root / "stopped" / "checkpoint-29").mkdir()
    (root / "stopped" / "checkpoint-29" / "manifest.json").write_text("{}")
    proc, base = start_server(model, "--runs", str(root))
    yield page[0], base
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0


def open_tracked(driver, base: str) -> dict:
    driver.get("about:blank")
    driver.get(base + "/#runs")
    wait_for(lambda: len(table(driver)) == 12 and "loss" in charts(driver))
    return charts(driver)


def set_control(driver, element_id: str, value: str) -> None:
    """A control's value set and its input and change events sent, as a user's would."""
    driver.execute_script(
        "const e = document.getElementById(arguments[0]); e.value = arguments[1];"
        "e.dispatchEvent(new Event('input')); e.dispatchEvent(new Event('change'));",
        element_id, value)  # fmt: skip


def chart_box(driver, metric: str = "loss") -> dict:
    """The chart's SVG element and its plot area in page pixels."""
    return driver.execute_script(
        "const svg = document.querySelector(`.runs-chart[data-metric=${arguments[0]}] svg.runs-svg`);"
        "const r = svg.getBoundingClientRect();"
        "return {svg, left: r.left, top: r.top, width: r.width, height: r.height};", metric)  # fmt: skip


def step_offset(box: dict, step: float, x0: float, x1: float) -> int:
    """The x offset from the SVG's centre (Selenium's origin) of a step on the chart."""
    left, right = 56, 500 - 14  # CHART.L, CHART.W - CHART.R
    return round(left + (step - x0) / (x1 - x0) * (right - left) - box["width"] / 2)


def test_statuses_of_a_live_a_killed_and_a_stopped_run(tracker):
    """The runs API's status (the one rule `unmask runs` uses): a live run is running, a
    killed one crashed, a stopped one stopped, its step the checkpoint's (29/200), not the
    last logged (20)."""
    driver, base = tracker
    open_tracked(driver, base)
    rows = table(driver)
    assert (rows["live"][1], rows["killed"][1], rows["stopped"][1]) == (
        "running", "crashed", "stopped")  # fmt: skip
    assert rows["stopped"][2] == "29/200" and rows["live"][2] == "40/200"
    statuses = {run["name"]: run["status"] for run in
                httpx.get(base + "/api/runs").json()["runs"]}  # fmt: skip
    assert statuses["stopped"] == "stopped at step 29" and statuses["killed"] == "crashed"


def test_twelve_runs_get_twelve_colours_told_apart(tracker):
    driver, base = tracker
    colours = {run: s["colour"] for run, s in open_tracked(driver, base)["loss"]["series"].items()}
    assert len(colours) == 12 and len(set(colours.values())) == 12
    # CIE76 distance in CIELAB (sRGB, D65), each pair at least 30 apart
    labs = [cielab(c) for c in colours.values()]
    closest = min(math.dist(a, b) for i, a in enumerate(labs) for b in labs[i + 1 :])
    assert closest >= 30, closest


def test_labels_come_from_one_table_and_the_favicon_loads(tracker):
    driver, base = tracker
    open_tracked(driver, base)
    labels = driver.execute_script(
        "return [...document.querySelectorAll('#runs-metrics label')].map((l) => l.textContent);"
    )
    assert {"loss", "wall time (s)", "tokens seen", "MFU (model only)",
            "checkpoint save stall (s)"} <= set(labels)  # fmt: skip
    assert not [label for label in labels if "_" in label], labels  # no raw key
    icon = httpx.get(base + "/favicon.ico")
    assert icon.status_code == 200 and icon.headers["content-type"] == "image/svg+xml"
    assert httpx.get(base + "/static/favicon.svg").content == icon.content
    errors = [e["message"] for e in driver.get_log("browser") if "404" in e["message"]]
    assert errors == []


def test_hovering_a_chart_shows_each_runs_step_and_value(tracker):
    from selenium.webdriver.common.action_chains import ActionChains

    driver, base = tracker
    open_tracked(driver, base)
    box = chart_box(driver)
    ActionChains(driver).move_to_element_with_offset(
        box["svg"], step_offset(box, 20, 1, STEPS), 0).perform()  # fmt: skip
    tip = wait_for(lambda: driver.execute_script(
        "const t = document.getElementById('runs-tip');"
        "return !t.hidden && [...t.children].map((d) => d.textContent);"), timeout=10)  # fmt: skip
    assert tip[0] == "loss"
    shown = {}
    for line in tip[1:]:
        run, step, value = re.fullmatch(r"(\S+): step (\d+), (\S+)", line).groups()
        shown[run] = (int(step), float(value))
    assert set(shown) == set(TRACKED)
    for index, run in enumerate(TRACKED):
        step, value = shown[run]
        assert abs(step - 20) <= 1 or run == "stopped", (run, step)  # stopped: its last, 20
        assert value == pytest.approx(tracked_loss(index, step), rel=1e-5)


def ema(values: list[float], weight: float) -> list[float]:
    """TensorBoard's smoothing (its scalar dashboard's debiased exponential moving average,
    tensorboard/webapp/widgets/line_chart_v2/data_transformer.ts, classicSmoothing at
    v2.16.2), written here from its description: last = last * w + (1 - w) * v, shown as
    last / (1 - w ** n) for the n-th value."""
    last, out = 0.0, []
    for n, value in enumerate(values, start=1):
        last = last * weight + (1 - weight) * value
        out.append(last / (1 - weight**n))
    return out


def test_smoothing_draws_the_moving_average_over_the_faint_raw_line(tracker):
    driver, base = tracker
    open_tracked(driver, base)
    set_control(driver, "runs-smooth", "0.6")
    read = ("const g = [...document.querySelectorAll('.runs-chart[data-metric=loss] g.runs-series')]"
            "  .find((g) => g.dataset.run === 'r00');"
            "const smooth = g.querySelector('polyline.runs-smooth');"
            "return smooth && [JSON.parse(smooth.dataset.values),"
            "  g.querySelector('polyline.runs-raw').getAttribute('stroke-opacity')];")  # fmt: skip
    values, opacity = wait_for(lambda: driver.execute_script(read), timeout=10)
    expected = ema([tracked_loss(0, s) for s in range(1, STEPS + 1)], 0.6)
    assert values == pytest.approx(expected, rel=1e-6)
    assert float(opacity) < 0.5  # the raw line stays, faint
    set_control(driver, "runs-smooth", "0")
    wait_for(lambda: not driver.find_elements(By.CSS_SELECTOR, "polyline.runs-smooth"), 10)


def test_the_x_axis_is_step_wall_time_or_tokens(tracker):
    driver, base = tracker
    open_tracked(driver, base)
    set_control(driver, "runs-x", "wall")
    loss = wait_for(lambda: charts(driver)["loss"]["caption"].startswith("wall time") and
                    charts(driver)["loss"])  # fmt: skip
    assert loss["xticks"] and all(re.fullmatch(r"\d+s|\d+m\d\ds", t) for t in loss["xticks"])
    assert loss["xticks"][-1] == "1m00s"  # 40 steps of 1.5 s
    csv = driver.execute_script("return runsCsv('loss');").splitlines()
    assert csv[0] == "run,step,elapsed_seconds,loss"
    assert f"r01,10,15,{tracked_loss(1, 10)}" in csv
    set_control(driver, "runs-x", "tokens")
    loss = wait_for(lambda: charts(driver)["loss"]["caption"] == "tokens seen" and
                    charts(driver)["loss"])  # fmt: skip
    assert loss["xticks"][-1] == "40k"
    set_control(driver, "runs-x", "step")
    wait_for(lambda: charts(driver)["loss"]["caption"] == "step")


def test_dragging_zooms_to_a_range_and_reset_shows_it_all(tracker):
    from selenium.webdriver.common.action_chains import ActionChains

    driver, base = tracker
    open_tracked(driver, base)
    box = chart_box(driver)
    (ActionChains(driver)
     .move_to_element_with_offset(box["svg"], step_offset(box, 10, 1, STEPS), 0)
     .click_and_hold()
     .move_to_element_with_offset(box["svg"], step_offset(box, 20, 1, STEPS), 0)
     .release().perform())  # fmt: skip
    zoom = wait_for(lambda: driver.execute_script("return document.body.dataset.runsZoom;"), 10)
    lo, hi = map(float, zoom.split(","))
    assert lo == pytest.approx(10, abs=0.2) and hi == pytest.approx(20, abs=0.2)
    loss = charts(driver)["loss"]
    assert all(s["points"] in (10, 11) for s in loss["series"].values()), loss["series"]
    assert [int(t) for t in loss["xticks"]] == [v for v in range(10, 21, 2) if lo <= v <= hi]
    assert driver.find_element(By.ID, "runs-zoom-reset").is_enabled()
    driver.find_element(By.ID, "runs-zoom-reset").click()
    wait_for(lambda: charts(driver)["loss"]["series"]["r00"]["points"] == STEPS, 10)


def test_a_chart_exports_as_csv_and_png(tracker, tmp_path):
    driver, base = tracker
    open_tracked(driver, base)
    driver.execute_cdp_cmd("Browser.setDownloadBehavior",
                           {"behavior": "allow", "downloadPath": str(tmp_path)})  # fmt: skip
    driver.find_element(By.CSS_SELECTOR, ".runs-chart[data-metric=loss] .runs-csv").click()
    csv = wait_for(lambda: (tmp_path / "unmask-loss.csv").is_file() and
                   (tmp_path / "unmask-loss.csv").read_text(), timeout=20)  # fmt: skip
    rows = csv.splitlines()
    assert rows[0] == "run,step,loss" and len(rows) == 1 + 11 * STEPS + 20
    for index, run in enumerate(TRACKED):
        assert f"{run},7,{tracked_loss(index, 7)}" in rows
    driver.find_element(By.CSS_SELECTOR, ".runs-chart[data-metric=loss] .runs-png").click()
    png = wait_for(lambda: (tmp_path / "unmask-loss.png").is_file() and
                   (tmp_path / "unmask-loss.png").read_bytes(), timeout=20)  # fmt: skip
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert (width, height) == (1000, 568)  # the 500 x 260 chart and its title's band at 2x
    assert len(png) > 20_000  # lines drawn, not a blank image
    driver.save_screenshot(str(tmp_path / "tracked.png"))


def cielab(colour: str) -> tuple[float, float, float]:
    """CIELAB of an sRGB hex colour (D65), from the CIE formulas."""
    rgb = [int(colour[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    r, g, b = [((c + 0.055) / 1.055) ** 2.4 if c > 0.04045 else c / 12.92 for c in rgb]
    x = (0.4124 * r + 0.3576 * g + 0.1805 * b) / 0.95047
    y = 0.2126 * r + 0.7152 * g + 0.0722 * b
    z = (0.0193 * r + 0.1192 * g + 0.9505 * b) / 1.08883
    f = [t ** (1 / 3) if t > 0.008856 else 7.787 * t + 16 / 116 for t in (x, y, z)]
    return 116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])
