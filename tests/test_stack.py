"""The package as a package: the import graph (the layers below, top to bottom: no module imports a higher
layer, no cycle, function-level imports counted; only the torchtitan adapter, qwen3_research.titan.*, imports
torchtitan), ARCHITECTURE.md lists every module in its layer, the adapter's two API modules, ``pip install -e .
--no-deps`` on the Pythons torch-neuronx 2.14 supports (3.12, 3.13), conf/ at the repository root composing the
same config from a checkout, an editable and a non-editable install, and issue 32's scans: no device-string
comparison outside devices/ and titan/, a planner that patches nothing, imports at the top (deferred ones rare,
reasoned and heavier than their importer), no cycle between folders, a light set without torch."""

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
                      "qwen3_research.verify_kernels", "qwen3_research.export", "qwen3_research.compare",
                      "qwen3_research.config_docs"]),
    ("launch", ["qwen3_research.launch", "qwen3_research.launch.*"]),
    ("recipe", ["qwen3_research.trainer", "qwen3_research.step", "qwen3_research.planner", "qwen3_research.closed_form", "qwen3_research.fit"]),
    ("run state", ["qwen3_research.resolve", "qwen3_research.run", "qwen3_research.run.*"]),
    ("components", ["qwen3_research.models", "qwen3_research.models.*", "qwen3_research.kernels",
                    "qwen3_research.kernels.*",
                    "qwen3_research.parallel", "qwen3_research.data", "qwen3_research.loss", "qwen3_research.pipeline", "qwen3_research.pipeline_trace", "qwen3_research.optim", "qwen3_research.lora",
                    "qwen3_research.lora_params",
                    "qwen3_research.memory", "qwen3_research.profiling", "qwen3_research.metrics", "qwen3_research.report",
                    "qwen3_research.routing", "qwen3_research.token_stream", "qwen3_research.chat", "qwen3_research.chat_sources",
                    "qwen3_research.chat_windows",
                    "qwen3_research.compiling"]),
    ("adapters", ["qwen3_research.titan", "qwen3_research.titan.*", "qwen3_research.devices", "qwen3_research.devices.*",
                  "qwen3_research.compose", "qwen3_research.slurm", "qwen3_research.signals", "qwen3_research.startup",
                  "qwen3_research.allocator", "qwen3_research.tables"]),
    ("base", ["qwen3_research", "qwen3_research.config", "qwen3_research.errors", "qwen3_research.overrides"]),
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


# -- issue 32 (acceptance b): device strings, the planner's patches, deferred imports, folder cycles, the light set --
DEVICE_KINDS = ("cpu", "cuda", "neuron")


def in_devices_or_titan(name: str) -> bool:
    """Where a device string may be compared: the device specs (qwen3_research.devices.*) and the torchtitan adapter."""
    return any(name == pkg or name.startswith(pkg + ".") for pkg in ("qwen3_research.devices", "qwen3_research.titan"))


def _device_string(node: ast.AST) -> str | None:
    """The device kind a constant names ("cuda", "cuda:0"), also inside a tuple / list / set literal."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        kind = node.value.split(":", 1)[0]
        return kind if kind in DEVICE_KINDS and (node.value == kind or node.value[len(kind) + 1:].isdigit()) else None
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return next((k for k in map(_device_string, node.elts) if k), None)
    return None


def device_comparisons(path: Path) -> list[tuple[int, str]]:
    """(line, source) of every comparison with a device string: ``x == "cuda"``, ``x != "cpu"``, ``x in ("cuda",
    "neuron")``, ``x.startswith("cuda")`` / ``endswith``, and ``case "neuron":`` in a ``match``."""
    source = path.read_text()
    tree = ast.parse(source, filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            hit = any(map(_device_string, [node.left, *node.comparators]))
        elif isinstance(node, ast.Call):
            hit = (isinstance(node.func, ast.Attribute) and node.func.attr in ("startswith", "endswith")
                   and any(map(_device_string, node.args)))
        elif isinstance(node, ast.MatchValue):
            hit = bool(_device_string(node.value))
        else:
            continue
        if hit:
            out.append((node.lineno, (ast.get_source_segment(source, node) or "").splitlines()[0][:80]))
    return out


def device_comparisons_outside_devices(files: dict[str, Path]) -> dict[str, list[tuple[int, str]]]:
    """Module -> its device-string comparisons, for every module outside devices/ and titan/ that has one."""
    found = {name: device_comparisons(p) for name, p in files.items() if not in_devices_or_titan(name)}
    return {name: hits for name, hits in found.items() if hits}


def test_no_device_string_comparisons_outside_devices():
    """No ``== "cpu"`` / ``!= "neuron"`` / ``in ("cuda", ...)`` / ``.startswith("cuda")`` / ``case "cuda":``
    outside qwen3_research/devices/ and qwen3_research/titan/: a device's facts are its spec's (issue 32)."""
    mods = our_modules()
    found = device_comparisons_outside_devices(mods)
    inside = sum(len(device_comparisons(p)) for name, p in mods.items() if in_devices_or_titan(name))
    total = sum(map(len, found.values()))
    print(f"\ndevice-string comparisons outside devices/ and titan/: {total} in {len(found)} modules "
          f"(inside them: {inside})")
    for name, hits in sorted(found.items(), key=lambda kv: -len(kv[1])):
        print(f"  {name}: {len(hits)}  " + "; ".join(f"{line}: {src}" for line, src in hits[:4])
              + (" ..." if len(hits) > 4 else ""))
    assert total == 0



# -- issue 39: device calls go through devices/ (torch's device modules, asked by the device's kind) ----------------
DEVICE_MODULES = ("torch.cuda", "torch.neuron")  # and their submodules (torch.cuda.memory, ...)


def _dotted(node: ast.AST) -> str | None:
    """``torch.cuda.memory._dump_snapshot`` for that attribute chain (None when it does not start at a name)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def _in_device_module(dotted: str | None) -> bool:
    return bool(dotted) and any(dotted == m or dotted.startswith(m + ".") for m in DEVICE_MODULES)


def device_calls(path: Path) -> list[tuple[int, str]]:
    """(line, source) of every call into a device's torch module (``torch.cuda.synchronize()``,
    ``torch.cuda.memory._record_memory_history(...)``, ``torch.neuron.memory_allocated(0)``) and every import of one
    (``from torch.cuda import memory``, ``from torch import cuda``, ``import torch.cuda``), which would hide the
    calls behind another name."""
    source = path.read_text()
    out = []
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if isinstance(node, ast.Call):
            hit = _in_device_module(_dotted(node.func))
        elif isinstance(node, ast.ImportFrom):
            hit = _in_device_module(node.module) or (node.module == "torch" and any(
                _in_device_module(f"torch.{a.name}") for a in node.names))
        elif isinstance(node, ast.Import):
            hit = any(_in_device_module(a.name) for a in node.names)
        else:
            continue
        if hit:
            out.append((node.lineno, (ast.get_source_segment(source, node) or "").splitlines()[0][:80]))
    return out


def device_calls_outside_devices(files: dict[str, Path]) -> dict[str, list[tuple[int, str]]]:
    """Module -> its calls into torch.cuda / torch.neuron, for every module outside devices/ that has one (titan/
    included: the torchtitan adapter has no reason to call a device's runtime itself)."""
    found = {name: device_calls(p) for name, p in files.items() if not _in_devices(name)}
    return {name: hits for name, hits in found.items() if hits}


def _in_devices(name: str) -> bool:
    return name == "qwen3_research.devices" or name.startswith("qwen3_research.devices.")


def test_no_device_calls_outside_devices():
    """No ``torch.cuda.*`` / ``torch.neuron.*`` call (or import) outside qwen3_research/devices/: what a device's
    runtime does is asked of devices (``Device``, ``devices.rng_state``, ``devices.record_memory_history``,
    ``devices.device_name``), which reaches it through torch's device module for the run's kind (issue 39)."""
    mods = our_modules()
    found = device_calls_outside_devices(mods)
    inside = sum(len(device_calls(p)) for name, p in mods.items() if _in_devices(name))
    total = sum(map(len, found.values()))
    print(f"\ndevice calls outside devices/: {total} in {len(found)} modules (inside it: {inside})")
    for name, hits in sorted(found.items(), key=lambda kv: -len(kv[1])):
        print(f"  {name}: {len(hits)}  " + "; ".join(f"{line}: {src}" for line, src in hits[:4])
              + (" ..." if len(hits) > 4 else ""))
    assert total == 0

# The planner builds the Trainer's parts with an injected trace device, mesh and gather; it patches nothing but,
# if unavoidable, this one named DTensor propagation seam (the owner class and its attribute).
PLANNER_MODULES = ("qwen3_research.planner", "qwen3_research.fit")
ALLOWED_PLANNER_PATCH = ("ShardingPropagator", "_propagate_tensor_meta_non_cached")


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _dotted(node: ast.AST) -> str:
    return ast.unparse(node)


def planner_patches(path: Path) -> list[str]:
    """'line: what' for every patch of another module's or class's state in ``path``:

    - ``setattr(owner, ...)`` where ``owner`` is an imported name (a module, or a class or function imported
      from one), a class this module defines, or a loop variable (``for owner, name, value in patches``: which
      object it is is decided at run time, so it counts);
    - an assignment (``=``, ``+=``, annotated) or ``del`` of an attribute of an imported name
      (``torch.x.y = ...``, ``dist.all_gather_object = ...``, ``DeviceMesh.__init__ = ...``);
    - ``mock.patch`` / ``patch.object`` calls.

    ``ALLOWED_PLANNER_PATCH`` (one class and attribute, named) is not reported."""
    source = path.read_text()
    tree = ast.parse(source, filename=str(path))
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported |= {a.asname or a.name for a in node.names}
    classes = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    loop_vars = {n.id for node in ast.walk(tree) if isinstance(node, (ast.For, ast.comprehension))
                 for n in ast.walk(node.target) if isinstance(n, ast.Name)}
    owners = imported | classes

    def allowed(owner: ast.AST, attr: str | None) -> bool:
        return (attr == ALLOWED_PLANNER_PATCH[1]
                and (_dotted(owner) == ALLOWED_PLANNER_PATCH[0] or _dotted(owner).endswith("." + ALLOWED_PLANNER_PATCH[0])))

    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            fn = _dotted(node.func)
            if fn == "setattr" and node.args:
                owner = node.args[0]
                attr = node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) else None
                root = _root_name(owner)
                if (root in owners or root in loop_vars) and not allowed(owner, attr):
                    out.append(f"{node.lineno}: {ast.get_source_segment(source, node)}")
            elif fn in ("patch", "patch.object", "mock.patch", "mock.patch.object", "unittest.mock.patch",
                        "unittest.mock.patch.object", "monkeypatch.setattr"):
                owner = node.args[0] if node.args else None
                attr = node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) else None
                if owner is None or not allowed(owner, attr):
                    out.append(f"{node.lineno}: {ast.get_source_segment(source, node)}")
        targets = (node.targets if isinstance(node, (ast.Assign, ast.Delete))
                   else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for target in targets:
            for t in (target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]):
                if isinstance(t, ast.Attribute) and _root_name(t) in imported and not allowed(t.value, t.attr):
                    out.append(f"{t.lineno}: {_dotted(t)} = ... (an attribute of the imported {_root_name(t)})")
    return sorted(set(out), key=lambda s: int(s.split(":")[0]))


def test_the_planner_patches_nothing():
    """planner.py and fit.py: no ``setattr`` on a module or class, no assignment to another module's (or an
    imported class's) attribute, no mock.patch; at most the one named DTensor propagation patch
    (``ALLOWED_PLANNER_PATCH``)."""
    mods = our_modules()
    found = {name: planner_patches(mods[name]) for name in PLANNER_MODULES if name in mods}
    env_writes = {name: [f"{n.lineno}" for n in ast.walk(ast.parse(mods[name].read_text()))
                         if isinstance(n, (ast.Assign, ast.AugAssign)) and "os.environ[" in ast.unparse(n).split("=")[0]]
                  for name in found}
    print(f"\nplanner patches (allowed: {'.'.join(ALLOWED_PLANNER_PATCH)}): "
          f"{sum(map(len, found.values()))}; os.environ writes (lines, reported only): {env_writes}")
    for name, hits in found.items():
        print(f"  {name}: {len(hits)}" + "".join(f"\n    {h}" for h in hits))
    assert found and all(hits == [] for hits in found.values())


# Third-party packages whose import is what start-up avoids (and the platform-only ones: they may be absent).
HEAVY_ROOTS = ("torch", "torchtitan", "transformers", "datasets", "wandb", "safetensors",
               "torch_neuronx", "neuronxcc", "nki", "torch_xla", "triton")
DEFERRED_MAX = 0.15  # of the package's imports of its own modules
DEFERRED_TAG = re.compile(r"#\s*deferred:\s*(\S.*)$")
NOT_A_REASON = re.compile(r"\b(cycle|circular)", re.I)


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and _dotted(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def _top_nodes(tree: ast.Module) -> set[int]:
    """ids of the module-level statements, those under a module-level if/try included (not ``if TYPE_CHECKING``)."""
    top = set(map(id, tree.body))
    for node in tree.body:
        if isinstance(node, (ast.If, ast.Try)) and not _is_type_checking(node):
            top |= {id(n) for n in ast.walk(node)}
    return top


def _targets(node: ast.AST, me: str, is_pkg: bool, files: dict[str, Path], *, parents: bool = False) -> list[str]:
    """The modules an import statement names: ours (resolved as ``edges`` does; ``parents``: with the packages
    importing them runs first) and the top-level names of other packages."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            package = me.split(".") if is_pkg else me.split(".")[:-1]
            mod = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
        else:
            mod = node.module or ""
        names = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in files else mod for a in node.names]  # as ``edges``
    out = []
    for n in names:
        parts = n.split(".")
        if parts[0] == "qwen3_research":
            out += [".".join(parts[:i]) for i in range(1 if parents else len(parts), len(parts) + 1)
                    if ".".join(parts[:i]) in files]
        else:
            out.append(parts[0])
    return out


def own_imports(files: dict[str, Path]) -> list[dict]:
    """Every import statement of one of the package's own modules: importer, line, deferred (inside a function or
    class body, not at module level), its targets, and the ``# deferred: <reason>`` on its lines or the line above."""
    out = []
    for name, p in files.items():
        source = p.read_text()
        lines = source.splitlines()
        tree = ast.parse(source, filename=str(p))
        top = _top_nodes(tree)
        type_only = {id(n) for node in ast.walk(tree) if _is_type_checking(node) for n in ast.walk(node)}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or id(node) in type_only:
                continue
            own = (isinstance(node, ast.ImportFrom) and (node.level > 0 or (node.module or "").split(".")[0] == "qwen3_research")) \
                or (isinstance(node, ast.Import) and any(a.name.split(".")[0] == "qwen3_research" for a in node.names))
            if not own:
                continue
            span = lines[max(0, node.lineno - 2): node.end_lineno]
            reason = next((m.group(1).strip() for ln in span if (m := DEFERRED_TAG.search(ln))), None)
            targets = list(dict.fromkeys(t for t in _targets(node, name, p.name == "__init__.py", files)
                                         if t in files and t != name))
            out.append({"importer": name, "line": node.lineno, "deferred": id(node) not in top, "reason": reason,
                        "targets": targets})
    return sorted(out, key=lambda i: (i["importer"], i["line"]))


def module_level_closure(files: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> every module (ours) and heavy third-party root its import loads at module level, transitively
    (importing a.b.c runs a and a.b first)."""
    direct: dict[str, set[str]] = {}
    for name, p in files.items():
        tree = ast.parse(p.read_text(), filename=str(p))
        top = _top_nodes(tree)
        deps = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}  # parent packages
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) in top:
                deps |= set(_targets(node, name, p.name == "__init__.py", files, parents=True))
        direct[name] = {d for d in deps if d != name and (d in files or d in HEAVY_ROOTS)}
    closure: dict[str, set[str]] = {}
    for name in files:
        seen, todo = set(), [name]
        while todo:
            for d in direct.get(todo.pop(), ()):
                if d not in seen:
                    seen.add(d)
                    todo.append(d)
        closure[name] = seen
    return closure


def heavy_roots(closure: dict[str, set[str]], module: str) -> set[str]:
    return {m for m in closure.get(module, set()) | {module} if m in HEAVY_ROOTS}


def deferred_import_problems(files: dict[str, Path]) -> tuple[list[dict], list[str]]:
    """(every own-module import, problems): a deferred import without a ``# deferred: <reason>`` (or whose reason is
    a cycle), and one whose target is no heavier than its importer (its module-level closure reaches no heavy
    third-party root that the importer's does not: deferring it saves nothing)."""
    found, closure = own_imports(files), module_level_closure(files)
    problems = []
    for imp in found:
        if not imp["deferred"]:
            continue
        where = f"{imp['importer']}:{imp['line']}"
        if not imp["reason"]:
            problems.append(f"{where} imports {', '.join(imp['targets'])} inside a function with no '# deferred: <reason>'")
        elif NOT_A_REASON.search(imp["reason"]):
            problems.append(f"{where} defers {', '.join(imp['targets'])} for '{imp['reason']}', which is not a reason "
                            "(fix the cycle)")
        mine = heavy_roots(closure, imp["importer"])
        gains = {t: sorted(heavy_roots(closure, t) - mine) for t in imp["targets"]}
        if not any(gains.values()):
            problems.append(f"{where} defers {', '.join(imp['targets'])}, no heavier than {imp['importer']} "
                            f"(heavy roots it loads: {sorted(mine) or 'none'})")
    return found, problems


def test_imports_are_at_the_top():
    """The package's imports of its own modules: at most DEFERRED_MAX inside functions, each with a
    ``# deferred: <reason>`` on its line or the line above, and each deferring a module heavier than its importer."""
    found, problems = deferred_import_problems(our_modules())
    deferred = [i for i in found if i["deferred"]]
    share = len(deferred) / max(1, len(found))
    per_module: dict[str, int] = {}
    for i in deferred:
        per_module[i["importer"]] = per_module.get(i["importer"], 0) + 1
    top = sorted(per_module.items(), key=lambda kv: -kv[1])[:12]
    print(f"\nown-module imports: {len(found)}, deferred: {len(deferred)} ({share:.0%}; max {DEFERRED_MAX:.0%}), "
          f"with a reason: {sum(bool(i['reason']) for i in deferred)}; problems: {len(problems)} "
          f"({sum('no heavier' in p for p in problems)} deferring a module no heavier than the importer)")
    print("  most deferred: " + ", ".join(f"{m.removeprefix('qwen3_research.')} {n}" for m, n in top))
    for line in problems[:80]:
        print(f"  {line}")
    if len(problems) > 80:
        print(f"  ... and {len(problems) - 80} more")
    assert len(found) > 50  # the scan sees the package's imports
    assert share <= DEFERRED_MAX and problems == []


def folder_of(module: str) -> str:
    """A module's folder taken as one unit: qwen3_research.models.native.x -> qwen3_research.models (a sub-package,
    nested ones included, is its top folder); a top-level module (and the package itself) stays itself."""
    return ".".join(module.split(".")[:2])


def folder_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """The import graph (function-level imports counted) with each module collapsed to its folder; imports
    within one folder are not edges."""
    graph: dict[str, set[str]] = {}
    for m, targets in import_graph(files).items():
        src = folder_of(m)
        graph.setdefault(src, set())
        graph[src] |= {folder_of(t) for t in targets if folder_of(t) != src}
    return graph


def test_no_cycles_between_folders():
    """A folder (a sub-package: models/, kernels/, titan/, ...) taken as one unit, and the top-level modules: no
    import cycle among them, function-level imports counted."""
    mods = our_modules()
    graph = folder_graph(mods)
    cycles = find_cycles(graph)
    folders = sorted({folder_of(m) for m, p in mods.items() if p.name == "__init__.py" and m != "qwen3_research"})
    print(f"\n{len(graph)} units ({len(folders)} folders: {', '.join(f.removeprefix('qwen3_research.') for f in folders)}), "
          f"{sum(map(len, graph.values()))} edges; cycles: {len(cycles)}" + "".join(f"\n  {c}" for c in cycles))
    assert len(folders) >= 4 and cycles == []


# The entry points and what a config error needs before anything is built (the brief's light path).
LIGHT_SET = ("qwen3_research.__main__", "qwen3_research.plan", "qwen3_research.doctor", "qwen3_research.export",
             "qwen3_research.compare", "qwen3_research.verify_kernels", "qwen3_research.compose", "qwen3_research.config",
             "qwen3_research.errors", "qwen3_research.devices", "qwen3_research.resolve", "qwen3_research.startup",
             "qwen3_research.allocator")
# Config errors that exit 2 without torch: a misspelled key, an unknown option, and parallel degrees the world size
# cannot hold (resolve_run checks them before its torch-using halves -- kernels, checkpoints -- load).
LIGHT_CONFIG_ERRORS = (["training.stepz=1"], ["model=nope"], ["parallelism.tp=3", "parallelism.nproc_per_node=2"])
REPORTED_CONFIG_ERRORS: tuple = ()
# Errors Hydra's compose finds: they exit before numpy loads too (``__main__`` imports it once the config composed,
# startup.import_numpy_before_torch: ~50 ms of a ~0.45 s config error).
COMPOSE_ERRORS = (["training.stepz=1"], ["model=nope"])
NOT_AT_START = ("torch", "torchtitan", "transformers")


def heavy_modules_after_import(module: str, env: dict) -> list[str]:
    """Which of NOT_AT_START are in sys.modules after importing ``module`` alone in a fresh process."""
    code = ("import importlib, json, sys; importlib.import_module(sys.argv[1]); "
            f"print(json.dumps(sorted(m for m in {NOT_AT_START!r} if m in sys.modules)))")
    proc = subprocess.run([sys.executable, "-c", code, module], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def traced_imports(cmd: list[str], env: dict) -> tuple[subprocess.CompletedProcess, list[str], int]:
    """Run ``cmd`` with PYTHONPROFILEIMPORTTIME=1 (``-X importtime``, inherited by every process it starts, the
    allocator's re-exec included): (the process, every module imported, how many processes were traced)."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**env, "PYTHONPROFILEIMPORTTIME": "1"})
    lines = proc.stderr.splitlines()
    traced = [ln.rsplit("|", 1)[-1].strip() for ln in lines if ln.startswith("import time:") and "self [us]" not in ln]
    return proc, traced, sum("self [us]" in ln for ln in lines if ln.startswith("import time:"))


def first_import_chain(stderr: str, roots: tuple[str, ...]) -> list[str]:
    """From ``-X importtime`` output: the chain of imports (outermost first) that first loaded one of ``roots``.
    A module's line comes after those it imported, one indent level deeper."""
    rows = [(len(name) - len(name.lstrip()), name.strip()) for name in
            (ln.rsplit("|", 1)[-1] for ln in stderr.splitlines() if ln.startswith("import time:") and "self [us]" not in ln)]
    for i, (depth, name) in enumerate(rows):
        if name in roots:  # the root's own line (its submodules' lines come before it)
            chain = [name]
            for d, parent in rows[i + 1:]:
                if d < depth:
                    chain.insert(0, parent)
                    depth = d
            return chain
    return []


def test_the_light_set_loads_no_torch():
    """Each entry point and what a config error needs, imported alone in a fresh process: torch, torchtitan and
    transformers are not in sys.modules. And a config error (``training.stepz=1``, ``model=nope``) exits 2 with
    one line without importing torch (every module each of its processes imports is traced); one that composing
    finds, without importing numpy either."""
    from tests.conftest import cli_env

    env = cli_env(PYTHONPATH=str(ROOT))
    loaded = {module: heavy_modules_after_import(module, env) for module in LIGHT_SET}
    print("\n" + "\n".join(f"  import {m}: {', '.join(v) or 'no torch/torchtitan/transformers'}" for m, v in loaded.items()))
    errors = {}
    for overrides in (*LIGHT_CONFIG_ERRORS, *REPORTED_CONFIG_ERRORS):
        proc, traced, processes = traced_imports([sys.executable, "-m", "qwen3_research", *overrides], env)
        heavy = sorted({m.split(".")[0] for m in traced if m.split(".")[0] in NOT_AT_START})
        message = [ln for ln in proc.stderr.splitlines() if not ln.startswith("import time:") and ln.strip()]
        errors[" ".join(overrides)] = (proc.returncode, traced, heavy, message)
        via = first_import_chain(proc.stderr, NOT_AT_START)
        print(f"  {' '.join(overrides)}: exit {proc.returncode}, {len(traced)} imports traced in {processes} process(es), "
              f"torch/torchtitan/transformers among them: {heavy or 'none'}{' (via ' + ' > '.join(via) + ')' if via else ''}"
              f"{'' if overrides in LIGHT_CONFIG_ERRORS else ' (reported only)'}; {message[:1]}")
    assert {m: v for m, v in loaded.items() if v} == {}
    for overrides in LIGHT_CONFIG_ERRORS:
        code, traced, heavy, message = errors[" ".join(overrides)]
        assert "qwen3_research.config" in traced and "omegaconf" in traced  # the trace covers the composing process
        assert code == 2 and len(message) == 1 and message[0].startswith("config error: "), message
        assert heavy == []
    numpy_loaded = {" ".join(o): "numpy" in errors[" ".join(o)][1] for o in COMPOSE_ERRORS}
    print(f"  numpy loaded by a compose error: {numpy_loaded}")
    assert not any(numpy_loaded.values()), numpy_loaded


def test_the_issue32_scans_can_fail(tmp_path):
    """Planted inputs: each scan of acceptance b (device strings, planner patches, deferred imports, folder cycles)
    and the light-set probes report what they are meant to, and pass what they are meant to pass."""
    from tests.conftest import cli_env

    # 1. device strings: flagged outside devices/ and titan/, not inside; "cudart" is no device
    dev = tmp_path / "dev.py"
    dev.write_text('def f(x, d, s, k):\n    a = x == "cuda"\n    b = d in ("cpu", "neuron")\n    c = s.startswith("cuda")\n'
                   '    e = x != "cudart" and d == "cuda:0"\n    match k:\n        case "neuron":\n            pass\n')
    assert [line for line, _ in device_comparisons(dev)] == [2, 3, 4, 5, 7]
    assert list(device_comparisons_outside_devices({"qwen3_research.trainer": dev, "qwen3_research.devices.cuda": dev,
                                                    "qwen3_research.titan.v03": dev})) == ["qwen3_research.trainer"]
    # 1b. device calls (issue 39): calls and imports into torch.cuda / torch.neuron and their submodules, flagged
    # outside devices/ (titan/ included); torch.backends.cuda, a reference that is not called, a comment are not
    calls = tmp_path / "calls.py"
    calls.write_text("import torch\nimport torch.cuda.memory\nfrom torch import cuda\nfrom torch.cuda import memory\n"
                     "def f(d):\n    torch.cuda.synchronize(d)\n    torch.cuda.memory._record_memory_history(enabled=None)\n"
                     "    n = torch.neuron.memory_allocated(0)\n    t = torch.backends.cuda.matmul.allow_tf32\n"
                     "    g = torch.cuda.get_rng_state  # torch.cuda.x()\n    return torch.get_device_module(d)\n")
    assert [line for line, _ in device_calls(calls)] == [2, 3, 4, 6, 7, 8]
    assert list(device_calls_outside_devices({"qwen3_research.profiling": calls, "qwen3_research.devices.cuda": calls,
                                              "qwen3_research.titan.v03": calls})) == ["qwen3_research.profiling",
                                                                                       "qwen3_research.titan.v03"]
    # 2. the planner: a patch loop, an assignment to a module's attribute, a setattr on a class, mock.patch; the one
    # named DTensor seam and a local object's attributes are not patches
    planner = tmp_path / "planner.py"
    planner.write_text(
        "import os\nimport torch.distributed as dist\nfrom unittest import mock\n"
        "from torch.distributed.device_mesh import DeviceMesh\n"
        "from torch.distributed.tensor._sharding_prop import ShardingPropagator\n\n"
        "class Local:\n    pass\n\n"
        "def f(patches, g):\n"
        "    for owner, name, value in patches:\n        setattr(owner, name, value)\n"  # 12
        "    dist.all_gather_object = g\n"  # 13
        "    setattr(DeviceMesh, '__init__', g)\n"  # 14
        "    mock.patch.object(dist, 'get_rank', g)\n"  # 15
        "    ShardingPropagator._propagate_tensor_meta_non_cached = g\n"
        "    setattr(ShardingPropagator, '_propagate_tensor_meta_non_cached', g)\n"
        "    obj = Local()\n    setattr(obj, 'a', 1)\n    obj.b = 2\n    os.environ['RANK'] = '0'\n"
        "    Local.c = 3\n")  # 22: a class of this module, not another module's
    assert [int(h.split(":")[0]) for h in planner_patches(planner)] == [12, 13, 14, 15]
    # 3. deferred imports: no reason, a cycle as the reason, a target no heavier than its importer; a reasoned
    # deferral of a heavy module passes, its reason on the line above counts too
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "light.py").write_text("import json\n")
    (pkg / "heavy.py").write_text("from qwen3_research import light\nimport torch\n")
    (pkg / "entry.py").write_text(
        "from qwen3_research import light\n\n"
        "def ok():\n    from qwen3_research import heavy  # deferred: start-up (heavy loads torch)\n\n"  # 4
        "def ok_above():\n    # deferred: start-up\n    import qwen3_research.heavy\n\n"  # 8
        "def bare():\n    from qwen3_research.heavy import x\n\n"  # 11
        "def cycle():\n    from qwen3_research import heavy  # deferred: avoid a cycle\n\n"  # 14
        "def pointless():\n    from qwen3_research.light import y  # deferred: start-up\n")  # 17
    files = {f"qwen3_research.{p.stem}": p for p in sorted(pkg.glob("*.py"))}
    found, problems = deferred_import_problems(files)
    assert [(i["importer"].split(".")[-1], i["line"], i["deferred"]) for i in found] == [
        ("entry", 1, False), ("entry", 4, True), ("entry", 8, True), ("entry", 11, True), ("entry", 14, True),
        ("entry", 17, True), ("heavy", 1, False)]
    assert [p.split(" ", 1)[0] for p in problems] == ["qwen3_research.entry:11", "qwen3_research.entry:14",
                                                      "qwen3_research.entry:17"]
    assert "no '# deferred" in problems[0] and "not a reason" in problems[1] and "no heavier" in problems[2]
    assert heavy_roots(module_level_closure(files), "qwen3_research.entry") == set()
    # 4. folders: a.x -> b.y at module level, b.y -> a.z inside a function: no cycle between modules, one between
    # the folders a and b
    for rel, text in {"a/__init__.py": "", "a/x.py": "from qwen3_research.b import y\n", "a/z.py": "",
                      "b/__init__.py": "", "b/y.py": "def f():\n    from qwen3_research.a import z\n"}.items():
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_text(text)
    files = {"qwen3_research.a": tmp_path / "a/__init__.py", "qwen3_research.a.x": tmp_path / "a/x.py",
             "qwen3_research.a.z": tmp_path / "a/z.py", "qwen3_research.b": tmp_path / "b/__init__.py",
             "qwen3_research.b.y": tmp_path / "b/y.py"}
    assert find_cycles(import_graph(files)) == []
    assert find_cycles(folder_graph(files)) == ["qwen3_research.a -> qwen3_research.b -> qwen3_research.a"]
    # 5. the light-set probes see torch when a module loads it
    (tmp_path / "planted_heavy.py").write_text("import torch\n")
    env = cli_env(PYTHONPATH=f"{tmp_path}:{ROOT}")
    assert heavy_modules_after_import("planted_heavy", env) == ["torch"]
    proc, traced, processes = traced_imports([sys.executable, "-c", "import planted_heavy"], env)
    assert proc.returncode == 0 and processes == 1 and "planted_heavy" in traced and "torch" in traced
    assert first_import_chain(proc.stderr, NOT_AT_START) == ["planted_heavy", "torch"]


# -- issue 32 deliverable 8: ARCHITECTURE.md's "Where to add", each count checked against the tree ------------------
WHERE_TO_ADD = re.compile(r"^- \*\*(A [a-z ]+)\*\* \((\d+) files?: ((?:`[^`]+`(?:,\s+)?)+)\)", re.M)


def where_to_add(text: str) -> dict[str, tuple[int, list[str]]]:
    """'A device' -> (the count it states, the paths it lists) for each entry of the "Where to add" section."""
    section = text[text.index("## Where to add"):]
    return {what: (int(n), re.findall(r"`([^`]+)`", paths)) for what, n, paths in WHERE_TO_ADD.findall(section)}


def _yaml_value(path: Path, key: str) -> str | None:
    m = re.search(rf"^{key}:\s*([\w.-]+)", path.read_text(), re.M)
    return m.group(1) if m else None


def instances_of(what: str) -> dict[str, list[str]]:
    """What the tree holds of each kind of addition: instance -> the files it is made of, found without the
    document (the device kinds the registry discovers, the backends of conf/model, the kernel modules the kernels
    package imports, the launchers of conf/hydra/launcher, the module that builds the metrics record)."""
    from qwen3_research import devices
    from qwen3_research.devices.registry import NOT_KINDS

    if what == "A device":
        modules = {p.stem for p in (PKG / "devices").glob("*.py") if p.stem not in NOT_KINDS and not p.stem.startswith("_")}
        yamls = {_yaml_value(p, "type"): p for p in (ROOT / "conf/device").glob("*.yaml") if p.stem != "auto"}
        assert modules == set(devices.kinds()) == set(yamls), (modules, devices.kinds(), yamls)
        return {k: [f"qwen3_research/devices/{k}.py", str(yamls[k].relative_to(ROOT))] for k in modules}
    if what == "A kernel":
        init = (PKG / "kernels/__init__.py").read_text()
        mods = re.search(r"^from qwen3_research\.kernels import ([\w, ]+)  # noqa", init, re.M).group(1).split(", ")
        options = {p: p.read_text() for p in (ROOT / "conf/kernels").glob("*.yaml")}
        out = {}
        for m in mods:
            names = re.findall(r'name="(\w+)"', (PKG / f"kernels/{m}.py").read_text())
            option = next(p for p, text in sorted(options.items()) if any(re.search(rf"\b{n}\b", text) for n in names))
            out[m] = [f"qwen3_research/kernels/{m}.py", "qwen3_research/kernels/__init__.py", str(option.relative_to(ROOT))]
        return out
    if what == "A model backend":
        folders = {p.parent.name for p in (PKG / "models").glob("*/__init__.py") if "BACKEND = " in p.read_text()}
        return {b: [f"qwen3_research/models/{b}/__init__.py", f"conf/model/{b}.yaml"] for b in folders}
    if what == "A launcher":
        return {p.stem: [str(p.relative_to(ROOT))] for p in (ROOT / "conf/hydra/launcher").glob("*.yaml")}
    if what == "A metric":
        return {"the record": [str(p.relative_to(ROOT)) for p in PKG.glob("*.py") if "def _record(" in p.read_text()]}
    raise AssertionError(f"no instances known for {what!r}")


def test_where_to_add_counts_match_the_tree():
    """Each entry of ARCHITECTURE.md's "Where to add" (a device, a kernel, a model backend, a launcher, a metric)
    states how many files an addition is and lists them; the count is the list's length, and every existing
    instance found in the tree is exactly those files (a device kind: its module and its YAML, nothing else listing
    it)."""
    entries = where_to_add((ROOT / "ARCHITECTURE.md").read_text())
    assert set(entries) == {"A device", "A kernel", "A model backend", "A launcher", "A metric"}, entries
    for what, (count, paths) in entries.items():
        found = instances_of(what)
        print(f"\n{what}: {count} file(s) {paths}; in the tree: "
              + "; ".join(f"{k}: {', '.join(files)}" for k, files in sorted(found.items())))
        assert count == len(paths) and found
        for instance, files in found.items():
            assert len(files) == count, (what, instance, files)
            for template, path in zip(paths, files):
                pattern = re.sub(r"<[a-z]+>", "*", template)
                assert fnmatch.fnmatchcase(path, pattern) and (ROOT / path).is_file(), (what, instance, template, path)


def test_where_to_add_can_fail():
    """A stated count that is not the list's length, or an entry the tree does not match, is seen."""
    doc = ("## Where to add\n\n- **A device** (3 files: `qwen3_research/devices/<kind>.py`, `conf/device/<kind>.yaml`): x\n"
           "- **A metric** (1 file: `qwen3_research/metrics.py`): y\n")
    entries = where_to_add(doc)
    assert entries["A device"] == (3, ["qwen3_research/devices/<kind>.py", "conf/device/<kind>.yaml"])
    assert entries["A device"][0] != len(entries["A device"][1])
    assert instances_of("A metric")["the record"] != entries["A metric"][1]  # _record is in trainer.py
