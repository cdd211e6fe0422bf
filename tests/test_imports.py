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


def test_readme_layout_table_names_every_package():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## How it is built"):]
    top = sorted(p.name + ("/" if p.is_dir() else "") for p in (ROOT / "jaxmem").iterdir()
                 if (p.is_dir() and (p / "__init__.py").exists())
                 or (p.suffix == ".py" and p.name != "__init__.py"))
    missing = [name for name in top if f"`jaxmem/{name}`" not in table]
    assert not missing, f"README's layout table lacks {missing}"


def layers() -> list[set[str]]:
    """The package order docs/architecture.md states, bottom first: its `layers:` line, e.g.
    `layers: dtypes, config -> model -> ...` (a comma joins packages on one level)."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    line = next(s for s in doc.splitlines() if s.strip(" `").startswith("layers:"))
    return [{p.strip() for p in level.split(",")}
            for level in line.split("layers:", 1)[1].strip(" `").split("->")]


def package_of(module: str) -> str | None:
    """jaxmem.train.loop -> 'train'; jaxmem.perf -> 'perf'; the root jaxmem -> None."""
    parts = module.split(".")
    return parts[1] if parts[0] == "jaxmem" and len(parts) > 1 else None


def test_packages_import_downward_only():
    """Each package of jaxmem/ imports only packages on lower levels of the stated order (a
    deferred import inside a function counts), so no two packages import each other and any
    part imports without what sits above it (the optimizer without the trainer, the sampler
    without the CLI). The root `jaxmem/__init__.py` re-exports public names lazily and is left
    out."""
    order = layers()
    level = {p: i for i, ps in enumerate(order) for p in ps}
    mods = {m: p for m, p in modules().items() if m.startswith("jaxmem.")}
    packages = {package_of(m) for m in mods}
    assert packages <= set(level), f"docs/architecture.md's layers line lacks {packages - set(level)}"
    wrong = []
    for m, p in mods.items():
        a = package_of(m)
        for d in project_imports(m, p):
            b = package_of(d)
            if b is not None and b != a and level[b] >= level[a]:
                wrong.append(f"{m} imports {d} ({a} is not above {b})")
    assert not wrong, "\n".join(sorted(set(wrong)))



def test_readme_states_the_same_package_order():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    line = next(s for s in doc.splitlines() if s.strip(" `").startswith("layers:"))
    order = line.split("layers:", 1)[1].strip(" `")
    readme = " ".join((ROOT / "README.md").read_text().replace("`", "").split())
    assert order in readme, f"README should state the package order of docs/architecture.md: {order}"
