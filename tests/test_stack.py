"""The package as a package: the import graph (only titan.py imports torchtitan; no cycles) and
``pip install -e . --no-deps`` on the Pythons torch-neuronx 2.14 supports (3.12, 3.13)."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

PKG = ROOT / "qwen3_research"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, me: str | None = None) -> list[tuple[str, int, bool]]:
    """(imported module, line, at module level?) for every import statement, in functions too.

    ``from a.b import c`` yields ``a.b`` and ``a.b.c`` (which is a module when ``c`` is one).
    Statements under a module-level ``if``/``try`` count as module level.
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    top = set(map(id, tree.body))
    for node in tree.body:
        if isinstance(node, (ast.If, ast.Try)):
            top |= {id(n) for n in ast.walk(node)}
    me = me or module_name(path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package of this module
                package = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
                base = package[: len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((mod, node.lineno, id(node) in top))
            out += [(f"{mod}.{a.name}", node.lineno, id(node) in top) for a in node.names]
    return out


def our_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def torchtitan_importers(files: dict[str, Path]) -> list[str]:
    return [
        f"{name}:{line} imports {mod}"
        for name, p in files.items() if name != "qwen3_research.titan"
        for mod, line, _ in imports(p, name) if mod == "torchtitan" or mod.startswith("torchtitan.")
    ]


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """Module-level import edges between the given modules."""
    graph: dict[str, set[str]] = {m: set() for m in files}
    for name, p in files.items():
        found = [mod for mod, _, at_top in imports(p, name) if at_top and mod in files and mod != name]
        # ``from pkg import sub`` needs the module pkg.sub, not what pkg/__init__ defines after it
        # (a package's __init__ importing its own submodules is no cycle).
        graph[name] |= {m for m in found if not any(f.startswith(m + ".") for f in found)}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[str]:
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return cycles


def test_only_titan_imports_torchtitan():
    """Every import statement of the package, function-level ones included: torchtitan only in titan.py."""
    mods = our_modules()
    offenders = torchtitan_importers(mods)
    titan_imports = {m for m, _, _ in imports(PKG / "titan.py") if m.startswith("torchtitan")}
    print(f"\n{len(mods)} modules scanned; titan.py imports {len(titan_imports)} torchtitan names; "
          f"other modules: {offenders or 'none'}")
    assert len(mods) > 20 and titan_imports  # the scan sees function-level imports (titan.py has only those)
    assert offenders == []


def test_no_import_cycles_between_modules():
    """Module-level imports between qwen3_research modules form no cycle. Function-level imports are
    not counted: they are deferred on purpose (e.g. titan -> device inside check_supported) and
    run after both modules exist, so they cannot deadlock or see a half-initialised module."""
    graph = import_graph(our_modules())
    cycles = find_cycles(graph)
    edges = sum(map(len, graph.values()))
    print(f"\n{len(graph)} modules, {edges} module-level import edges between them, cycles: {cycles or 'none'}")
    assert edges > 10  # the scan found the package's real imports
    assert cycles == []


def test_the_scans_can_fail(tmp_path):
    """A planted function-level torchtitan import and a planted a -> b -> a cycle are both reported."""
    (tmp_path / "a.py").write_text("from qwen3_research import b\n")
    (tmp_path / "b.py").write_text("import qwen3_research.a\n\ndef f():\n    from torchtitan.models import qwen3\n")
    files = {"qwen3_research.a": tmp_path / "a.py", "qwen3_research.b": tmp_path / "b.py"}
    assert torchtitan_importers(files) == ["qwen3_research.b:4 imports torchtitan.models",
                                           "qwen3_research.b:4 imports torchtitan.models.qwen3"]
    assert find_cycles(import_graph(files)) == ["qwen3_research.a -> qwen3_research.b -> qwen3_research.a"]


# -- pip install -e . --no-deps on Python 3.12 and 3.13 -----------------------------------------
PYTHONS = {"3.12": "/root/.pyenv/versions/3.12.1/bin/python3.12", "3.13": "/root/.pyenv/versions/3.13.0/bin/python3.13"}


@pytest.mark.slow
@pytest.mark.parametrize("version", sorted(PYTHONS))
def test_editable_install_without_deps(version, tmp_path):
    """torch-neuronx 2.14 runs on Python 3.12-3.14: requires-python admits them and the package installs.

    A copy of the project (so the build writes nothing into the checkout) into a fresh venv;
    --no-deps is how README installs it over a Neuron venv that already has torch.
    """
    # pyenv's shim on PATH fails unless that version is selected: take the first candidate that runs
    candidates = [c for c in (shutil.which(f"python{version}"), PYTHONS[version]) if c]
    python = next((c for c in candidates if subprocess.run([c, "-c", ""], capture_output=True).returncode == 0), None)
    if python is None:
        pytest.skip(f"no working python{version} on this machine (tried {candidates})")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(PKG, src / "qwen3_research", ignore=shutil.ignore_patterns("__pycache__"))
    venv = tmp_path / "venv"
    subprocess.run([python, "-m", "venv", str(venv)], check=True, timeout=120)
    proc = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "-e", str(src), "--no-deps"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = subprocess.run([str(venv / "bin" / "python"), "-c",
                          "import sys, importlib.metadata as m, qwen3_research.errors as e; "
                          "print(sys.version.split()[0], m.version('qwen3-research'), e.__file__)"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})  # the venv's own finding
    print(f"\npython{version}: pip install -e . --no-deps -> {out.stdout.strip()}")
    assert out.returncode == 0, out.stderr[-2000:]
    ver, dist, path = out.stdout.split()
    assert ver.startswith(version + ".") and dist == "0.1.0" and path.startswith(str(src))
