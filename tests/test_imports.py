"""The package layout: no import cycle, every module imports on its own and in any order, no
module over ~400 lines, no CLI module imported as a library."""

import ast
import importlib.util
import random
import subprocess
import sys
from pathlib import Path

import pytest

from testenv import subprocess_env
ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jaxmem", "experiments")


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def project_imports(name: str, path: Path) -> set[str]:
    """Project modules imported anywhere in the module (a deferred, function-level import is a
    dependency too: two modules that import each other that way are still one tangle)."""
    tree = ast.parse(path.read_text())
    found = set()
    base = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                mod = ".".join(base.split(".")[: len(base.split(".")) - node.level + 1] + [mod]).strip(".")
            found.add(mod)
            found |= {f"{mod}.{a.name}" for a in node.names}
    return {m for m in found if m.split(".")[0] in PACKAGES}


def test_no_import_cycle_between_modules():
    mods = modules()
    graph = {m: {d for d in project_imports(m, p) if d in mods and d != m} for m, p in mods.items()}
    # (Python also runs a package's __init__ before its modules; an __init__ that re-exports its
    # own modules is not a cycle, so that implicit edge is left out.)
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)


def importable() -> list[str]:
    has_torch = importlib.util.find_spec("torch") is not None
    needs_torch = {m for m, p in modules().items() if "import torch" in p.read_text()}
    return [m for m in modules() if not m.endswith("__main__") and (has_torch or m not in needs_torch)]


@pytest.mark.parametrize("order", ["sorted", "reversed", "shuffled"])
def test_every_module_imports_in_any_order(order):
    names = importable()
    if order == "reversed":
        names = names[::-1]
    elif order == "shuffled":
        random.Random(0).shuffle(names)
    code = "import importlib\nfor m in %r:\n    importlib.import_module(m)\n" % names
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env=subprocess_env())
    assert p.returncode == 0, p.stderr[-2000:]


def test_modules_are_small_and_cli_modules_are_not_libraries():
    mods = modules()
    big = {m: n for m, p in mods.items() if (n := len(p.read_text().splitlines())) > 420}
    assert not big, big
    cli = {m for m in mods if m.endswith(".cli") or m.endswith("__main__")}
    for m, p in mods.items():
        if m in cli:
            continue
        imported = set()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module)
        assert not (imported & cli) or m.endswith("__main__"), (m, imported & cli)


def test_guide_layout_table_names_every_package():
    """docs/guide.md's layout table (the README's before it became the front page) names every
    package and top-level module of jaxmem."""
    guide = (ROOT / "docs" / "guide.md").read_text()
    table = guide[guide.index("## How it is built"):]
    top = sorted(p.name + ("/" if p.is_dir() else "") for p in (ROOT / "jaxmem").iterdir()
                 if (p.is_dir() and (p / "__init__.py").exists())
                 or (p.suffix == ".py" and p.name != "__init__.py"))
    missing = [name for name in top if f"`jaxmem/{name}`" not in table]
    assert not missing, f"docs/guide.md's layout table lacks {missing}"


def tiers() -> list[tuple[str, list[str]]]:
    """The tiers docs/architecture.md draws, bottom first: its `tier NAME: a, b.c, ...` lines,
    each naming the packages and modules (relative to jaxmem) that sit on that tier."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    out = []
    for line in doc.splitlines():
        line = line.strip(" `")
        if line.startswith("tier ") and ":" in line:
            name, _, names = line[len("tier "):].partition(":")
            out.append((name.strip(), [n.strip() for n in names.split(",") if n.strip()]))
    return out


def tier_of(module: str, order: list[tuple[str, list[str]]]) -> int | None:
    """The tier of a jaxmem module: that of the longest listed name it is or sits inside
    (jaxmem.xla.analysis -> `xla.analysis`'s, jaxmem.memory.cli -> `memory`'s); None for
    the root package and for names outside jaxmem."""
    parts = module.split(".")
    if parts[0] != "jaxmem" or len(parts) == 1:
        return None
    rel, best = ".".join(parts[1:]), None
    for i, (_, names) in enumerate(order):
        for n in names:
            if (rel == n or rel.startswith(n + ".")) and (best is None or len(n) > best[1]):
                best = (i, len(n))
    return best and best[0]


def test_every_module_imports_its_own_tier_or_lower():
    """Each module of jaxmem/ imports only modules on its own tier or below (a deferred import
    inside a function, or one for annotations, counts): the building blocks import none of the
    model, the model none of data / io / parallel, those none of the trainer, the trainer none
    of the apps. The root `jaxmem/__init__.py` re-exports the public modules lazily and is left
    out."""
    order = tiers()
    assert [n for n, _ in order] == ["blocks", "model", "data, io, parallel", "trainer", "apps"], order
    mods = {m: p for m, p in modules().items() if m.startswith("jaxmem.")}
    untiered = sorted(m for m in mods if tier_of(m, order) is None)
    assert not untiered, f"docs/architecture.md's tiers do not place {untiered}"
    wrong = []
    for m, p in mods.items():
        a = tier_of(m, order)
        for d in project_imports(m, p):
            b = tier_of(d, order)
            if b is not None and b > a:
                wrong.append(f"{m} ({order[a][0]}) imports {d} ({order[b][0]})")
    assert not wrong, "\n".join(sorted(set(wrong)))


def test_no_two_packages_import_each_other():
    """Across packages the imports form no cycle either (a module-level cycle is caught above;
    this is the coarser tangle of package a importing b while b imports a). An app module the
    apps tier names inside a lower tier's package (train.cli: `--dry-run` prints the planner's
    plan) is a node of its own, as the tiers draw it, not part of the trainer package."""
    mods = {m: p for m, p in modules().items() if m.startswith("jaxmem.")}
    apps = [n for n in dict(tiers())["apps"] if "." in n]

    def pkg(m):
        rel = m.split(".", 1)[1] if "." in m else None
        own = [n for n in apps if rel is not None and (rel == n or rel.startswith(n + "."))]
        return own[0] if own else (rel.split(".")[0] if rel else None)

    graph = {}
    for m, p in mods.items():
        for d in project_imports(m, p):
            if pkg(d) and pkg(m) and pkg(d) != pkg(m) and d.startswith("jaxmem."):
                graph.setdefault(pkg(m), set()).add(pkg(d))
    state = {}

    def visit(a, path):
        state[a] = "open"
        for b in sorted(graph.get(a, ())):
            assert state.get(b) != "open", "package cycle: " + " -> ".join(path + [b])
            if b not in state:
                visit(b, path + [b])
        state[a] = "done"

    for a in sorted(graph):
        if a not in state:
            visit(a, [a])


def _deferred_imports(tree: ast.Module) -> list[ast.stmt]:
    """Import statements inside a function (not at module level)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out += [n for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))]
    return out


def test_the_planner_asks_the_step_instead_of_importing_its_rules():
    """Issue 51's seam: jaxmem/memory/ asks jaxmem.train for the step's footprint instead of
    importing its rules function by function (17 imports and 27 deferred imports at 802ea89):
    fewer than 10 of each, no planner module over 350 lines, and no mode name ("host",
    "none", ...) compared as a string: the trainer's Placement and config answer those."""
    planner = sorted((ROOT / "jaxmem" / "memory").glob("*.py"))
    trees = {p.name: ast.parse(p.read_text()) for p in planner}
    train = [f"{n}:{node.lineno}" for n, t in trees.items() for node in ast.walk(t)
             if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxmem.train")
             or isinstance(node, ast.Import) and any(a.name.startswith("jaxmem.train")
                                                     for a in node.names)]
    assert len(train) < 10, train
    deferred = [f"{n}:{node.lineno}" for n, t in trees.items() for node in _deferred_imports(t)]
    assert len(deferred) < 10, deferred
    long = {p.name: n for p in planner if (n := len(p.read_text().splitlines())) > 350}
    assert not long, long
    modes = {"host", "none", "pinned_host", "device"}
    compared = []
    for n, t in trees.items():
        for node in ast.walk(t):
            if isinstance(node, ast.Compare):
                consts = [c for c in [node.left, *node.comparators]
                          for c in (c.elts if isinstance(c, (ast.Tuple, ast.List, ast.Set))
                                    else [c])]
                if any(isinstance(c, ast.Constant) and c.value in modes for c in consts):
                    compared.append(f"{n}:{node.lineno}")
    assert not compared, compared
