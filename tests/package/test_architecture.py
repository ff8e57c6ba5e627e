"""The package's shape (docs/architecture.md): layers import downward only, no cycles, no private names.

The import graph is read from the source with ``ast``, imports inside functions included, so a
back edge hidden in a function body shows up here even though nothing fails at import time.
"""

from __future__ import annotations

import ast
import inspect
from dataclasses import fields
from pathlib import Path

import pytest

import lmprobe

PKG = Path(lmprobe.__file__).parent

#: bottom to top; a module may import its own layer (without cycles) and the layers below. A module's layer is the
#: first part of its path under lmprobe/: the folders named here, "features" for any other folder (extraction/,
#: saev/, probe/, ...), and the root modules named here (the package's public entry points and the two modules every
#: layer needs, errors.py and version.py)
LAYERS = ["base", "format", "storage", "opening", "features", "publish", "api"]
FOLDERS = {"base": "base", "format": "format", "storage": "storage", "opening": "opening", "publish": "publish",
           "cli": "api"}
ROOT_MODULES = {"errors": "base", "version": "base", "__init__": "api", "__main__": "api", "api": "api"}


def layer_of(module: str) -> str:
    parts = module.split(".")[1:]
    if not parts:
        return "api"  # lmprobe/__init__.py
    top = parts[0]
    if parts[-1] == "__main__":
        return "api"  # `python -m lmprobe.sae`: an entry point into the command line, like lmprobe/__main__.py
    if (PKG / top).is_dir():
        return FOLDERS.get(top, "features")
    if top in ROOT_MODULES:
        return ROOT_MODULES[top]
    raise AssertionError(f"lmprobe/{top}.py sits at the root, which holds only {sorted(ROOT_MODULES)}: move it into "
                         "the folder of its layer (docs/architecture.md, where a change goes)")


#: lmprobe imports inside functions that are there on purpose (never to dodge a cycle)
LAZY_ALLOWED = {
    ("lmprobe", "__getattr__"),  # the API loads on first use so that lmprobe.sae stays numpy-free
    ("lmprobe.sae", "__getattr__"),  # export needs numpy; the loader does not
    ("lmprobe.sae.topk", "top_features"),  # a dictionary's top features need numpy only when a dataset is read
}


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        rel = p.relative_to(PKG.parent).with_suffix("")
        parts = rel.parts[:-1] if p.name == "__init__.py" else rel.parts
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def _resolve(here: str, is_pkg: bool, level: int, module: str | None, name: str | None) -> str | None:
    if level:
        base = here.split(".") if is_pkg else here.split(".")[:-1]
        base = base[: len(base) - (level - 1)]
        target = ".".join(base + ([module] if module else []))
    else:
        target = module or ""
    if not target.startswith("lmprobe"):
        return None
    if name and f"{target}.{name}" in MODULES:
        return f"{target}.{name}"
    while target and target not in MODULES:
        target = target.rsplit(".", 1)[0] if "." in target else ""
    return target or None


def _edges():
    """(importer, imported module, imported names, enclosing function or None) for every lmprobe import."""
    out = []

    def visit(mod: str, is_pkg: bool, node, func):
        for child in ast.iter_child_nodes(node):
            f = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            if isinstance(child, ast.Import):
                for a in child.names:
                    t = _resolve(mod, is_pkg, 0, a.name, None)
                    if t:
                        out.append((mod, t, [], f))
            elif isinstance(child, ast.ImportFrom):
                for a in child.names:
                    t = _resolve(mod, is_pkg, child.level, child.module, a.name)
                    if t:
                        out.append((mod, t, [a.name], f))
            visit(mod, is_pkg, child, f)

    for mod, path in MODULES.items():
        visit(mod, path.name == "__init__.py", ast.parse(path.read_text()), None)
    return out


EDGES = _edges()


def test_every_module_has_a_layer():
    for mod in MODULES:
        layer_of(mod)


def test_the_layers_folders_exist_and_the_docs_draw_them():
    text = (PKG.parent / "docs" / "architecture.md").read_text()
    for folder in FOLDERS:
        assert (PKG / folder / "__init__.py").is_file(), folder
    for folder in sorted(p.name for p in PKG.iterdir() if (p / "__init__.py").is_file()):
        assert f"`{folder}/`" in text, f"docs/architecture.md does not name the {folder}/ folder"


def test_imports_go_downward_only():
    bad = [f"{a} ({layer_of(a)}) imports {b} ({layer_of(b)})" for a, b, _, _ in EDGES
           if LAYERS.index(layer_of(b)) > LAYERS.index(layer_of(a))]
    assert not bad, "\n".join(bad)


def test_format_imports_nothing_above_it():
    bad = [f"{a} imports {b}" for a, b, _, _ in EDGES if layer_of(a) == "format" and layer_of(b) not in ("base", "format")]
    assert not bad, "\n".join(bad)


def test_no_import_cycle_between_files():
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for a, b, _, _ in EDGES:
        if a != b and not (b == "lmprobe" and a.startswith("lmprobe.")):
            graph[a].add(b)
    # a parent package's __init__ runs first anyway; an edge to the package itself is a real back edge
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(v: str) -> list[str] | None:
        state[v] = 1
        stack.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state and (cycle := dfs(w)):
                return cycle
        state[v] = 2
        stack.pop()
        return None

    for m in sorted(MODULES):
        if m not in state and (cycle := dfs(m)):
            pytest.fail("import cycle: " + " -> ".join(cycle))


def test_nothing_imports_the_top_package():
    bad = [a for a, b, _, _ in EDGES if b == "lmprobe" and a != "lmprobe"]
    assert not bad, f"these modules import the top package: {bad}"


def test_lmprobe_imports_inside_functions_only_where_documented():
    bad = [f"{a}.{f}() imports {b}" for a, b, _, f in EDGES if f is not None and (a, f) not in LAZY_ALLOWED]
    assert not bad, "\n".join(bad)


def test_no_module_imports_a_private_name_of_another():
    bad = [f"{a} imports {n} from {b}" for a, b, names, _ in EDGES for n in names
           if n.startswith("_") and n != "__version__" and a != b]
    assert not bad, "\n".join(bad)


def test_exception_classes_live_in_errors_py():
    bad = []
    for mod, path in MODULES.items():
        if mod == "lmprobe.errors":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    isinstance(b, ast.Name) and (b.id.endswith(("Error", "Exception")) or b.id == "LmprobeError")
                    for b in node.bases):
                if not node.name.startswith("_"):  # private control-flow signals stay where they are used
                    bad.append(f"{mod}.{node.name}")
    assert not bad, f"exception classes outside errors.py: {bad}"


def test_every_lmprobe_error_refines_a_builtin():
    from lmprobe import errors

    for name, cls in vars(errors).items():
        if isinstance(cls, type) and issubclass(cls, errors.LmprobeError) and cls is not errors.LmprobeError:
            builtins_ = [b for b in cls.__mro__ if b.__module__ == "builtins" and b not in (Exception, BaseException, object)]
            assert builtins_, f"{name} inherits no builtin exception users could catch"


def test_public_functions_have_real_signatures():
    from lmprobe.extraction.config import ExtractionConfig

    # the settings are written once, in ExtractionConfig: extract's signature (help(), tooltips) spells them out
    params = inspect.signature(lmprobe.extract).parameters
    assert [p for p in params if p not in ("model", "prompts", "token")] == [
        f.name for f in fields(ExtractionConfig) if f.name not in ("model", "prompts")]
    assert all(params[f.name].default == f.default for f in fields(ExtractionConfig) if f.name not in ("model", "prompts",
                                                                                                       "out"))
    for fn in (lmprobe.extract, lmprobe.load, lmprobe.push_to_hub, lmprobe.validate, lmprobe.pull, lmprobe.merge):
        kinds = {p.kind for p in inspect.signature(fn).parameters.values()}
        assert inspect.Parameter.VAR_KEYWORD not in kinds, f"{fn.__name__} takes **kwargs"


def test_an_unknown_keyword_is_a_type_error(tmp_path):
    with pytest.raises(TypeError, match="tokne"):
        lmprobe.load(tmp_path, tokne="x")
    with pytest.raises(TypeError, match="layer"):
        lmprobe.extract("lmprobe-tiny", ["a"], out=tmp_path / "x", layer=3)


def test_extraction_config_checks_itself_and_documents_every_field():
    from lmprobe.errors import ExtractionError
    from lmprobe.extraction.config import ExtractionConfig

    source = inspect.getsource(ExtractionConfig)
    for f in fields(ExtractionConfig):
        # a docstring line follows each field
        assert f'{f.name}:' in source
        after = source.split(f"    {f.name}:", 1)[1].split("\n", 2)[1]
        assert after.strip().startswith('"""'), f"field {f.name} has no docstring"
    with pytest.raises(ExtractionError, match="batch_size"):
        ExtractionConfig(model="m", prompts=["a"], out="o", batch_size=0)
    with pytest.raises(ExtractionError, match="nnsight"):
        ExtractionConfig(model="m", prompts=["a"], out="o", remote=True)
    with pytest.raises(lmprobe.LmprobeError, match="512XB"):
        ExtractionConfig(model="m", prompts=["a"], out="o", shard_size="512XB")


def test_there_is_one_command_line():
    """Every command is parsed in lmprobe/cli/ (one module per command group) and calls a public
    function; no feature package keeps a command line of its own (`python -m lmprobe.sae` hands over to it)."""
    parsers = sorted(name for name, path in MODULES.items()
                     if not name.startswith("lmprobe.cli") and "argparse" in path.read_text())
    assert not parsers, f"modules outside lmprobe/cli/ that parse arguments: {parsers}"


def test_no_module_past_600_lines_without_a_reason_at_its_top():
    """One idea per file: a file past 600 lines says at its top why it is one file."""
    long = [name for name, path in MODULES.items()
            if len(path.read_text().splitlines()) > 600 and "on purpose" not in (ast.get_docstring(ast.parse(
                path.read_text())) or "")]
    assert not long, f"modules past 600 lines whose docstring gives no reason (say why it is 'on purpose'): {long}"


def _cli_may_import(target: str) -> bool:
    """What the command line may import: the public API (``lmprobe``, ``lmprobe.api``, ``lmprobe.errors``), the public
    ``__init__`` of a subpackage (``lmprobe.saev``, ``lmprobe.probe``, ...), ``base/`` and itself."""
    if target in ("lmprobe", "lmprobe.api", "lmprobe.errors"):
        return True
    if target.startswith(("lmprobe.base.", "lmprobe.cli.")) or target in ("lmprobe.base", "lmprobe.cli"):
        return True
    parts = target.split(".")
    return len(parts) == 2 and MODULES[target].name == "__init__.py"


def _cli_imports() -> list[tuple[str, str]]:
    """(cli module, what it imports from) for every lmprobe import of lmprobe/cli/: ``from ..opening import load`` is
    an import from ``lmprobe.opening`` (its __init__), ``from .. import api`` one of ``lmprobe.api``."""
    out = []
    for mod, path in MODULES.items():
        if not mod.startswith("lmprobe.cli"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                out += [(mod, a.name) for a in node.names if a.name.startswith("lmprobe")]
            elif isinstance(node, ast.ImportFrom):
                here = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
                base = here[: len(here) - (node.level - 1)] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                if not target.startswith("lmprobe"):
                    continue
                if target == "lmprobe":  # from .. import api: the names are modules (or the package's own names)
                    out += [(mod, f"lmprobe.{a.name}" if f"lmprobe.{a.name}" in MODULES else "lmprobe")
                            for a in node.names]
                else:
                    out.append((mod, target))
    return out


def test_the_command_line_is_a_thin_client_of_the_public_api():
    """The command line parses and calls the public API: it reaches no module inside a layer (a feature's module,
    the format, storage), only what lmprobe.api and the subpackages' __init__ offer."""
    bad = [f"{a} imports {b}" for a, b in _cli_imports() if not _cli_may_import(b)]
    assert not bad, "\n".join(bad)


def test_nothing_imports_the_command_line():
    """The command line sits on top: only lmprobe/__main__.py (``python -m lmprobe``) imports it."""
    bad = [f"{a} imports {b}" for a, b, _, _ in EDGES
           if (b == "lmprobe.cli" or b.startswith("lmprobe.cli.")) and not a.startswith("lmprobe.cli")
           and a != "lmprobe.__main__"]
    assert not bad, "\n".join(bad)


def test_one_function_runs_an_extraction():
    """lmprobe.api.run_extraction runs an extraction (then its push); lmprobe.extract is its one-line alias, and
    only the API calls the runner's step."""
    import lmprobe.extraction

    assert not hasattr(lmprobe.extraction, "run")
    callers = sorted({a for a, b, names, _ in EDGES if b == "lmprobe.extraction.runner" and "execute" in names})
    assert callers == ["lmprobe.api"], callers


def test_the_command_line_writes_no_default_of_its_own():
    """An option's default is the API's (a settings field, or the called function's parameter): no literal
    ``default=`` in lmprobe/cli/ but None (the option is absent) and False (a flag)."""
    bad = []
    for mod, path in MODULES.items():
        if not mod.startswith("lmprobe.cli"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                for kw in node.keywords:
                    v = kw.value
                    literal = isinstance(v, (ast.List, ast.Tuple, ast.Dict, ast.Set)) or (
                        isinstance(v, ast.UnaryOp) and isinstance(v.operand, ast.Constant)) or (
                        isinstance(v, ast.Constant) and v.value is not None and v.value is not False)
                    if kw.arg == "default" and literal:
                        bad.append(f"{path.relative_to(PKG.parent)}:{node.lineno} default={ast.unparse(v)}")
    assert not bad, "literal defaults in the command line (take them from the API):\n" + "\n".join(bad)


def _source_files(*folders: str) -> list[Path]:
    root = PKG.parent
    return sorted(p for folder in folders for p in (root / folder).rglob("*.py")
                  if "reference" not in p.relative_to(root).parts[:2])  # tests/reference/: third-party code, as is


def test_every_module_logs_through_a_logger_named_after_it():
    """One idiom: ``logger = logging.getLogger(__name__)``, a child of the ``lmprobe`` logger whose handler shows its
    messages (base/progress.py sets that one up, the only other getLogger call); %-style arguments, never an
    f-string (ruff's G rules, switched on in pyproject.toml)."""
    bad = []
    for mod, path in MODULES.items():
        tree = ast.parse(path.read_text())
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
        names = [ast.unparse(n) for n in calls if n.func.attr == "getLogger"]
        logs = [n for n in calls if isinstance(n.func.value, ast.Name) and n.func.value.id == "logger"]
        imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names
                    if a.name == "logger"]
        allowed = {"logging.getLogger(__name__)"} | ({"logging.getLogger('lmprobe')"}
                                                     if mod == "lmprobe.base.progress" else set())
        if imported:
            bad.append(f"{mod} imports another module's logger")
        if set(names) - allowed:
            bad.append(f"{mod} calls {sorted(set(names) - allowed)}")
        if logs and "logging.getLogger(__name__)" not in names:
            bad.append(f"{mod} logs without logger = logging.getLogger(__name__)")
        bad += [f"{mod}:{n.lineno} formats its message itself" for n in logs
                if n.args and isinstance(n.args[0], (ast.JoinedStr, ast.BinOp))]
    assert not bad, "\n".join(bad)
    import tomllib

    select = tomllib.loads((PKG.parent / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]["select"]
    assert "G" in select, "ruff's logging-format rules (G) are off"


def test_a_message_of_any_module_reaches_the_lmprobe_loggers_handler(capsys):
    import logging

    from lmprobe.base.progress import messages_shown

    with messages_shown():
        logging.getLogger("lmprobe.probe.folds").info("from %s", "a child")
    assert capsys.readouterr().err == "from a child\n"


def test_no_function_past_100_lines():
    """A function reads as named steps: none runs past 100 lines (a long one is split into the steps it takes)."""
    long = []
    for mod, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > 100:
                    long.append(f"{mod}.{node.name}: {length} lines")
    assert not long, "functions past 100 lines:\n" + "\n".join(long)


def test_tests_and_code_name_behaviour_not_issue_numbers():
    """A test says what behaviour it holds, and a comment what the code does: no "issue NN" in lmprobe/, tests/ or
    benchmarks/ (the tracker's numbers mean nothing to a reader of the code)."""
    import re

    pattern = re.compile(r"\bissues?\s*#?\d+", re.IGNORECASE)
    bad = [f"{p.relative_to(PKG.parent)}:{i}: {line.strip()}"
           for p in _source_files("lmprobe", "tests", "benchmarks")
           for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not bad, "\n".join(bad)


# ------------------------------------------------------------------------------------- the tests mirror the package
TESTS = PKG.parent / "tests"
#: folders of tests/ that hold no layer's tests, each with what it holds
FEATURE_FOLDERS = {
    "package": "the package as a whole: its layers, imports and conventions (this file)",
    "docs": "the README and docs/: their commands and snippets run, and every module's doctests pass",
}
#: folders of tests/ that hold no tests: helpers, data, third-party code run in environments of its own
NOT_TESTS = {"support", "data", "reference", "_screenshots", "__pycache__"}


def _test_tree() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if p.relative_to(TESTS).parts[0] not in ("reference",))


def test_every_test_module_sits_in_the_folder_of_its_layer_or_feature():
    """A reader finds a module's tests by its folder: tests/format/ for lmprobe/format/, and so on (huggingface_hub's
    and saev's tests read the same way); the few that test no layer live in a named feature folder."""
    layers = {p.name for p in PKG.iterdir() if p.is_dir() and p.name != "__pycache__"}
    allowed = layers | set(FEATURE_FOLDERS)
    bad = [str(p.relative_to(PKG.parent)) for p in _test_tree() if p.name.startswith("test_")
           and (len(p.relative_to(TESTS).parts) != 2 or p.relative_to(TESTS).parts[0] not in allowed)]
    assert not bad, ("test modules outside tests/<layer or feature>/ (layers: lmprobe's folders; features: "
                     f"{sorted(FEATURE_FOLDERS)}):\n" + "\n".join(bad))
    stray = sorted({p.name for p in TESTS.iterdir() if p.is_dir()} - allowed - NOT_TESTS)
    assert not stray, f"folders of tests/ that are neither a layer, a feature nor {sorted(NOT_TESTS)}: {stray}"
    text = (PKG.parent / "docs" / "architecture.md").read_text()
    missing = [f"tests/{folder}/" for folder in [*FEATURE_FOLDERS, "support"] if f"`tests/{folder}/`" not in text]
    assert not missing, f"docs/architecture.md's \"Tests\" does not name {missing}"


def test_helpers_live_in_tests_support():
    """Test modules and conftest.py files aside, every module under tests/ is a helper, and helpers live apart, in
    tests/support/ (tests/reference/ holds third-party readers run in environments of their own)."""
    bad = [str(p.relative_to(PKG.parent)) for p in _test_tree()
           if not p.name.startswith("test_") and p.name != "conftest.py" and p.relative_to(TESTS).parts[0] != "support"]
    assert not bad, "helper modules outside tests/support/:\n" + "\n".join(bad)
    plain = [f"{p.relative_to(PKG.parent)}:{node.lineno} {node.name}" for p in TESTS.rglob("conftest.py")
             for node in ast.parse(p.read_text()).body if isinstance(node, (ast.FunctionDef, ast.ClassDef))
             and not any("fixture" in ast.unparse(d) for d in getattr(node, "decorator_list", []))]
    assert not plain, "conftest.py holds fixtures only; helpers go to tests/support/:\n" + "\n".join(plain)


def test_tests_import_helpers_from_support_not_from_conftest_or_other_tests():
    """conftest.py holds fixtures only, and a test module is no library: what a test imports comes from
    tests/support/ (``from support.datasets import write_dataset``), found by its name wherever the test runs from,
    not by pytest's rootdir or by the folder of another test."""
    bad = []
    for p in _test_tree():
        for node in ast.walk(ast.parse(p.read_text())):
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else
                     [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            bad += [f"{p.relative_to(PKG.parent)}:{node.lineno} imports {name}" for name in names
                    if (name or "").split(".")[0] == "conftest" or (name or "").startswith("test_")]
    assert not bad, "imports of conftest or of a test module (move the helper to tests/support/):\n" + "\n".join(bad)
