"""Every command the README and docs/ show is run, the way a reader would run it.

Each markdown file's fenced blocks run in order in one sandbox folder (a copy of a shared
one), so a block can use what an earlier block of the same file made:

- ```bash blocks run line by line (`\\` continues a line), each line by `bash -e`;
- ```text blocks whose lines start with `$ ` run each command and compare what it prints
  (stdout, then stderr) with the lines under it;
- ```python blocks run as a script.

An HTML comment on the line before a block changes that (`<!-- docs-test: ... -->`, several
directives separated by `;`): `not run: REASON` (the reason is required), `replace "A"
with "B": REASON` (tiny sizes: the sandbox's model saves other checkpoints than the real
quickstart, a 2-core machine starts 2 processes, not 8), `output varies: REASON` (only the
exit code is checked), `alternatives` (each line runs in its own copy of the sandbox, for
blocks listing ways to do one thing), `stop after "TEXT": REASON` (for commands that run until
stopped, a server: each line runs until it prints a line holding TEXT, then gets SIGTERM and
must exit 0). Unlabeled fences are refused, so every block is
either code that runs or says why it does not.

The sandbox holds what the docs name: runs/quickstart (made by the Makefile's own
quickstart recipe, on a tiny model), my_run.yaml and run.yaml (tiny configs), runs/tiny
and runs/tiny-lr1e-2, prompt and pair files, jsonl.zst shards, a parquet file and a
tokenizer folder, and the shipped configs/, recipes/, examples/ and data sample.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from conftest import TINY

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RUNNABLE = {"bash", "text", "python"}
KNOWN = RUNNABLE | {"yaml", "json", "toml"}
#: overrides that turn the Makefile's quickstart into a tiny run (checkpoints at steps 2 and 4)
TINY_QUICKSTART = [
    "model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=2",
    "model.num_attention_heads=2", "model.num_key_value_heads=1",
    "data.synthetic_train_size=512", "data.synthetic_eval_size=16", "train.max_steps=4",
    "train.save_steps=2", "train.logging_steps=2", "train.eval_steps=2",
    "train.per_device_train_batch_size=8", "train.disable_tqdm=true", "eval.max_examples=8",
]  # fmt: skip
TIMEOUT = 240


@dataclass
class Block:
    file: Path
    line: int
    lang: str
    body: str
    directives: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.file.relative_to(REPO)}:{self.line}"


def parse_directives(comment: str) -> dict:
    out: dict = {"replace": []}
    parts: list[str] = []
    for piece in comment.split(";"):  # a reason may hold ";": it continues the directive
        if parts and not re.match(
            r"\s*(replace |not run:|output varies:|alternatives|stop after )", piece
        ):
            parts[-1] += ";" + piece
        else:
            parts.append(piece)
    for part in filter(None, (p.strip() for p in parts)):
        if m := re.fullmatch(r'replace "(.+?)" with "(.*?)": .+', part):
            out["replace"].append((m.group(1), m.group(2)))
        elif m := re.fullmatch(r"(not run|output varies): (.+)", part):
            out[m.group(1)] = m.group(2)
        elif m := re.fullmatch(r'stop after "(.+?)": .+', part):
            out["stop after"] = m.group(1)
        elif part == "alternatives":
            out["alternatives"] = True
        else:
            raise ValueError(f"unknown docs-test directive {part!r}")
    return out


def blocks_of(path: Path) -> list[Block]:
    lines = path.read_text().split("\n")
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^```(\S*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        end = i + 1
        while not lines[end].startswith("```"):
            end += 1
        prev = lines[i - 1].strip() if i else ""
        c = re.fullmatch(r"<!-- docs-test: (.*) -->", prev)
        directives = parse_directives(c.group(1)) if c else {"replace": []}
        out.append(Block(path, i + 1, m.group(1), "\n".join(lines[i + 1 : end]), directives))
        i = end + 1
    return out


def runnable(block: Block) -> bool:
    if block.lang == "text":
        return any(line.startswith("$ ") for line in block.body.split("\n"))
    return block.lang in RUNNABLE


def test_every_fence_is_labeled_and_every_directive_parses():
    for path in DOCS:
        for block in blocks_of(path):
            assert block.lang, f"{block.name}: label the fence (```bash, ```text, ...)"
            assert block.lang in KNOWN, f"{block.name}: unknown fence label {block.lang!r}"
            if "not run" in block.directives:
                assert runnable(block), f"{block.name}: 'not run' on a block that never runs"


def test_every_relative_link_resolves():
    link = re.compile(r"\]\(([^)\s]+)\)")
    files = DOCS + sorted((REPO / "benchmarks" / "results").glob("*.md"))
    for path in files:
        for target in link.findall(path.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            where = (path.parent / target.split("#")[0]).resolve()
            assert where.exists(), f"{path.relative_to(REPO)}: link {target} does not resolve"


# --- the sandbox --------------------------------------------------------------------------


def environment() -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env.pop("COLUMNS", None)
    return env


def sh(command: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["bash", "-e", "-c", command], cwd=cwd, env=environment(),
                          capture_output=True, text=True, timeout=TIMEOUT)  # fmt: skip
    if check and done.returncode != 0:
        raise AssertionError(f"{command!r} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done


def run_until(command: str, cwd: Path, text: str) -> None:
    """Run a command that runs until stopped (a server): once a line it prints holds `text`,
    SIGTERM its process group; it must then exit 0 (killed after TIMEOUT s if it never does)."""
    proc = subprocess.Popen(["bash", "-e", "-c", command], cwd=cwd, env=environment(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    overdue = threading.Timer(TIMEOUT, os.killpg, (proc.pid, signal.SIGKILL))
    overdue.start()
    printed: list[str] = []
    try:
        for line in proc.stdout:
            printed.append(line)
            if text in line:
                os.killpg(proc.pid, signal.SIGTERM)
                break
        printed.append(proc.communicate()[0])
    finally:
        overdue.cancel()
    out = "".join(printed)
    assert text in out, f"{command!r} never printed {text!r}:\n{out}"
    assert proc.returncode == 0, f"{command!r} exited {proc.returncode} after SIGTERM:\n{out}"


def makefile_recipe(target: str) -> list[str]:
    """The commands of one Makefile target, with $(BIN)/ dropped (the venv's bin is on PATH)."""
    lines = (REPO / "Makefile").read_text().split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{target}:"))
    recipe = []
    for line in lines[start + 1 :]:
        if not line.startswith("\t"):
            break
        recipe.append(line.strip().replace("$(BIN)/", ""))
    return recipe


def build_sandbox(root: Path) -> None:
    (root / "my_run.yaml").write_text(yaml.safe_dump(TINY))
    (root / "run.yaml").write_text(yaml.safe_dump(TINY))
    # runs/quickstart by the Makefile's recipe, on the tiny model
    for command in makefile_recipe("quickstart"):
        if command.startswith("unmask train"):
            command += " " + " ".join(TINY_QUICKSTART)
        sh(command, root)
    sh("unmask train my_run.yaml train.output_dir=runs/tiny", root)
    sh("unmask train my_run.yaml train.output_dir=runs/tiny-lr1e-2 optim.learning_rate=1e-2", root)
    prompts = ["rev 90417=", "sort 5213=", "add 11+22="]
    for name in ["in.jsonl", "prompts.jsonl"]:
        (root / name).write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    pairs = [("rev 123=", "321"), ("sort 312=", "123")]
    (root / "qa.jsonl").write_text(
        "".join(json.dumps({"prompt": p, "response": r}) + "\n" for p, r in pairs)
    )
    (root / "qa.txt").write_text("".join(f"{p}{r}\n" for p, r in pairs))
    (root / "held_out.txt").write_text("rev 123=321\nsort 312=123\nadd 12+30=42\n")
    # preprocessing inputs (docs/data.md)
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    (root / "shards").mkdir()
    for k in range(2):
        text = "".join(json.dumps({"text": f"shard {k} document {i}"}) + "\n" for i in range(200))
        (root / "shards" / f"part-{k}.jsonl.zst").write_bytes(zstandard.compress(text.encode()))
    pq.write_table(pa.table({"text": [f"extra {i}" for i in range(10)]}), root / "extra.parquet")
    (root / "my_tokenizer").mkdir()
    for file in (root / "runs" / "quickstart" / "final").glob("*token*"):
        shutil.copy(file, root / "my_tokenizer")
    (root / "data").mkdir()
    # the shipped files the docs name, as in a clone
    (root / "configs").symlink_to(REPO / "configs")
    (root / "recipes").symlink_to(REPO / "recipes")
    (root / "examples").symlink_to(REPO / "examples")
    (root / "data" / "fineweb_edu_sample").symlink_to(REPO / "data" / "fineweb_edu_sample")


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("docs-sandbox")
    build_sandbox(root)
    return root


# --- running blocks -----------------------------------------------------------------------


def applied(block: Block, text: str) -> str:
    for old, new in block.directives["replace"]:
        assert old in text, f"{block.name}: replace {old!r}: not in the block"
        text = text.replace(old, new)
    return text


def shell_lines(body: str) -> list[str]:
    """Commands of a bash block, continuation lines joined."""
    out, current = [], ""
    for line in body.split("\n"):
        current += line
        if current.endswith("\\"):
            current = current[:-1]
            continue
        if current.strip():
            out.append(current)
        current = ""
    return out


def run_block(block: Block, cwd: Path) -> None:
    if block.lang == "bash":
        body = applied(block, block.body)
        if block.directives.get("alternatives"):
            for k, command in enumerate(shell_lines(body)):
                copy = cwd.parent / f"{cwd.name}-alt{block.line}-{k}"
                shutil.copytree(cwd, copy, symlinks=True)
                sh(command, copy)
        else:
            for command in shell_lines(body):
                started = time.perf_counter()
                if "stop after" in block.directives:
                    run_until(command, cwd, block.directives["stop after"])
                else:
                    sh(command, cwd)
                print(f"{block.name}: {time.perf_counter() - started:5.1f}s  {command.strip()}")
    elif block.lang == "python":
        script = cwd / f"block_{block.line}.py"
        script.write_text(applied(block, block.body))
        done = subprocess.run([sys.executable, script.name], cwd=cwd, env=environment(),
                              capture_output=True, text=True, timeout=TIMEOUT)  # fmt: skip
        assert done.returncode == 0, f"{block.name}:\n{done.stdout}\n{done.stderr}"
    else:  # text with `$ ` commands
        command, expected = None, []
        for line in [*block.body.split("\n"), "$ "]:
            if line.startswith("$ "):
                if command:
                    check_output(block, command, expected, cwd)
                command, expected = line[2:], []
            else:
                expected.append(line)


def check_output(block: Block, command: str, expected: list[str], cwd: Path) -> None:
    done = sh(applied(block, command), cwd, check=False)
    got = (done.stdout + done.stderr).rstrip("\n").split("\n")
    if "output varies" in block.directives:
        assert done.returncode == 0, f"{block.name}: {command!r}:\n{done.stdout}\n{done.stderr}"
        return
    want = [applied(block, line) for line in expected]
    assert got == want, f"{block.name}: {command!r} printed\n" + "\n".join(got)


def doc_cases():
    for path in DOCS:
        blocks = [b for b in blocks_of(path) if runnable(b)]
        if blocks:
            yield pytest.param(path, blocks, id=str(path.relative_to(REPO)))


@pytest.mark.parametrize(("path", "blocks"), list(doc_cases()))
def test_the_commands_of(path, blocks, sandbox, tmp_path):
    cwd = tmp_path / "sandbox"
    shutil.copytree(sandbox, cwd, symlinks=True)
    for block in blocks:
        if "not run" in block.directives:
            continue
        run_block(block, cwd)


def test_every_command_block_runs_or_says_why():
    skipped = [
        (b.name, b.directives["not run"])
        for path in DOCS
        for b in blocks_of(path)
        if runnable(b) and "not run" in b.directives
    ]
    for name, reason in skipped:
        assert len(reason.split()) >= 3, f"{name}: say why the block does not run here"
    # each names the test that runs it instead (SLURM, hub downloads, 4-process launches)
    assert len(skipped) <= 8, skipped
