"""`make install`'s interpreter: the newest final CPython 3.12+ among pyenv's versions and
the PATH's, else python3 (real interpreters, linked into a made-up pyenv root)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PYENV = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"


def _interpreter(minor: int) -> Path | None:
    """A real CPython 3.<minor>: pyenv's, else the PATH's."""
    found = sorted(PYENV.glob(f"3.{minor}.*/bin/python3")) if PYENV.is_dir() else []
    found = [p for p in found if not p.parent.parent.name.endswith("t")]  # free-threaded
    path = found[-1] if found else shutil.which(f"python3.{minor}")
    return Path(path) if path else None


INTERPRETERS = {minor: _interpreter(minor) for minor in (11, 12, 13)}


def _which_python(tmp_path: Path, minors: list[int]) -> str:
    """What `make which-python` says with only these versions under PYENV_ROOT and no
    Python on the PATH."""
    root, tools = tmp_path / "pyenv", tmp_path / "bin"
    for minor in minors:
        (root / "versions" / f"3.{minor}" / "bin").mkdir(parents=True)
        (root / "versions" / f"3.{minor}" / "bin" / "python3").symlink_to(INTERPRETERS[minor])
    tools.mkdir(parents=True)
    for tool in ("sort", "head", "cut"):
        (tools / tool).symlink_to(shutil.which(tool))
    env = {"PATH": str(tools), "PYENV_ROOT": str(root), "HOME": str(tmp_path)}
    proc = subprocess.run(
        [shutil.which("make"), "-s", "which-python"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


@pytest.mark.skipif(
    shutil.which("make") is None or None in INTERPRETERS.values(),
    reason="needs make and Python 3.11, 3.12 and 3.13",
)
def test_install_takes_the_newest_python_from_3_12_else_python3(tmp_path):
    def pyenv(case, minor):
        return f"{tmp_path}/{case}/pyenv/versions/3.{minor}/bin/python3"

    assert _which_python(tmp_path / "a", [11, 13, 12]) == pyenv("a", 13)
    assert _which_python(tmp_path / "b", [11, 12]) == pyenv("b", 12)
    assert _which_python(tmp_path / "c", [11]) == "python3"  # no 3.12+: the fallback
    assert _which_python(tmp_path / "d", []) == "python3"
