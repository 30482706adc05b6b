"""The page of `unmask serve` in a real headless Chromium (the system's chromium and
chromedriver, driven by Selenium): the playground draws the canvas filling in step by step,
the runs view lists a finished run (trained here) and a running one (its metrics.jsonl
growing while the page is open) with their loss curves. Screenshots go to the test's
temporary folder."""

import json
import shutil
import signal
import time

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
    metric keys are HTML."""
    configs, root = tmp_path_factory.mktemp("configs"), tmp_path_factory.mktemp("runs")
    config = write_run_config(configs, "tiny", {}, {})
    train_in_process(config, root / "finished")
    running = root / "running"
    running.mkdir()
    tree = yaml.safe_load((root / "finished" / "config.yaml").read_text())
    tree["train"] = {**tree["train"], "max_steps": 100, "output_dir": str(running)}
    (running / "config.yaml").write_text(yaml.safe_dump(tree))
    hostile = root / HOSTILE
    hostile.mkdir()
    records = [{"step": 1, "loss": 2.0}, {"step": 2, "eval_loss": 1.5, HOSTILE: 1},
               {"step": 3, "loss": 1.0, "<script>window.pwned=2</script>": "<b>x</b>"}]  # fmt: skip
    (hostile / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
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


@pytest.fixture(scope="module")
def page(runs_dir):
    proc, base = start_server(runs_dir / "finished" / "final", "--runs", str(runs_dir))
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1200,800",
                 "--disable-dev-shm-usage"):  # fmt: skip
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options,
                              service=webdriver.ChromeService(executable_path=CHROMEDRIVER))  # fmt: skip
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
    for field, value in (("max_tokens", "12"), ("block_length", "4"), ("delay", "250")):
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


def test_runs_view_lists_runs_and_draws_their_curves(page, runs_dir, tmp_path):
    driver, base = page
    append_metrics(runs_dir / "running", range(1, 11))  # written just now: running
    driver.get(base + "/")
    driver.find_element(By.ID, "tab-runs").click()
    wait_for(lambda: len(table(driver)) == 3)
    rows = table(driver)
    assert rows["finished"][1] == "finished" and rows["finished"][2] == "6/6"
    assert rows["running"][1] == "running" and rows["running"][2] == "10/100"
    assert rows["running"][4] == f"{4.2 / 10**0.5:.4f}"  # eval loss at step 10
    assert rows["running"][6] == "45s"  # 0.5 s a step, 90 steps left
    assert curve_points(driver) == {"finished": 6, "running": 10, HOSTILE: 2}
    driver.save_screenshot(str(tmp_path / "runs.png"))
    append_metrics(runs_dir / "running", range(11, 21))  # the run goes on: the page follows
    wait_for(lambda: table(driver)["running"][2] == "20/100", timeout=20)
    assert curve_points(driver) == {"finished": 6, "running": 20, HOSTILE: 2}


def test_a_hostile_run_name_and_metric_keys_render_as_text_and_run_nothing(page, tmp_path):
    """The folder named HOSTILE (and its HTML metric keys and values): its name is the
    text of its table cell and its chart's title; no element was made of it, no script ran
    (an onerror handler would set window.pwned), the page's own script still works."""
    driver, base = page
    driver.get(base + "/#runs")
    wait_for(lambda: HOSTILE in table(driver))
    assert table(driver)[HOSTILE][0] == HOSTILE
    titles = driver.execute_script(
        "return [...document.querySelectorAll('.plot h3')].map((h) => h.textContent);"
    )
    assert HOSTILE in titles
    time.sleep(0.5)  # an injected image would have failed to load and fired by now
    assert driver.execute_script("return window.pwned === undefined;")
    assert driver.find_elements(By.CSS_SELECTOR, "img, script:not([src])") == []
    driver.save_screenshot(str(tmp_path / "hostile.png"))


def table(driver) -> dict[str, list[str]]:
    """The runs table's cells by run, read in one script (the page swaps rows in whole)."""
    return driver.execute_script(
        "const out = {};"
        "for (const tr of document.querySelectorAll('#runs-table tbody tr'))"
        "  out[tr.dataset.run] = [...tr.children].map((td) => td.textContent);"
        "return out;"
    )


def curve_points(driver) -> dict[str, int]:
    """Points of each run's drawn loss curve."""
    return driver.execute_script(
        "const out = {};"
        "for (const plot of document.querySelectorAll('.plot'))"
        "  out[plot.dataset.run] = plot.querySelector('polyline.loss')"
        "    .getAttribute('points').split(' ').length;"
        "return out;"
    )
