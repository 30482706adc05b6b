"""The wheels a GPU machine with no package index installs before `gpu.py --profile`, and
their check on a CPU.

`GPU_WHEELS`: what unmask's profile needs that the lent GPU image (Python 3.12, torch 2.11,
transformers, tokenizers, safetensors, numpy, pyarrow, pandas and the usual scientific
stack) lacks or holds too old: pydantic 2.14 needs typing-extensions >= 4.16; openai 3.57
imports httpx2, which needs httpcore2, truststore, anyio >= 4.10, idna >= 3.18 and
h11 >= 0.16. They are installed with `--no-deps` there, so the list has to be closed under
its own needs: `check` proves it is.

`check DIR` (`python benchmarks/gpu.py --check-wheels DIR`, network needed for the
downloads): downloads GPU_WHEELS (no dependencies) into DIR for the image, and again, the
same versions, for this interpreter (the environment it builds runs here), with, for the
image's side, `IMAGE` (the image's own packages, at its versions where they are known,
with their dependencies; a version not made for this interpreter, such as numpy 2.5 on
Python 3.11, is replaced by the newest that is); builds a fresh virtual environment that holds only this machine's torch (linked
in with its own dependencies, as the image holds torch), installs everything from DIR with
`pip install --no-index` (the resolver sees every requirement met or fails), runs
`pip check`, imports every module the profile's phases import, and runs
`gpu.py --profile --dry` from it. It prints each step and ends on one line: ok or the
failure. Not part of CI (it downloads about 150 MB).
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

#: name==version for CPython 3.12 on x86-64 Linux
GPU_WHEELS = ["pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0",
              "typing-inspection==0.4.5", "typing-extensions==4.16.0", "datasets==5.2.0",
              "dill==0.4.1", "multiprocess==0.70.19", "torchdata==0.11.0", "zstandard==0.25.0",
              "starlette==1.10.0", "uvicorn==0.54.0", "openai==3.57.0", "httpx2==2.16.2",
              "httpcore2==2.16.2", "truststore==0.10.5", "anyio==4.16.0", "idna==3.20",
              "h11==0.16.0", "distro==1.9.0", "jiter==0.19.0", "sniffio==1.3.1",
              "torchao==0.18.0"]  # fmt: skip
#: the image's packages the profile uses (versions as read on a machine running it; the
#: others unpinned), installed beside GPU_WHEELS by `check` to stand for the image
IMAGE = ["transformers==5.17.0", "tokenizers==0.23.2", "safetensors==0.8.0",
         "huggingface-hub==1.33.0", "numpy==2.5.2", "pyyaml", "tqdm", "tensorboard",
         "pyarrow", "pandas", "xxhash", "requests", "httpx", "pytest", "pytest-xdist"]  # fmt: skip
#: what the phases import, beyond unmask (the check imports each)
IMPORTS = ["pydantic", "yaml", "transformers", "tokenizers", "safetensors", "datasets",
           "torchdata", "zstandard", "starlette", "uvicorn", "openai", "httpx", "torchao",
           "tensorboard", "pytest", "unmask.train.trainer", "unmask.serve", "unmask.sampling",
           "unmask.plan.checkpointing", "unmask.models.quant", "unmask.models.float8",
           "unmask.train.audit"]  # fmt: skip
#: torch and what it needs, linked into the fresh environment as the image holds them
TORCH = ["torch", "filelock", "fsspec", "jinja2", "markupsafe", "networkx", "sympy", "mpmath",
         "setuptools"]  # fmt: skip
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]  # fmt: skip


def _download(folder: Path, specs: list[str], deps: bool, here: bool = False) -> int:
    """pip download of specs into folder: for the GPU image (CPython 3.12, x86-64 Linux),
    or with `here` for this interpreter and machine (the check's environment)."""
    platforms = [a for tag in PLATFORMS for a in ("--platform", tag)]
    target = [] if here else ["--python-version", "3.12", "--implementation", "cp", *platforms]
    command = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", *target,
               "-d", str(folder), *([] if deps else ["--no-deps"]), *specs]  # fmt: skip
    return subprocess.run(command).returncode


def download(folder: Path) -> int:
    """GPU_WHEELS into folder (one pip call per wheel: a failure names its wheel)."""
    folder.mkdir(parents=True, exist_ok=True)
    for spec in GPU_WHEELS:
        if _download(folder, [spec], deps=False) != 0:
            print(f"gpu.py --wheels: {spec} could not be downloaded", file=sys.stderr)
            return 1
    print(f"gpu.py --wheels: {len(GPU_WHEELS)} wheels in {folder}")
    return 0


def _link_torch(site: Path) -> None:
    """This interpreter's torch and its dependencies (their files, dist-info included)
    into `site` as symbolic links: the fresh environment sees an installed torch."""
    for name in TORCH:
        dist = metadata.distribution(name)
        roots = {Path(str(f)).parts[0] for f in dist.files or []}
        base = Path(dist.locate_file(""))
        for root in roots:
            if root.endswith(".pth") or root in ("..", "bin"):
                continue
            target, link = base / root, site / root
            if target.exists() and not link.exists():
                link.symlink_to(target)


def _run(step: str, command: list[str]) -> bool:
    print(f"gpu.py --check-wheels: {step}: {' '.join(command)[:300]}", flush=True)
    # unmask from the checkout, not installed: as on the GPU machine (PYTHONPATH=.); pip
    # with no configuration of this machine's (no find-links, index or constraints of it)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PYTHONPATH=str(REPO), PIP_CONFIG_FILE=os.devnull)
    proc = subprocess.run(command, cwd=REPO, env=env)
    if proc.returncode != 0:
        print(f"gpu.py --check-wheels: FAILED at {step} (exit {proc.returncode})", flush=True)
    return proc.returncode == 0


def check(folder: Path) -> int:
    """The module docstring's check; 0 when every step passed."""
    if download(folder) != 0:  # the set itself, for the GPU image
        return 1
    # the same versions for this interpreter (its torch is the one that can be linked in)
    here, image = folder / "here", folder / "image"
    if _download(here, GPU_WHEELS, deps=False, here=True) != 0:
        print("gpu.py --check-wheels: the set could not be downloaded for this interpreter")
        return 1
    for spec in IMAGE:  # the image's version, or the newest this interpreter takes
        if _download(image, [spec], deps=True, here=True) == 0:
            continue
        name = spec.split("==")[0]
        print(f"gpu.py --check-wheels: {spec} is not made for this interpreter; {name} as "
              "the newest that is")  # fmt: skip
        if _download(image, [name], deps=True, here=True) != 0:
            print(f"gpu.py --check-wheels: {name} could not be downloaded")
            return 1
    with tempfile.TemporaryDirectory(prefix="gpu-wheels-") as tmp:
        env = Path(tmp) / "env"
        venv.create(env, with_pip=True)
        python = str(env / "bin" / "python")
        site = Path(subprocess.check_output(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            text=True).strip())  # fmt: skip
        _link_torch(site)
        names = [spec.split("==")[0] for spec in GPU_WHEELS + IMAGE]
        steps = [
            ("install", [python, "-m", "pip", "install", "-q", "--no-index", "--find-links",
                         str(here), "--find-links", str(image), *names]),
            ("pip check", [python, "-m", "pip", "check"]),
            ("imports", [python, "-c", "import importlib, sys; sys.path.insert(0, '.');"
                         f"[importlib.import_module(m) for m in {IMPORTS!r}]; print('imported')"]),
            ("profile --dry", [python, "benchmarks/gpu.py", "--profile", "--dry",
                               "--out", str(Path(tmp) / "profile")]),
        ]  # fmt: skip
        for step, command in steps:
            if not _run(step, command):
                return 1
    print(f"gpu.py --check-wheels: ok: {len(GPU_WHEELS)} wheels and the image's packages "
          "install offline, pip check passes, the phases' imports and the dry profile run")  # fmt: skip
    return 0
