"""`pip install .` without `-e`: a wheel built from a clean copy of the tree holds every
module of seqpipe/ and the model configs; installed in a fresh venv it imports every
module, finds `--config tiny`, answers `--help` for each `python -m` command and trains
the demo (`python -m seqpipe.train`, then `seqpipe-train` resumes it). The venv reaches
the dependencies through a .pth file naming this interpreter's site-packages, whose own
.pth files (the editable seqpipe of `make install`) are never read: what runs is the
installed copy, and the import check asserts it."""

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers import subprocess_env, tiny_args

ROOT = Path(__file__).resolve().parents[1]


def _source_modules() -> set[str]:
    """The modules of seqpipe/ in the tree (the configs link not followed)."""
    names = set()
    for folder, _, files in os.walk(ROOT / "seqpipe"):
        parts = Path(folder).relative_to(ROOT).parts
        names |= {".".join([*parts, f[:-3]]) for f in files if f.endswith(".py")}
    return {n.removesuffix(".__init__") for n in names}


def _configs() -> set[str]:
    return {p.name for p in (ROOT / "configs").glob("*.py")}


def _clean_copy(dest: Path) -> Path:
    """The files git knows (tracked, and new ones not ignored), as a clone would have them
    once committed: no build outputs, caches or egg-info; links stay links."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_symlink() or source.is_file():  # a file deleted but not yet committed
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name, follow_symlinks=False)
    return dest


def _pip(*argv: str) -> None:
    """This interpreter's pip (setuptools, a dev dependency, builds without isolation)."""
    result = subprocess.run(
        [sys.executable, "-m", "pip", "-q", *argv], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(the wheel, the fresh venv's python, its site-packages, a directory outside the
    repository to run in)."""
    base = tmp_path_factory.mktemp("wheel")
    source = _clean_copy(base / "src")
    _pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(base / "dist"), str(source))
    (wheel,) = (base / "dist").glob("seqpipe-*.whl")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    _pip("--python", str(python), "install", "--no-deps", str(wheel))
    site_packages = Path(
        subprocess.check_output([python, "-c", "import site; print(site.getsitepackages()[0])"])
        .decode()
        .strip()
    )
    (site_packages / "dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    (base / "run").mkdir()
    return wheel, python, site_packages, base / "run"


def _run(installed, *argv: str, timeout: int = 120) -> subprocess.CompletedProcess:
    """A command of the installed package, outside the repository, with the tests' JAX
    environment (CPU, 8 devices) and no PYTHONPATH."""
    env = {k: v for k, v in subprocess_env().items() if k != "PYTHONPATH"}
    return subprocess.run(
        argv, cwd=installed[3], env=env, capture_output=True, text=True, timeout=timeout
    )


def test_every_package_folder_has_an_init():
    """A folder without one would ship as a namespace package that pkgutil walks past."""
    folders = [Path(f) for f, _, _ in os.walk(ROOT / "seqpipe") if "__pycache__" not in f]
    assert [f for f in folders if not (f / "__init__.py").is_file()] == []


def test_the_wheel_holds_every_module_and_every_config(installed):
    names = zipfile.ZipFile(installed[0]).namelist()
    modules = {n[:-3].replace("/", ".") for n in names if n.endswith(".py")}
    configs = {n.split("/")[-1] for n in names if n.startswith("seqpipe/configs/")}
    assert {n.removesuffix(".__init__") for n in modules if ".configs." not in n} == (
        _source_modules()
    )
    assert configs == _configs()
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(installed[0]).read(entry_points).decode()
    assert "seqpipe-train = seqpipe.train.__main__:entry" in text


# The commands: each package's `__main__` (run, not imported: importing one runs it) and
# `seqpipe.verify`.
COMMANDS = ["seqpipe.hf", "seqpipe.plan", "seqpipe.schedule", "seqpipe.train", "seqpipe.verify"]
IMPORT_ALL = """
import importlib, json, pkgutil, seqpipe
from seqpipe.run import config
names = ["seqpipe"] + [m.name for m in pkgutil.walk_packages(seqpipe.__path__, "seqpipe.")]
imported = [n for n in names if not n.endswith(".__main__")]
files = sorted({importlib.import_module(n).__file__ for n in imported})
print(json.dumps({"names": names, "files": files, "tiny": str(config.resolve_path("tiny"))}))
"""


def test_the_installed_package_imports_every_module_and_finds_the_configs(installed):
    result = _run(installed, str(installed[1]), "-c", IMPORT_ALL)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.splitlines()[-1])
    assert set(found["names"]) == _source_modules()
    commands = {n.removesuffix(".__main__") for n in found["names"] if n.endswith("__main__")}
    assert commands | {"seqpipe.verify"} == set(COMMANDS)
    site_packages = str(installed[2]) + os.sep
    assert [f for f in found["files"] if not f.startswith(site_packages)] == []
    assert found["tiny"] == str(installed[2] / "seqpipe" / "configs" / "tiny.py")


@pytest.mark.parametrize("command", COMMANDS)
def test_the_installed_commands_answer(installed, command):
    result = _run(installed, str(installed[1]), "-m", command, "--help")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "usage:" in result.stdout


def test_the_console_script_names_itself(installed):
    result = _run(installed, str(installed[1].parent / "seqpipe-train"), "--help")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("usage: seqpipe-train ")


def test_the_installed_package_trains_the_demo(installed):
    """Two steps of `--config tiny` (the tests' tiny model) by `python -m seqpipe.train`,
    then `seqpipe-train` resumes the run for a third step from its checkpoint."""
    workdir = installed[3] / "demo"

    def argv(steps: int) -> list[str]:
        overrides = {"train.steps": str(steps), "checkpoint.every": "2"}
        return ["--workdir", str(workdir), *tiny_args(**overrides)]

    first = _run(installed, str(installed[1]), "-m", "seqpipe.train", *argv(2))
    assert first.returncode == 0, first.stderr[-3000:]
    second = _run(installed, str(installed[1].parent / "seqpipe-train"), *argv(3))
    assert second.returncode == 0, second.stderr[-3000:]
    steps = [json.loads(line).get("step") for line in (workdir / "metrics.jsonl").open()]
    assert steps[0] == 1 and steps[-1] == 3, steps
