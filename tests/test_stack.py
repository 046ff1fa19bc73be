"""The package as a package: the import graph (only the torchtitan adapter, qwen3_research.titan.*, imports
torchtitan; no cycles), the adapter's two API modules, ``pip install -e . --no-deps`` on the Pythons
torch-neuronx 2.14 supports (3.12, 3.13), and a non-editable install that runs the CLI."""

from __future__ import annotations

import ast
import json
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


def in_adapter(name: str) -> bool:
    """The torchtitan adapter: the facade qwen3_research.titan and its modules (common, v02, v03)."""
    return name == "qwen3_research.titan" or name.startswith("qwen3_research.titan.")


def torchtitan_importers(files: dict[str, Path]) -> list[str]:
    return [
        f"{name}:{line} imports {mod}"
        for name, p in files.items() if not in_adapter(name)
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
    """Every import statement of the package, function-level ones included: torchtitan only in the adapter
    (qwen3_research.titan.*); the rest of the package imports the facade, never its modules."""
    mods = our_modules()
    offenders = torchtitan_importers(mods)
    titan_imports = {m for name, p in mods.items() if in_adapter(name)
                     for m, _, _ in imports(p, name) if m.startswith("torchtitan")}
    past_facade = [f"{name} imports {m}" for name, p in mods.items() if not in_adapter(name)
                   for m, _, _ in imports(p, name) if m.startswith("qwen3_research.titan.")]
    print(f"\n{len(mods)} modules scanned; qwen3_research.titan.* imports {len(titan_imports)} torchtitan names; "
          f"other modules: {offenders or 'none'}; past the facade: {past_facade or 'none'}")
    assert len(mods) > 20 and titan_imports  # the scan sees function-level imports (the adapter has only those)
    assert offenders == [] and past_facade == []


def test_titan_api_modules_provide_the_same_names():
    """The facade binds one API module per process (v03 or v02): both define every name of titan.API, and
    the facade re-exports them, so the rest of the package runs on either torchtitan."""
    from qwen3_research import titan
    from qwen3_research.titan import v02, v03

    missing = {m.__name__: [n for n in titan.API if not callable(getattr(m, n, None))] for m in (v02, v03)}
    unbound = [n for n in titan.API if n != "unpadded_experts_forward" and getattr(titan, n) is not getattr(titan.api, n)]
    print(f"\n{len(titan.API)} API names; bound to {titan.api.__name__} (legacy={titan.legacy()}); "
          f"missing: {missing}; not re-exported: {unbound or 'none'}")
    assert missing == {"qwen3_research.titan.v02": [], "qwen3_research.titan.v03": []} and unbound == []


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


@pytest.mark.slow
def test_non_editable_install_runs_the_cli(tmp_path):
    """``pip install . --no-deps`` as a regular (non-editable) install: the package is copied, ``conf/`` with it
    as package data. The project's interpreter (it has the dependencies) then runs ``python -m qwen3_research
    training.steps=2`` from a directory outside any checkout with only that install on PYTHONPATH: the run
    composes the shipped configs (compose.CONF_DIR inside the installed package) and trains."""
    from tests.conftest import cli_env

    src, target, elsewhere = tmp_path / "src", tmp_path / "site", tmp_path / "elsewhere"
    src.mkdir()
    elsewhere.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(PKG, src / "qwen3_research", ignore=shutil.ignore_patterns("__pycache__"))
    # An isolated build (setuptools>=68 as pyproject.toml asks, like the editable test above) into a target dir
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                           str(src)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shipped = sorted(p.relative_to(target).as_posix() for p in (target / "qwen3_research" / "conf").rglob("*.yaml"))
    env = cli_env(PYTHONPATH=str(target))
    where = subprocess.run([sys.executable, "-c", "import qwen3_research.compose as c; print(c.CONF_DIR)"],
                           capture_output=True, text=True, timeout=120, cwd=elsewhere, env=env)
    run_dir = tmp_path / "run"
    run = subprocess.run([sys.executable, "-m", "qwen3_research", "training.steps=2", "data.seq_len=32",
                          "data.batch_size=2", "training.eval_every=0", "logging.print_config=false",
                          "logging.wandb.mode=disabled", f"hydra.run.dir={run_dir}"],
                         capture_output=True, text=True, timeout=600, cwd=elsewhere, env=env)
    print(f"\n{len(shipped)} config files installed (e.g. {shipped[0]}); CONF_DIR={where.stdout.strip()}; "
          f"run: exit {run.returncode}, {(run.stdout.strip().splitlines() or [''])[-1][:100]}")
    assert where.returncode == 0 and where.stdout.strip() == str(target / "qwen3_research" / "conf"), where.stderr
    assert "qwen3_research/conf/config.yaml" in shipped and len(shipped) >= 30
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["steps"] == 2
