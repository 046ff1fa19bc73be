"""The package as a package: the import graph (the layers below, top to bottom: no module imports a higher
layer, no cycle, function-level imports counted; only the torchtitan adapter, qwen3_research.titan.*, imports
torchtitan), ARCHITECTURE.md lists every module in its layer, the adapter's two API modules, ``pip install -e .
--no-deps`` on the Pythons torch-neuronx 2.14 supports (3.12, 3.13), and a non-editable install that runs the
CLI."""

from __future__ import annotations

import ast
import fnmatch
import json
import re
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


# The package's layers, top to bottom (ARCHITECTURE.md says what each holds). A module may import modules of its
# own layer (without a cycle) and of the layers below it, never one above; every import statement counts, those
# inside functions too. Lazy imports of other packages (torch, torchtitan, transformers, wandb, ...) are not
# edges of this graph. Each pattern is an fnmatch pattern over dotted module names; every module matches one.
LAYERS: list[tuple[str, list[str]]] = [
    ("entry points", ["qwen3_research.__main__", "qwen3_research.plan", "qwen3_research.doctor",
                      "qwen3_research.verify_kernels", "qwen3_research.export", "qwen3_research.compare"]),
    ("launch", ["qwen3_research.launch", "qwen3_research.launch.*"]),
    ("recipe", ["qwen3_research.trainer", "qwen3_research.planner", "qwen3_research.fit"]),
    ("run state", ["qwen3_research.resolve", "qwen3_research.run", "qwen3_research.run.*"]),
    ("components", ["qwen3_research.models", "qwen3_research.models.*", "qwen3_research.kernels",
                    "qwen3_research.kernels.*", "qwen3_research.hf_interop", "qwen3_research.hf_interop.*",
                    "qwen3_research.parallel", "qwen3_research.data", "qwen3_research.loss", "qwen3_research.optim",
                    "qwen3_research.memory", "qwen3_research.profiling", "qwen3_research.metrics", "qwen3_research.report",
                    "qwen3_research.neuron_host", "qwen3_research.routing", "qwen3_research.token_stream",
                    "qwen3_research.compiling"]),
    ("adapters", ["qwen3_research.titan", "qwen3_research.titan.*", "qwen3_research.device",
                  "qwen3_research.compose", "qwen3_research.slurm", "qwen3_research.signals", "qwen3_research.startup",
                  "qwen3_research.allocator"]),
    ("base", ["qwen3_research", "qwen3_research.config", "qwen3_research.errors", "qwen3_research.host"]),
]


def layer_of(module: str) -> list[int]:
    """Indexes (0 = top) of the layers whose patterns match ``module``: exactly one for a listed module."""
    return [i for i, (_, patterns) in enumerate(LAYERS) if any(fnmatch.fnmatchcase(module, pat) for pat in patterns)]


def edges(files: dict[str, Path], *, deferred: bool = True) -> dict[str, dict[str, int]]:
    """importer -> {imported module of ``files``: first line}, one edge per import statement's target:
    ``import a.b`` -> a.b; ``from a import b`` -> a.b when that is a module, else a (a name a defines).
    ``deferred``: count imports inside functions too (the rule does); else only module-level ones.
    Importing a submodule runs its package's ``__init__`` first, which is not an edge of its own (a package
    importing its own modules is no cycle)."""
    out: dict[str, dict[str, int]] = {m: {} for m in files}
    for name, p in files.items():
        tree = ast.parse(p.read_text(), filename=str(p))
        top = set(map(id, tree.body))
        for node in tree.body:
            if isinstance(node, (ast.If, ast.Try)):
                top |= {id(n) for n in ast.walk(node)}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or (not deferred and id(node) not in top):
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:  # relative: from the package of this module
                    package = name.split(".") if p.name == "__init__.py" else name.split(".")[:-1]
                    mod = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in files else mod for a in node.names]
            for t in targets:
                if t in files and t != name:
                    out[name].setdefault(t, node.lineno)
    return out


def import_graph(files: dict[str, Path], *, deferred: bool = True) -> dict[str, set[str]]:
    """Import edges between the given modules (function-level ones too unless ``deferred=False``)."""
    return {m: set(targets) for m, targets in edges(files, deferred=deferred).items()}


def upward_edges(files: dict[str, Path]) -> list[str]:
    """Every import of a module in a higher layer, function-level ones included, as 'a:line imports b (layer
    x -> layer y)'."""
    out = []
    for name, targets in edges(files).items():
        for target, line in sorted(targets.items()):
            (mine,), (theirs,) = layer_of(name), layer_of(target)
            if theirs < mine:
                out.append(f"{name}:{line} imports {target} ({LAYERS[mine][0]} -> {LAYERS[theirs][0]}, a higher layer)")
    return out


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


def test_every_module_is_in_one_layer():
    """The layer list covers the package: each module matches exactly one layer's patterns."""
    mods = our_modules()
    misplaced = {m: [LAYERS[i][0] for i in layer_of(m)] for m in mods if len(layer_of(m)) != 1}
    print(f"\n{len(mods)} modules in {len(LAYERS)} layers; not in exactly one: {misplaced or 'none'}")
    assert misplaced == {}


def test_no_cycles_and_no_upward_imports():
    """Every import statement between the package's modules, those inside functions included: no cycle, and no
    module imports one of a higher layer. Prints the layers it enforces, top to bottom."""
    mods = our_modules()
    graph = import_graph(mods)
    top_level = sum(map(len, import_graph(mods, deferred=False).values()))
    cycles, upward = find_cycles(graph), upward_edges(mods)
    print("\nlayers, top to bottom (a module imports its own layer without a cycle, or lower layers):")
    for i, (layer, patterns) in enumerate(LAYERS):
        print(f"  L{len(LAYERS) - i} {layer}: {', '.join(pat.removeprefix('qwen3_research.') for pat in patterns)}")
    print(f"{len(graph)} modules, {sum(map(len, graph.values()))} import edges between them ({top_level} at module level, "
          f"the rest inside functions); cycles: {len(cycles)}; upward imports: {len(upward)}")
    assert top_level > 10 and sum(map(len, graph.values())) > top_level  # the scan sees both kinds
    problems = ([f"{len(upward)} upward import(s) (a module imports one of a higher layer):", *upward] if upward else []) + (
        [f"{len(cycles)} import cycle(s):", *cycles] if cycles else [])
    assert not problems, "\n".join(problems)


def test_architecture_md_lists_every_module_in_its_layer():
    """ARCHITECTURE.md has one section per layer (``## L<n> <name>``, top to bottom, as LAYERS) and one line per
    module (`qwen3_research/<path>.py`) in its layer's section; no module is missing, none listed is absent."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    sections = re.findall(r"^## L(\d+) (.+)$", text, flags=re.M)
    assert [(int(n), name.strip()) for n, name in sections] == [(len(LAYERS) - i, name) for i, (name, _) in enumerate(LAYERS)]
    listed: dict[str, int] = {}
    for i, block in enumerate(re.split(r"^## L\d+ .+$", text, flags=re.M)[1:]):
        for path in re.findall(r"^- `(qwen3_research/[\w/]+\.py)`", block, flags=re.M):
            listed[module_name(ROOT / path)] = i
    mods = our_modules()
    missing, absent = sorted(set(mods) - set(listed)), sorted(set(listed) - set(mods))
    wrong = {m: (LAYERS[i][0], LAYERS[layer_of(m)[0]][0]) for m, i in listed.items() if m in mods and layer_of(m) != [i]}
    print(f"\nARCHITECTURE.md: {len(listed)} modules listed; missing: {missing or 'none'}; not in the tree: "
          f"{absent or 'none'}; in another layer's section (listed, enforced): {wrong or 'none'}")
    assert missing == [] and absent == [] and wrong == {}


def test_the_scans_can_fail(tmp_path):
    """Planted: a function-level torchtitan import, an a -> b -> a cycle made of module-level and function-level
    imports, and a deferred upward import (config, the base layer, importing the trainer inside a function):
    each is reported."""
    (tmp_path / "a.py").write_text("from qwen3_research import b\n")
    (tmp_path / "b.py").write_text("def g():\n    import qwen3_research.a\n\ndef f():\n    from torchtitan.models import qwen3\n")
    (tmp_path / "config.py").write_text("def f():\n    from qwen3_research.trainer import Trainer\n")
    (tmp_path / "trainer.py").write_text("from qwen3_research import config\n")
    files = {"qwen3_research.a": tmp_path / "a.py", "qwen3_research.b": tmp_path / "b.py"}
    assert torchtitan_importers(files) == ["qwen3_research.b:5 imports torchtitan.models",
                                           "qwen3_research.b:5 imports torchtitan.models.qwen3"]
    assert find_cycles(import_graph(files)) == ["qwen3_research.a -> qwen3_research.b -> qwen3_research.a"]
    assert find_cycles(import_graph(files, deferred=False)) == []  # what the module-level-only scan missed
    planted = {"qwen3_research.config": tmp_path / "config.py", "qwen3_research.trainer": tmp_path / "trainer.py"}
    assert upward_edges(planted) == ["qwen3_research.config:2 imports qwen3_research.trainer (base -> recipe, a "
                                     "higher layer)"]
    assert find_cycles(import_graph(planted)) == ["qwen3_research.config -> qwen3_research.trainer -> "
                                                  "qwen3_research.config"]


# -- conf/ at the repository root, installed as qwen3_research.conf --------------------------------
CONF = ROOT / "conf"
CONF_GROUPS = ("model", "parallelism", "kernels", "optimizer", "data", "device", "experiment")
# One --cfg job command, compared between the checkout and each install (several groups, a preset, a key).
CFG_JOB = ["--cfg", "job", "model=native_moe", "parallelism=fsdp", "kernels=moe_fast", "experiment=trn2_smoke",
           "device=cpu", "training.steps=7"]


def copy_project(src: Path) -> Path:
    """What a build reads, copied (so a build writes nothing into the checkout): the package, conf/ (installed as
    qwen3_research.conf) and the files setuptools takes its metadata and package list from."""
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in ("qwen3_research", "conf"):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    return src


def cfg_job(python: str, cwd: Path, env: dict) -> str:
    """``python -m qwen3_research --cfg job ...`` (CFG_JOB) as printed; asserts it exits 0."""
    proc = subprocess.run([python, "-m", "qwen3_research", *CFG_JOB], capture_output=True, text=True, timeout=300,
                          cwd=cwd, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_conf_is_at_the_root_with_each_group():
    """``ls conf``: the config groups sit at the repository root (the schema stays in qwen3_research/config.py),
    each a folder holding YAML options; the package holds no second copy, and the checkout composes from it."""
    from qwen3_research.compose import CONF_DIR

    listing = sorted(p.name for p in CONF.iterdir())
    options = {g: sorted(p.stem for p in (CONF / g).glob("*.yaml")) for g in CONF_GROUPS if (CONF / g).is_dir()}
    print(f"\nls conf: {' '.join(listing)}\n" + "\n".join(f"  {g}: {', '.join(o)}" for g, o in options.items())
          + f"\nCONF_DIR={CONF_DIR}")
    assert (CONF / "config.yaml").is_file() and not (PKG / "conf").exists()
    assert [g for g in CONF_GROUPS if not options.get(g)] == []
    assert Path(CONF_DIR) == CONF


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
    src = copy_project(tmp_path / "src")
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

    src, target, elsewhere = copy_project(tmp_path / "src"), tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
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
    # The same config as the checkout: the installed copy run outside it, the checkout run in it
    installed, checkout = cfg_job(sys.executable, elsewhere, env), cfg_job(sys.executable, ROOT, cli_env(PYTHONPATH=str(ROOT)))
    print(f"--cfg job {' '.join(CFG_JOB[2:])}: installed {len(installed.splitlines())} lines, checkout "
          f"{len(checkout.splitlines())} lines, equal: {installed == checkout}")
    assert installed == checkout and "moe" in installed
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["steps"] == 2


@pytest.mark.slow
def test_editable_install_composes_the_checkouts_config(tmp_path):
    """``pip install -e . --no-deps`` into a fresh venv of the project's Python, with the project's
    dependencies reached through a .pth file (not its editable install of this checkout): setuptools maps
    conf/ to qwen3_research.conf, the package is imported from the copied project, CONF_DIR is that copy's conf/,
    and ``--cfg job`` run outside any checkout prints what the checkout prints."""
    import sysconfig

    from tests.conftest import cli_env

    src, venv, elsewhere = copy_project(tmp_path / "src"), tmp_path / "venv", tmp_path / "elsewhere"
    elsewhere.mkdir()
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "project_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # torch, hydra, ... (no .pth run)
    proc = subprocess.run([python, "-m", "pip", "install", "-q", "-e", str(src), "--no-deps"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    env = {k: v for k, v in cli_env().items() if k != "PYTHONPATH"}  # the venv's own finding
    where = subprocess.run([python, "-c", "import qwen3_research.compose as c; print(c.__file__, c.CONF_DIR)"],
                           capture_output=True, text=True, timeout=120, cwd=elsewhere, env=env)
    installed, checkout = cfg_job(python, elsewhere, env), cfg_job(sys.executable, ROOT, cli_env(PYTHONPATH=str(ROOT)))
    print(f"\neditable: compose, CONF_DIR = {where.stdout.strip()}; --cfg job {' '.join(CFG_JOB[2:])} equal to the "
          f"checkout's: {installed == checkout}")
    assert where.returncode == 0, where.stderr[-2000:]
    module, conf_dir = where.stdout.split()
    assert module == str(src / "qwen3_research" / "compose.py") and conf_dir == str(src / "conf")
    assert installed == checkout and "moe" in installed
