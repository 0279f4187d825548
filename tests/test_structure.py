"""The package's shape: subpackages that only import downwards, no import circles, at most
12 levels, folders a reader can hold, a first line for every module, and the public API
that docs/architecture.md lists."""

import ast
import collections
import re
from pathlib import Path

from seqpipe import api

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "seqpipe"
MAX_LEVELS = 12
MAX_MODULES = 12  # a folder's modules, `__init__` and `__main__` not counted


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Each module's seqpipe imports, function-local ones included, as module names."""

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = collections.defaultdict(set)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("seqpipe"):
                targets = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                if target.startswith("seqpipe") and (found := resolve(target)) != name:
                    graph[name].add(found)
    return graph


def _levels(graph: dict[str, set[str]], modules) -> dict[str, int]:
    level: dict[str, int] = {}

    def visit(name: str, path: tuple) -> int:
        assert name not in path, "import circle: " + " -> ".join((*path, name))
        if name not in level:
            level[name] = 1 + max((visit(d, (*path, name)) for d in graph[name]), default=0)
        return level[name]

    for name in modules:
        visit(name, ())
    return level


def _package(module: str) -> str | None:
    """The subpackage a module belongs to; None for the top level and for commands (a
    package's `__main__`), which sit above every package."""
    parts = module.split(".")
    if parts[-1] == "__main__" or len(parts) < 3 and not (PACKAGE / parts[-1]).is_dir():
        return None
    return parts[1]


def test_no_import_circles_and_at_most_12_levels():
    modules = _modules()
    levels = _levels(_imports(modules), modules)
    assert max(levels.values()) <= MAX_LEVELS, sorted(levels.items(), key=lambda kv: kv[1])[-5:]


def test_subpackages_only_import_downwards():
    """The subpackages' import graph has no circle: each imports only packages below it."""
    graph = collections.defaultdict(set)
    for module, targets in _imports(_modules()).items():
        for target in targets:
            a, b = _package(module), _package(target)
            if a and b and a != b:
                graph[a].add(b)
    _levels(graph, list(graph))


def test_folders_are_small_and_every_module_says_what_it_owns():
    per_folder = collections.Counter()
    for name, path in _modules().items():
        if path.name not in ("__init__.py", "__main__.py"):
            per_folder[path.parent.relative_to(ROOT)] += 1
        docstring = ast.get_docstring(ast.parse(path.read_text()), clean=False)
        if path.name == "__init__.py" or path.stat().st_size:
            assert docstring and docstring.strip(), f"{name} has no docstring"
    assert max(per_folder.values()) <= MAX_MODULES, per_folder.most_common(3)


def test_the_public_api_is_what_the_architecture_page_lists():
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## The public API", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| `(\w+)", section, flags=re.M)
    assert sorted(listed) == sorted(api.__all__)
    namespace: dict = {}
    exec("from seqpipe.api import *", namespace)
    assert sorted(k for k in namespace if k != "__builtins__") == sorted(api.__all__)


def test_a_script_of_the_public_api_runs_the_model(tmp_path):
    import jax

    config = api.load_config("tiny", {"model.attention": "xla"})
    cfg = api.GPTConfig.from_config(config.model)
    params = api.init_params(cfg, jax.random.key(0))
    tokens = jax.numpy.zeros((1, 9), jax.numpy.int32)
    assert api.forward(params, tokens[:, :-1], cfg).shape == (1, 8, cfg.vocab_size)
    assert api.loss(params, tokens, cfg).shape == ()
