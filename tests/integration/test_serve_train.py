"""Training runs started from `unmask serve --allow-train` (docs/serving.md, Training from the
page): a real server on 127.0.0.1 (a subprocess) with a runs folder, its jobs real `unmask
train` subprocesses of a tiny model. A job trains, its log is read on by offset while it
grows, Stop (SIGTERM) leaves a checkpoint a resume finds, a second job waits for the first,
bad or unsafe configs are a 400 that writes nothing, a taken name a 409; without
--allow-train every training route is a 403, and --allow-train beyond this machine without a
key is refused at start. The page's Train tab does the same in headless Chromium, and the
server's own SIGTERM stops the running job with a checkpoint."""

import json
import re
import shutil
import signal
import time
from pathlib import Path

import httpx
import pytest
import yaml
from conftest import TINY, deep_update, save_tiny_model
from test_serve import start_server
from test_serve_security import serve_command

from unmask.checkpoint import resolve_resume
from unmask.serve.training import JOBS_FILE, TrainQueue

pytestmark = pytest.mark.usefixtures("one_thread")

KEY = "train-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
#: a run that never ends by itself (a stop lands mid-run) and checkpoints only when stopped
LONG = deep_update(TINY, {"train": {"max_steps": 100000, "save_steps": 100000,
                                    "eval_steps": 100000, "logging_steps": 10}})  # fmt: skip
SHORT = deep_update(TINY, {"train": {"max_steps": 2, "save_steps": 2, "eval_steps": 2}})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("train") / "model", seed=0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The runs folder: one config to pick (tiny.yaml, the long run) and one finished-looking
    run a job must never replace."""
    root = tmp_path_factory.mktemp("runs")
    (root / "tiny.yaml").write_text(yaml.safe_dump(LONG))
    (root / "taken").mkdir()
    (root / "taken" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    return root


@pytest.fixture(scope="module")
def served(model_dir, runs):
    proc, base = start_server(model_dir, "--runs", str(runs), "--allow-train", "--api-key", KEY)
    yield proc, base
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(180)


@pytest.fixture(scope="module")
def server(served):
    return served[1]


def post(base: str, route: str, body: dict | None = None, key: bool = True) -> httpx.Response:
    return httpx.post(base + route, json=body or {}, headers=AUTH if key else {}, timeout=60)


def get(base: str, route: str) -> httpx.Response:
    return httpx.get(base + route, headers=AUTH, timeout=60)


def job_state(base: str, job_id: str) -> dict:
    jobs = {job["id"]: job for job in get(base, "/api/train").json()["jobs"]}
    return jobs[job_id]


def wait_for(condition, timeout: float = 120.0, every: float = 0.2):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every)
    raise AssertionError("timed out")


def one_line_error(response: httpx.Response, status: int, pattern: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "\n" not in error["message"] and re.search(pattern, error["message"]), error
    return error["message"]


def checkpoint_steps(folder: Path) -> list[int]:
    return [int(p.name.split("-")[1]) for p in folder.glob("checkpoint-*") if p.is_dir()]


# ------------------------------------------------------------------------- refusals


def test_bad_or_unsafe_configs_are_a_400_and_write_nothing(server, runs):
    before = sorted(p.name for p in runs.iterdir())
    cases = [
        ({"config_text": "model: [1, 2"}, "the config is not valid YAML at line"),
        ({"config_text": "model: {hidden_sise: 32}"},
         r"unknown config key 'model.hidden_sise' \(did you mean 'model.hidden_size'\?\)"),
        ({"config_text": yaml.safe_dump(deep_update(TINY, {"optim": {"learning_rate": "x"}}))},
         "optim.learning_rate"),
        ({"config_text": ""}, "the config is empty"),
        # code the run would import, or what reaches beyond the runs folder and this machine
        ({"config_text": "eval: {sampling: {logits_hook: 'os:system'}}"},
         "eval.sampling.logits_hook names code to import"),
        ({"config_text": "rewards: [{fn: 'my_rewards:score'}]"}, "is a user function"),
        ({"config_text": "rewards: [{fn: exact_match, network: true}]"}, r"rewards\[0\].network"),
        ({"config_text": "data: {dataset: /etc/hostname}"},
         "data.dataset '/etc/hostname' is outside the runs folder"),
        ({"config_text": "model: {pretrained: ../../model}"}, "model.pretrained .* outside"),
        ({"config_text": "data: {image_folder: /home}"},
         "data.image_folder '/home' is outside the runs folder"),
        ({"config_text": "train: {report_to: wandb}"}, "train.report_to 'wandb'"),
        ({"config_text": "x: 1", "overrides": ["eval.sampling.tokens_hook=os:system"]},
         "eval.sampling.tokens_hook names code"),
        ({"config_text": "x: 1", "name": "../escape"}, "run name '../escape' is not a folder name"),
        ({"config_name": "tiny.yaml", "config_text": "x: 1"}, "either config_text"),
    ]  # fmt: skip
    for body, pattern in cases:
        body = {"name": "bad", **body}
        one_line_error(post(server, "/api/train", body), 400, pattern)
    one_line_error(post(server, "/api/train", {"name": "bad", "config_name": "../tiny.yaml"}),
                   404, "no config '../tiny.yaml' to pick")  # fmt: skip
    one_line_error(post(server, "/api/train", {"name": "bad", "config_text": "x"}, key=False),
                   401, "API key")  # fmt: skip
    # a name that holds a run (or anything) is never replaced
    one_line_error(post(server, "/api/train", {"name": "taken", "config_name": "tiny.yaml"}),
                   409, "holds 'taken' already")  # fmt: skip
    assert sorted(p.name for p in runs.iterdir()) == before
    assert get(server, "/api/train").json()["jobs"] == []


def test_without_allow_train_every_training_route_is_a_403(model_dir, tmp_path):
    proc, base = start_server(model_dir, "--runs", str(tmp_path))
    try:
        assert httpx.get(base + "/api/info").json()["train"] is False
        for method, route in (("GET", "/api/train"), ("POST", "/api/train"),
                              ("GET", "/api/train/configs/quickstart"),
                              ("POST", "/api/train/1/stop"), ("GET", "/api/train/1/log")):  # fmt: skip
            body = {"name": "run", "config_name": "quickstart"} if method == "POST" else None
            response = httpx.request(method, base + route, json=body, timeout=60)
            one_line_error(response, 403, "start the server with --allow-train")
        assert list(tmp_path.iterdir()) == []
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


def test_allow_train_beyond_this_machine_needs_a_key(model_dir, tmp_path):
    exposed = serve_command(model_dir, "--host", "0.0.0.0", "--port", "0", "--allow-no-key",
                            "--allow-train", "--runs", str(tmp_path))  # fmt: skip
    assert exposed.returncode == 2
    assert exposed.stderr.strip().startswith("unmask: error: --allow-train on --host 0.0.0.0 "
                                             "needs --api-key KEY")  # fmt: skip
    assert len(exposed.stderr.strip().splitlines()) == 1 and "serving" not in exposed.stderr
    no_runs = serve_command(model_dir, "--allow-train")
    assert no_runs.returncode == 2 and "--allow-train needs --runs DIR" in no_runs.stderr


# --------------------------------------------------------------------------- runs


def test_a_run_trains_streams_its_log_and_stops_with_a_checkpoint(server, runs):
    listing = get(server, "/api/train").json()
    # the quickstart, the runs folder's YAML files, the repository's recipes
    recipes = sorted(p.name for p in (Path(__file__).parents[2] / "recipes").glob("*.yaml"))
    assert recipes and listing["configs"] == ["quickstart", "tiny.yaml",
                                              *(f"recipes/{name}" for name in recipes)]  # fmt: skip
    recipe = get(server, f"/api/train/configs/recipes/{recipes[0]}")
    assert recipe.status_code == 200 and "model:" in recipe.json()["text"]
    text = get(server, "/api/train/configs/tiny.yaml").json()["text"]
    assert yaml.safe_load(text) == LONG
    first = post(server, "/api/train", {"name": "long", "config_name": "tiny.yaml"})
    assert first.status_code == 201, first.text
    long_id = first.json()["id"]
    second = post(server, "/api/train", {"name": "short", "config_text": yaml.safe_dump(SHORT),
                                         "overrides": ["train.logging_steps=1"]})  # fmt: skip
    assert second.status_code == 201, second.text
    short_id = second.json()["id"]
    third = post(server, "/api/train", {"name": "never", "config_name": "quickstart"})
    assert third.status_code == 201
    one_line_error(post(server, "/api/train", {"name": "long", "config_name": "tiny.yaml"}),
                   409, "holds 'long' already")  # fmt: skip
    job = runs / "long"
    written = yaml.safe_load((job / "job.yaml").read_text())
    assert written["train"]["output_dir"] == str(job) and written["train"]["max_steps"] == 100000
    # a queued job is cancelled (its folder holds its config only)
    assert post(server, f"/api/train/{third.json()['id']}/stop").json()["state"] == "cancelled"

    # the log, read on from each offset, grows while the run trains
    log, offset, reads = "", 0, []

    def read() -> bool:
        nonlocal log, offset
        data = get(server, f"/api/train/{long_id}/log?offset={offset}").json()
        assert data["offset"] == offset + len(data["text"].encode())
        log, offset = log + data["text"], data["offset"]
        steps = re.findall(r"^step (\d+)/100000", log, re.M)
        if data["text"]:
            reads.append(len(steps))
        return len({n for n in reads if n}) >= 2  # two reads that brought more steps

    wait_for(read, timeout=180)
    assert log.startswith("unmask serve: job ")
    assert job_state(server, long_id)["state"] == "running"
    assert job_state(server, short_id)["state"] == "queued"  # one run at a time
    assert get(server, "/api/runs/long").status_code == 200  # the Runs tab shows it too

    stopped = post(server, f"/api/train/{long_id}/stop")
    assert stopped.status_code == 200 and stopped.json()["stopping"] is True
    done = wait_for(lambda: job_state(server, long_id)["state"] == "stopped" and
                    job_state(server, long_id), timeout=120)  # fmt: skip
    assert done["exit_code"] == 0  # SIGTERM: a clean stop
    (step,) = checkpoint_steps(job)
    assert step > 0
    assert resolve_resume(job, True) == job / f"checkpoint-{step}"  # a resume finds it
    whole = (job / "train.log").read_text()
    assert f"stopped by SIGTERM at step {step}; checkpoint-{step} is saved" in whole
    one_line_error(post(server, f"/api/train/{long_id}/stop"), 409, "has ended")

    # the queued job runs next, to its end
    short = wait_for(lambda: job_state(server, short_id)["state"] in ("finished", "failed") and
                     job_state(server, short_id), timeout=180)  # fmt: skip
    assert short["state"] == "finished" and short["exit_code"] == 0, (
        runs / "short" / "train.log").read_text()  # fmt: skip
    assert (runs / "short" / "final").is_dir()
    assert not (runs / "never").exists() or not checkpoint_steps(runs / "never")


# ------------------------------------------------------------------------ the page

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM and CHROMEDRIVER):  # CI installs both: apt-get install chromium
        pytest.skip("needs the system's chromium and chromedriver")
    webdriver = pytest.importorskip("selenium.webdriver")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1200,900",
                 "--disable-dev-shm-usage"):  # fmt: skip
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options,
                              service=webdriver.ChromeService(executable_path=CHROMEDRIVER))  # fmt: skip
    yield driver
    driver.quit()


def test_the_train_tab_starts_a_run_shows_its_log_and_stops_it(server, runs, browser, tmp_path):
    """A picked config (tiny.yaml) is listed by its name; one Stop button; the curve's axes
    have ticks at 1, 2 or 5 times a power of ten; the page asks for the run's curve only
    once it has logged a step (no 404 while the run starts)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    driver = browser
    driver.get(server + "/")
    driver.execute_script("localStorage.setItem('unmask-key', arguments[0])", KEY)
    driver.get(server + "/#train")
    driver.refresh()  # the key is read as the page loads (a new hash alone loads nothing)
    driver.get_log("browser")  # what came before is not this test's
    element = lambda id_: driver.find_element(By.ID, id_)  # noqa: E731
    wait_for(lambda: element("tab-train").is_displayed(), timeout=30)
    element("tab-train").click()
    wait_for(lambda: "tiny.yaml" in [o.get_attribute("value") for o in
                                     element("train-pick").find_elements(By.TAG_NAME, "option")], 30)  # fmt: skip
    options = [
        o.get_attribute("value") for o in element("train-pick").find_elements(By.TAG_NAME, "option")
    ]
    assert "recipes/moe_quickstart.yaml" in options  # recipes/ offered
    # an uploaded file fills the editor and names the run
    upload = tmp_path / "page-run.yaml"
    upload.write_text(yaml.safe_dump(LONG))
    element("train-file").send_keys(str(upload))
    wait_for(lambda: "max_steps: 100000" in element("train-text").get_attribute("value"), 10)
    assert element("train-name").get_attribute("value") == "page-run"
    # a picked config, unedited, starts under its own name
    Select(element("train-pick")).select_by_value("tiny.yaml")
    wait_for(lambda: element("train-text").get_attribute("value") ==
             get(server, "/api/train/configs/tiny.yaml").json()["text"], 10)  # fmt: skip
    element("train-start").click()
    wait_for(lambda: element("train-view").get_attribute("data-state") == "running", 60)
    # the job table read in one script: it is redrawn as jobs update (no stale elements)
    cells = wait_for(lambda: [row for row in driver.execute_script(
        "return [...document.querySelectorAll('#train-jobs tbody tr')]"
        ".map((r) => [...r.querySelectorAll('td')].map((td) => td.innerText.trim()));")
        if len(row) > 2 and row[1] == "page-run"], 30)[0]  # fmt: skip
    assert cells[2] == "tiny.yaml"
    assert [job["source"] for job in get(server, "/api/train").json()["jobs"]
            if job["name"] == "page-run"] == ["tiny.yaml"]  # fmt: skip
    # one Stop button: the selected job's
    stops = [b for b in driver.find_elements(By.CSS_SELECTOR, "#train button")
             if b.text.lower() in ("stop", "cancel")]  # fmt: skip
    assert [b.get_attribute("id") for b in stops] == ["train-stop"]
    # the live log
    log = wait_for(lambda: re.search(r"^step \d+/100000", element("train-log").get_attribute("textContent"), re.M)
                   and element("train-log").get_attribute("textContent"), timeout=180)  # fmt: skip
    assert log.startswith("unmask serve: job ")
    wait_for(lambda: element("train-curve").find_elements(By.CSS_SELECTOR, "polyline.loss"), 30)
    ticks = [t.text for t in element("train-curve").find_elements(By.CSS_SELECTOR, ".train-ytick")]
    assert len(ticks) >= 3, ticks
    for tick in ticks:  # 1, 2 or 5 times a power of ten, times a whole number
        value = float(tick)
        assert any(abs(value / unit - round(value / unit)) < 1e-6 for unit in
                   (10.0**k * m for k in range(-4, 3) for m in (1, 2, 5))), tick  # fmt: skip
    gaps = {round(float(b) - float(a), 9) for a, b in zip(ticks, ticks[1:])}
    assert len(gaps) == 1, ticks  # evenly spaced
    driver.save_screenshot(str(tmp_path / "train-running.png"))
    element("train-stop").click()
    wait_for(lambda: element("train-view").get_attribute("data-state") == "stopped", 120)
    assert "stopped" in element("train-selected").text
    wait_for(lambda: "stopped by SIGTERM" in element("train-log").get_attribute("textContent"), 30)
    assert [s for s in checkpoint_steps(runs / "page-run") if s > 0]
    driver.save_screenshot(str(tmp_path / "train-stopped.png"))
    # no 404 while the run started (the curve asked for before the run had logged a step)
    storm = [e["message"] for e in driver.get_log("browser")
             if "404" in e["message"] and "/api/runs/" in e["message"]]  # fmt: skip
    assert storm == []


# ----------------------------------------------------------------- server shutdown


def jobs_file(runs: Path) -> dict[str, dict]:
    return {job["name"]: job for job in json.loads((runs / JOBS_FILE).read_text())["jobs"]}


def test_the_servers_sigterm_stops_the_running_job_with_a_checkpoint(served, runs):
    """The server's SIGTERM: the running job checkpoints and stops; a queued one stays
    queued in the runs folder's job list for the next server."""
    proc, base = served
    job = post(base, "/api/train", {"name": "last", "config_name": "tiny.yaml"}).json()
    queued = post(base, "/api/train", {"name": "after", "config_name": "tiny.yaml"})
    assert queued.status_code == 201
    wait_for(lambda: re.search(r"^step \d+/", get(base, f"/api/train/{job['id']}/log")
                               .json()["text"], re.M), timeout=180)  # fmt: skip
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(150) == 0
    output = proc.stdout.read()
    assert "stopping training run 'last'" in output
    (step,) = checkpoint_steps(runs / "last")
    assert step > 0
    assert "stopped by SIGTERM" in (runs / "last" / "train.log").read_text()
    kept = jobs_file(runs)
    assert kept["last"]["state"] == "stopped" and kept["after"]["state"] == "queued"


def test_a_restarted_server_lists_its_jobs_and_can_stop_them(model_dir, runs, browser):
    """A new server of the runs folder lists every job of the one before (the page too),
    runs the queued one and stops it; SIGKILLed, it takes its running job with it: the job
    gets SIGTERM (it checkpoints) and exits, and the next queue marks it stopped."""
    from selenium.webdriver.common.by import By

    before = jobs_file(runs)
    proc, base = start_server(model_dir, "--runs", str(runs), "--allow-train", "--api-key", KEY)
    try:
        listed = {job["name"]: job for job in get(base, "/api/train").json()["jobs"]}
        assert set(listed) == set(before)
        assert {name: job["id"] for name, job in listed.items()} == {
            name: job["id"] for name, job in before.items()}  # fmt: skip
        assert listed["last"]["state"] == "stopped" and listed["long"]["state"] == "stopped"
        assert listed["page-run"]["source"] == "tiny.yaml"
        after = listed["after"]["id"]
        wait_for(lambda: job_state(base, after)["state"] == "running", 60)
        # the page lists them, and its one Stop stops the queued job now running
        driver = browser
        driver.get(base + "/")
        driver.execute_script("localStorage.setItem('unmask-key', arguments[0])", KEY)
        driver.get(base + "/#train")
        driver.refresh()

        def rows() -> dict[str, list[str]]:
            # read in one script: the table is redrawn as jobs update (no stale elements)
            return driver.execute_script(
                "const out = {};"
                "for (const r of document.querySelectorAll('#train-jobs tbody tr'))"
                "  out[r.dataset.job] = [...r.querySelectorAll('td')].map((td) => td.innerText.trim());"
                "return out;"
            )  # fmt: skip

        wait_for(lambda: len(rows()) == len(before), 30)
        assert rows()[after][1:4] == ["after", "tiny.yaml", "running"]
        driver.execute_script("document.querySelector(arguments[0]).click()",
                              f'#train-jobs tr[data-job="{after}"]')  # fmt: skip
        wait_for(
            lambda: driver.find_element(By.ID, "train-view").get_attribute("data-job") == after, 10
        )
        wait_for(
            lambda: re.search(
                r"^step \d+/", get(base, f"/api/train/{after}/log").json()["text"], re.M
            ),
            180,
        )
        driver.find_element(By.ID, "train-stop").click()
        wait_for(lambda: job_state(base, after)["state"] == "stopped", 120)
        # SIGKILL: the running job ends too (no server left to stop it)
        orphan = post(base, "/api/train", {"name": "orphan", "config_name": "tiny.yaml"}).json()
        wait_for(lambda: re.search(r"^step \d+/", get(base, f"/api/train/{orphan['id']}/log")
                                   .json()["text"], re.M), timeout=180)  # fmt: skip
        pid = jobs_file(runs)["orphan"]["pid"]
        assert pid and Path(f"/proc/{pid}").exists()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    wait_for(lambda: not _alive(pid), timeout=120)
    assert "stopped by SIGTERM" in (runs / "orphan" / "train.log").read_text()
    queue = TrainQueue(runs)  # the next server's queue
    try:
        states = {job["name"]: job["state"] for job in queue.jobs()}
        assert states["orphan"] == "stopped" and states["after"] == "stopped"
    finally:
        queue.close(10)


def _alive(pid: int) -> bool:
    """The process exists and has not exited (a zombie has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"
