"""The docs say what runs: README.md and docs/*.md checked against the repository.

- every relative link and `#anchor` resolves (GitHub's heading slugs), inside the repository;
- every `python ...` and `make ...` command in a ```sh, ```bash or ```console block names a
  module, script or Makefile target that exists; a command of a quick module (QUICK) is run,
  the others are parsed: their flags against the parser the command itself builds
  (argparse, intercepted in a subprocess before it acts) and their `--config` with its
  `--config.*` overrides loaded and validated as train.py would;
- no commit hash (a 7-40 hex word that is a commit of this repository) outside CHANGELOG.md;
- each tool spelled one way, no machine paths, and every `test_x.py::test_y` named exists.

The checker functions return problems as lines, so the tests below also feed them broken
input and see each caught.
"""

import json
import os
import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_BLOCKS = ("sh", "bash", "shell", "console")
# Modules whose documented commands finish in about a second: run for real. The others
# compile models (seconds to minutes) or need a device, and are parsed only.
QUICK = ("seqpipe.schedule",)
PYTHONS = ("python", "python3", ".venv/bin/python")
SHORT_FORMS = {"seqpipe.tools.verify": "seqpipe.verify", "seqpipe.tools.bench": "seqpipe.bench"}

FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
HEX = re.compile(r"\b[0-9a-f]{7,40}\b")


# ---------------------------------------------------------------- Markdown structure


def split_fences(text: str) -> tuple[str, list[tuple[str, str]]]:
    """(the text outside fenced blocks, [(info word, body) of each block])."""
    prose, blocks, fence, lang, body = [], [], None, "", []
    for line in text.splitlines():
        m = FENCE.match(line)
        if fence is None and m:
            fence, lang, body = m.group(2), m.group(3).lower(), []
        elif fence is not None and re.fullmatch(rf"\s*{fence[0]}{{{len(fence)},}}\s*", line):
            blocks.append((lang, "\n".join(body)))
            fence = None
        elif fence is not None:
            body.append(line)
        else:
            prose.append(line)
    return "\n".join(prose), blocks


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text, lower case, punctuation dropped, spaces to -."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links keep their text
    text = text.replace("`", "").replace("*", "")
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor, duplicates numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    out = set()
    for line in split_fences(text)[0].splitlines():
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def check_links(path: Path, text: str, root: Path = ROOT) -> list[str]:
    """Problems with the relative links and anchors of one page."""
    problems = []
    for target in LINK.findall(split_fences(text)[0]):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        if not file:  # an anchor in this page
            if anchor not in anchors(text):
                problems.append(f"{path.name}: {target}: no heading with that anchor")
            continue
        dest = (path.parent / file).resolve()
        if not dest.is_relative_to(root.resolve()):
            problems.append(f"{path.name}: {target}: outside the repository")
        elif not dest.exists():
            problems.append(f"{path.name}: {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            problems.append(f"{path.name}: {target}: no heading with that anchor")
    return problems


# ---------------------------------------------------------------- commands


def shell_lines(lang: str, body: str) -> list[tuple[str, str]]:
    """The commands of a shell block, continuation lines joined, each with the first line of
    output after it; in a console block only the lines after a `$ ` prompt are commands."""
    out, pending = [], None
    for line in body.splitlines():
        if pending is not None:
            pending += " " + line.strip()
        elif lang == "console" and not line.startswith("$ "):
            if out and not out[-1][1]:
                out[-1] = (out[-1][0], line)
            continue
        else:
            pending = line[2:] if lang == "console" else line
        if pending.endswith("\\"):
            pending = pending[:-1]
            continue
        out.append((pending, ""))
        pending = None
    return out


def simple_commands(line: str) -> list[list[str]]:
    """A shell line's simple commands as argv lists: split at ; & | and shell keywords,
    comments and leading VAR=value assignments dropped."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    commands, argv = [], []
    for token in lexer:
        if token and set(token) <= set(";&|"):
            commands.append(argv)
            argv = []
        else:
            argv.append(token)
    commands.append(argv)
    out = []
    for argv in commands:
        while argv and (argv[0] in ("do", "then", "else") or re.match(r"^\w+=", argv[0])):
            argv = argv[1:]
        if argv:
            out.append(argv)
    return out


def documented_commands(text: str, failing: bool = False) -> list[list[str]]:
    """Every `python ...` and `make ...` command in a page's shell blocks; with `failing`,
    instead, those a console block shows refused (their output starts with `error:`)."""
    found = []
    for lang, body in split_fences(text)[1]:
        if lang not in SHELL_BLOCKS:
            continue
        for line, output in shell_lines(lang, body):
            if output.startswith("error:") != failing:
                continue
            for argv in simple_commands(line):
                if argv[0] in PYTHONS or argv[0] == "make":
                    found.append(argv)
    return found


def target_of(argv: list[str]) -> tuple[str, str, list[str]]:
    """('module' | 'script', its name, its arguments) of a python command."""
    if len(argv) > 2 and argv[1] == "-m":
        return "module", argv[2], argv[3:]
    if len(argv) > 1:
        return "script", argv[1], argv[2:]
    return "script", "", []


# Run in a subprocess, one process for all the commands: each target's own main() with the
# command's arguments. To "probe", argparse's parse_known_args is replaced: the first parser
# a target builds reports its option strings and the arguments it was handed (a target may
# take some by hand first) instead of parsing. To "run", the target runs whole, its output
# kept, and reports its exit status.
_SUBPROCESS = r"""
import argparse, contextlib, io, json, runpy, sys
mode, jobs = json.loads(sys.stdin.read())
class Parsed(BaseException):
    pass
def probe(self, args=None, namespace=None):
    raise Parsed(sorted(self._option_string_actions), sys.argv[1:] if args is None else args)
if mode == "probe":
    argparse.ArgumentParser.parse_known_args = probe
out = []
for kind, name, args in jobs:
    sys.argv, err, got = [name, *args], io.StringIO(), {"code": 0}
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            if kind == "module":
                runpy.run_module(name, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(name, run_name="__main__")
    except Parsed as e:
        got = {"options": e.args[0], "parsed": list(e.args[1])}
    except SystemExit as e:
        got = {"code": e.code if isinstance(e.code, int) else 1}
    except Exception as e:
        got = {"code": 1, "error": f"{type(e).__name__}: {e}"}
    got["stderr"] = err.getvalue()[-500:]
    out.append(got)
print(json.dumps(out))
"""


def in_subprocess(mode: str, jobs: list[tuple[str, str, list[str]]], cwd: Path) -> list[dict]:
    """Each (kind, name, args) job probed or run (see _SUBPROCESS), in cwd."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", _SUBPROCESS],
        input=json.dumps([mode, jobs]),
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@cache
def make_targets() -> frozenset[str]:
    rules = re.findall(r"^([\w.-]+)\s*:(?!=)", (ROOT / "Makefile").read_text(), re.M)
    return frozenset(rules)


def flags_of(args: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in args if a.startswith("--")]


def config_problem(args: list[str]) -> str | None:
    """Load --config with its --config.* overrides as train.py does; the error, if any."""
    from seqpipe.run import config as config_lib

    name, overrides, i = None, [], 0
    while i < len(args):
        a = args[i]
        if a == "--config" and i + 1 < len(args):
            name, i = args[i + 1], i + 1
        elif a.startswith("--config="):
            name = a.split("=", 1)[1]
        elif a.startswith("--config."):
            overrides.append(a)
            if "=" not in a and i + 1 < len(args):
                overrides.append(args[i + 1])
                i += 1
        i += 1
    if name is None:
        return None
    old = os.getcwd()
    try:
        os.chdir(ROOT)
        config_lib.load(name, config_lib.parse_overrides(overrides))
    except config_lib.ConfigError as e:
        return str(e)
    finally:
        os.chdir(old)
    return None


def check_commands(commands: list[list[str]], run_dir: Path, refused: bool = False) -> list[str]:
    """Problems with documented commands: what they name, their flags, their config keys;
    the QUICK ones are run in run_dir (a scratch directory, given docs/ and runs/). Commands
    shown `refused` must still name real flags and keys; their values are the point."""
    problems, probe, run = [], [], []
    for argv in commands:
        shown = " ".join(argv)
        if argv[0] == "make":
            for goal in (a for a in argv[1:] if "=" not in a and not a.startswith("-")):
                if goal not in make_targets():
                    problems.append(f"{shown}: no Makefile target {goal!r}")
            continue
        kind, name, args = target_of(argv)
        if kind == "module":
            if name in SHORT_FORMS:
                problems.append(f"{shown}: spell it python -m {SHORT_FORMS[name]}")
            if not module_exists(name):
                problems.append(f"{shown}: no module {name}")
                continue
        elif not (ROOT / name).is_file():
            problems.append(f"{shown}: no script {name!r}")
            continue
        bad = config_problem(args)
        if bad and not (refused and "unknown" not in bad):
            problems.append(f"{shown}: {bad}")
        (run if kind == "module" and name in QUICK else probe).append((shown, (kind, name, args)))
    if probe:
        results = in_subprocess("probe", [job for _, job in probe], ROOT)
        for (shown, job), got in zip(probe, results, strict=True):
            problems += _flag_problems(shown, job[2], got)
    if run:
        (run_dir / "docs").mkdir(exist_ok=True)
        (run_dir / "runs").mkdir(exist_ok=True)
        results = in_subprocess("run", [job for _, job in run], run_dir)
        for (shown, _), got in zip(run, results, strict=True):
            if got["code"] != 0:
                problems.append(f"{shown}: exit {got['code']}: {got['stderr'].strip()}")
    return problems


def module_exists(name: str) -> bool:
    from importlib.util import find_spec

    try:
        return find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def _flag_problems(shown: str, args: list[str], got: dict) -> list[str]:
    """The flags of args that the target's parser was handed and does not know."""
    if "error" in got:
        return [f"{shown}: failed before parsing its arguments: {got['error']}"]
    if "options" not in got:  # the target parses its arguments by hand (device_report)
        return []
    options, handed = set(got["options"]), set(flags_of(got["parsed"]))
    out = []
    for flag in flags_of(args):
        if flag not in handed:  # taken by hand before the parser (bench's --accelerator)
            continue
        if flag.startswith("--config.") and "--config" in options:
            continue
        if flag not in options:
            out.append(f"{shown}: unknown flag {flag}")
    return out


# ---------------------------------------------------------------- words that rot


@cache
def commits() -> frozenset[str]:
    done = subprocess.run(
        ["git", "-C", str(ROOT), "rev-list", "--all"], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"no git history to check hashes against: {done.stderr.strip()}")
    return frozenset(done.stdout.split())


def commit_hashes(text: str, known: frozenset[str]) -> list[str]:
    """The words of text that are (abbreviated) commits among known."""
    return sorted({w for w in HEX.findall(text) if any(c.startswith(w) for c in known)})


def machine_paths(text: str) -> list[str]:
    return re.findall(r"(?:(?<![\w.~])/(?:work|home|Users|root)/\S*|\.\./shared\S*)", text)


def named_tests(text: str) -> list[str]:
    """`tests/test_x.py::test_y` and `test_x.py::test_y` references that name nothing."""
    missing = []
    for file, name in re.findall(r"(test_\w+\.py)::(test_\w+)(?!\.\.\.)", text):
        path = ROOT / "tests" / file
        if not path.is_file() or not re.search(rf"def {name}\b", path.read_text()):
            missing.append(f"{file}::{name}")
    return missing


# ---------------------------------------------------------------- the docs as they are


def _pages():
    return [pytest.param(p, id=str(p.relative_to(ROOT))) for p in PAGES]


def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_text()) <= 12_000


def _demo_block(text: str) -> tuple[str, dict[int, dict[str, str]]]:
    """The README's demo: the Python its figures were measured with ("3.13"), and the
    printed fields of each step line it shows ({step: {"loss": "7.6468", ...}})."""
    intro, block = text.split("It prints (", 1)[1].split("```text\n", 1)
    python = re.search(r"Python\s+(\d+\.\d+)", intro).group(1)
    return python, _step_fields(block.split("```", 1)[0])


def _step_fields(output: str) -> dict[int, dict[str, str]]:
    steps = {}
    for line in output.splitlines():
        if m := re.match(r"step\s+(\d+)/\d+\s+(.*)", line):
            steps[int(m.group(1))] = dict(re.findall(r"(loss|eval_loss) (\S+)", m.group(2)))
    return steps


@pytest.mark.slow
def test_the_readme_demo_shows_what_make_train_prints(tmp_path):
    """`make train`'s command on the default install prints the README's first and last
    losses to the digit (the corpus is the running Python's standard library, so another
    Python gives other figures, as the README says)."""
    python, shown = _demo_block((ROOT / "README.md").read_text())
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if here != python:
        pytest.skip(f"the README's figures are Python {python}'s; this is Python {here}")
    proc = subprocess.run(
        [sys.executable, "train.py", "--config", "configs/tiny.py", "--workdir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    printed = _step_fields(proc.stdout)
    first, last = min(shown), max(shown)
    assert (printed[first], printed[last]) == (shown[first], shown[last])


def test_the_demo_check_reads_the_readme_block():
    python, shown = _demo_block((ROOT / "README.md").read_text())
    assert re.fullmatch(r"3\.\d+", python)
    assert set(shown[1]) == {"loss"} and set(shown[max(shown)]) == {"loss", "eval_loss"}


@pytest.mark.parametrize("page", _pages())
def test_links_and_anchors_resolve(page):
    assert check_links(page, page.read_text()) == []


def test_every_documented_command_parses_and_the_quick_ones_run(tmp_path):
    commands = [argv for page in PAGES for argv in documented_commands(page.read_text())]
    assert len(commands) > 20  # the extraction found the docs' commands
    assert check_commands(commands, tmp_path) == []


def test_every_documented_refusal_names_real_flags_and_keys(tmp_path):
    refusals = [a for page in PAGES for a in documented_commands(page.read_text(), failing=True)]
    assert refusals  # the README shows one
    assert check_commands(refusals, tmp_path, refused=True) == []


@pytest.mark.parametrize("page", [*_pages(), pytest.param(ROOT / "CHANGELOG.md", id="log")])
def test_no_machine_paths_and_no_missing_tests(page):
    text = page.read_text()
    assert machine_paths(text) == []
    assert named_tests(text) == []


@pytest.mark.parametrize("page", _pages())
def test_each_tool_is_spelled_one_way(page):
    long_forms = "|".join(re.escape(m) for m in SHORT_FORMS)
    assert re.findall(rf"-m ({long_forms})\b", page.read_text()) == []


def test_the_code_points_at_pages_that_exist():
    sources = [*ROOT.glob("seqpipe/**/*.py"), *ROOT.glob("scripts/*"), *ROOT.glob("tests/*.py")]
    named = {m for f in sources for m in re.findall(r"docs/[\w-]+\.(?:md|png)", f.read_text())}
    assert named and {m for m in named if not (ROOT / m).is_file()} == set()


def test_no_commit_hash_outside_the_changelog():
    known = commits()
    found = {p.name: commit_hashes(p.read_text(), known) for p in PAGES}
    assert {k: v for k, v in found.items() if v} == {}


# ---------------------------------------------------------------- the checkers catch rot


def test_a_broken_link_or_anchor_is_caught(tmp_path):
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "page.md"
    (tmp_path / "docs" / "other.md").write_text("# Other page\n\n## The `remat` policies\n")
    text = (
        "# Page\n\n## A section: here\n\n"
        "[ok](other.md#the-remat-policies) [ok](#a-section-here) [ok](https://example.com)\n"
        "[gone](missing.md) [bad anchor](other.md#nope) [self](#nowhere)\n"
        "![picture](pic.png) [out](../../outside.md)\n"
        "```sh\n[not a link](nowhere.md)\n```\n"
    )
    problems = check_links(page, text, root=tmp_path)
    assert [p.split(": ")[1] for p in problems] == [
        "missing.md",
        "other.md#nope",
        "#nowhere",
        "pic.png",
        "../../outside.md",
    ]


def test_github_slugs():
    assert slug("What a forward keeps: `pipeline.remat`") == "what-a-forward-keeps-pipelineremat"
    assert slug("The paper's 7B and 30B") == "the-papers-7b-and-30b"
    assert slug("Memory of gpt_1b at long context") == "memory-of-gpt_1b-at-long-context"
    assert anchors("# A\n## A\n```sh\n# A\n```\n") == {"a", "a-1"}


def test_commands_are_found_in_shell_blocks_only():
    text = (
        "```sh\nmake test   # a comment\n"
        "XLA_FLAGS=x python train.py --config tiny \\\n    --config.train.steps=3\n"
        "for i in 0 1; do python -m seqpipe.verify --config tiny & done; wait\n```\n"
        "```console\n$ python -m seqpipe.schedule --stages 2\noutput python not a command\n```\n"
        "```text\npython train.py --not-checked\n```\n"
    )
    assert documented_commands(text) == [
        ["make", "test"],
        ["python", "train.py", "--config", "tiny", "--config.train.steps=3"],
        ["python", "-m", "seqpipe.verify", "--config", "tiny"],
        ["python", "-m", "seqpipe.schedule", "--stages", "2"],
    ]


def test_an_unknown_flag_a_stale_key_or_a_missing_module_is_caught(tmp_path):
    cases = {
        "python train.py --config tiny --compile_onlyy": "unknown flag --compile_onlyy",
        "python train.py --config tiny --config.pipeline.segmentz=4": "unknown key",
        "python train.py --config tiny --config.train.steps=-3": "train.steps",
        "python -m seqpipe.tools.step_cost f.txt --segmentz 4": "unknown flag --segmentz",
        "python -m seqpipe.schedule --schedule seq1f1b --stages 4 --microbatches 8 --bogus": (
            "exit 2"
        ),
        "python -m seqpipe.nonexistent --help": "no module seqpipe.nonexistent",
        "python scripts/nonexistent.py": "no script",
        "python -m seqpipe.tools.bench --quick": "spell it python -m seqpipe.bench",
        "make nosuchtarget": "no Makefile target",
    }
    problems = check_commands([shlex.split(c) for c in cases], tmp_path)
    for command, expected in cases.items():
        assert any(p.startswith(command) and expected in p for p in problems), (command, problems)
    good = [
        "python train.py --config gpt_1b.py --compile_only --topology h200 "
        "--config.mesh.stage=1 --config.pipeline.remat=none",
        "python -m seqpipe.schedule --schedule seq1f1b --stages 4 --microbatches 8 --segments 4",
        "make bench",
    ]
    assert check_commands([shlex.split(c) for c in good], tmp_path) == []


def test_a_commit_hash_is_caught_and_a_hex_number_is_not():
    known = frozenset({"0123456789abcdef0123456789abcdef01234567"})
    text = "at 0123456, at 9999999-0123456789abcdef; 0xdeadbeef, deadbeef1, 1234567 tokens"
    assert commit_hashes(text, known) == ["0123456", "0123456789abcdef"]
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    if head:
        assert commit_hashes(f"at {head}, the run", commits()) == [head]


def test_machine_paths_and_missing_tests_are_caught():
    assert machine_paths("see ../shared/device.md and /work/main/.venv/bin/python") == [
        "../shared/device.md",
        "/work/main/.venv/bin/python",
    ]
    assert machine_paths("python train.py --workdir /tmp/demo runs/demo") == []
    assert named_tests("`test_docs.py::test_github_slugs`, `test_docs.py::test_gone`") == [
        "test_docs.py::test_gone"
    ]
