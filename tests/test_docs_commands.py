"""Every documented Trainium command passes the project's own start-up validation (issue 22, point 8).

The commands are PARSED FROM THE DOCS, never copied here: every shell line of README's "Trainium hosts" section,
every line of README and of the docs/ pages that asks for ``device=neuron`` (but a Slurm submission, which needs a
cluster of trn2 nodes), every line of docs/TRAINIUM.md, of docs/FINETUNING.md's shell blocks and of docs/KERNELS.md's "First commands on a
trn2 host".
Each project command runs, as written (its ``VAR=value`` prefix included), on a simulated trn2.48xlarge
(tests/neuron_host_double.py: test doubles of torch_neuronx, neuron-ls, fi_info, the driver's sysfs file and the
aws-neuronx packages; 64 logical cores at LNC=2, 24 GiB each) with the test hook
``QWEN3_VALIDATE_ONLY=1`` (tests/hooks/qwen3_test_hooks.py, on PYTHONPATH): a run, ``verify_kernels`` and the doctor's ``--run`` checks
stop right before the first thing that needs the device, after the configuration, the degrees, the LNC and cores,
the torchtitan and kernel checks (on a meta-device model); the doctor and ``qwen3_research.plan`` need no device
and run whole. Verdict: exit 0 and the line that says the command got there. ``pytest`` lines must select at
least one test. Install and import lines (pip, git, source, python -c) are listed as not project commands.

So a documented command can never again be invalid by construction: the old headline command (the tiny MoE with
kernels=nki_moe) fails here, as ``test_the_old_headline_command_fails`` shows.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from qwen3_research.compose import CONF_DIR
from tests.conftest import ROOT, cli_env, hooks_env, run_cli
from tests.hooks.qwen3_test_hooks import VALIDATE_ONLY_ENV, VALIDATE_ONLY_LINE
from tests.neuron_host_double import trn2_host

VALIDATED = VALIDATE_ONLY_LINE
ENV_WORD = re.compile(r"^[A-Z_][A-Z0-9_]*=")


@dataclass
class DocCommand:
    source: str  # file and section it was parsed from
    line: str  # as written (continuations joined)
    env: dict = field(default_factory=dict)
    argv: list = field(default_factory=list)

    @property
    def kind(self) -> str:
        a = self.argv
        if len(a) >= 3 and Path(a[0]).name.startswith("python") and a[1] == "-m" and a[2].startswith("qwen3_research"):
            return "project"
        if a and a[0] == "pytest":
            return "pytest"
        return "external"


def _blocks(text: str) -> list[str]:
    return re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    level = heading.split(" ")[0] + " "
    nxt = text.find("\n" + level, start + len(heading))
    return text[start:nxt if nxt != -1 else len(text)]


def _commands(block: str, source: str) -> list[DocCommand]:
    out, pending = [], ""
    for raw in block.splitlines():
        line = raw.strip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        if not line or line.startswith("#") or line.startswith("$"):
            continue
        words = shlex.split(line, comments=True)
        if not words:
            continue
        env = {}
        while words and ENV_WORD.match(words[0]):
            k, v = words.pop(0).split("=", 1)
            env[k] = v
        out.append(DocCommand(source, line.split(" #")[0].strip(), env, words))
    return out


def documented_commands() -> list[DocCommand]:
    readme = (ROOT / "README.md").read_text()
    cmds = []
    for block in _blocks(_section(readme, "## Trainium hosts")):
        cmds += _commands(block, "README.md 'Trainium hosts'")
    for block in _blocks((ROOT / "docs" / "TRAINIUM.md").read_text()):
        cmds += _commands(block, "docs/TRAINIUM.md")
    # docs/FINETUNING.md's shell blocks (its python block is what a user runs after, not a command)
    for block in re.findall(r"```bash\n(.*?)```", (ROOT / "docs" / "FINETUNING.md").read_text(), flags=re.S):
        cmds += _commands(block, "docs/FINETUNING.md")
    kernels = _section((ROOT / "docs" / "KERNELS.md").read_text(), "### First commands on a trn2 host")
    for block in _blocks(kernels):
        cmds += _commands(block, "docs/KERNELS.md 'First commands on a trn2 host'")
    seen = {c.line for c in cmds}
    # README keeps the first five minutes; the Trainium lines it had moved to docs/ pages (issue 39), read there.
    pages = [("README.md", readme)] + [(f"docs/{p.name}", p.read_text()) for p in sorted((ROOT / "docs").glob("*.md"))]
    for name, text in pages:
        for block in (b for b in _blocks(text) if "device=neuron" in b):  # other pages' blocks may not be shell
            for c in _commands(block, f"{name} (device=neuron)"):
                if "device=neuron" in c.argv and "hydra/launcher=slurm" not in c.argv and c.line not in seen:
                    cmds.append(c)
                    seen.add(c.line)
    return cmds

COMMANDS = documented_commands()
# Each distinct project command once (README and docs/TRAINIUM.md share several), with every place it appears.
PROJECT: list[DocCommand] = []
for _c in COMMANDS:
    if _c.kind == "external":
        continue
    _same = next((p for p in PROJECT if p.line == _c.line), None)
    if _same is None:
        PROJECT.append(DocCommand(_c.source, _c.line, _c.env, _c.argv))
    elif _c.source not in _same.source:
        _same.source += f", {_c.source}"


def _missing_checkpoint(c: DocCommand) -> str | None:
    """A command naming a local checkpoint directory (model.init_from / model.path) that is not on this host."""
    for a in c.argv:
        key, _, value = a.partition("=")
        if key in ("model.init_from", "model.path") and value.startswith("/") and not Path(value).exists():
            return value
    return None


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("docs_commands")
    env = trn2_host(tmp, env=cli_env(**hooks_env(**{VALIDATE_ONLY_ENV: "1"})))
    (tmp / "cwd").mkdir()
    return env, tmp / "cwd"


RESULTS: dict[str, str] = {}


def run_documented(c: DocCommand, env: dict, cwd: Path) -> tuple[bool, str]:
    """Run one documented command on the simulated host; (passed, verdict)."""
    if (path := _missing_checkpoint(c)) is not None:
        return True, f"not run: names a local checkpoint ({path}) not on this host"
    env = {**env, **c.env}
    if c.kind == "pytest":
        proc = run_cli(["--collect-only", "-q", "-p", "no:cacheprovider", *c.argv[1:]], module="pytest", env=env,
                       cwd=ROOT, timeout=600)
        found = re.search(r"(\d+)(?:/\d+)? tests? (?:collected|selected)", proc.stdout)
        n = int(found.group(1)) if found else 0
        return proc.returncode == 0 and n > 0, f"exit {proc.returncode}, {n} test(s) selected"
    module, args = c.argv[2], c.argv[3:]
    proc = run_cli(args, module=module, env=env, cwd=cwd, timeout=1800)
    out = proc.stdout + proc.stderr
    tail = (out.strip().splitlines() or [""])[-1]
    if module == "qwen3_research.plan":
        verdict = next((ln for ln in proc.stdout.splitlines() if "verdict:" in ln), tail)
        ok = proc.returncode == 0 and "fits" in verdict
    elif module == "qwen3_research.doctor":
        verdict = next((ln for ln in proc.stdout.splitlines() if ln.endswith("checks pass")), None) \
            or ("the run can start here" if "the run can start here." in proc.stdout else tail)
        ok = proc.returncode == 0 and ("--run" not in args or "checks pass" in verdict)
    else:
        verdict = VALIDATED if VALIDATED in proc.stdout else tail
        ok = proc.returncode == 0 and verdict == VALIDATED
    if not ok:
        print(out[-3000:])
    return ok, f"exit {proc.returncode}: {verdict}"


@pytest.mark.slow
@pytest.mark.parametrize("cmd", PROJECT, ids=[c.line[:90] for c in PROJECT])
def test_documented_command_passes_start_up_validation(cmd, host):
    env, cwd = host
    ok, verdict = run_documented(cmd, env, cwd)
    RESULTS[cmd.line] = ("PASS " if ok else "FAIL ") + verdict
    print(f"\n[{cmd.source}] {cmd.line}\n  -> {RESULTS[cmd.line]}")
    assert ok, verdict


def test_the_docs_list_every_step_and_preset():
    """The parse found the first-hour steps, every Trainium preset planned at 24 GiB per rank, and the kernel commands on
    the kernel-sized MoE flavor; then the list of every command and its verdict so far (run with -s)."""
    lines = [c.line for c in PROJECT]
    for preset in sorted(p.stem for p in (Path(CONF_DIR) / "experiment").glob("*.yaml")
                         if "override /device: neuron" in p.read_text()):  # the Trainium presets (sft: CPU, docs/CHAT_DATA.md)
        assert f"python -m qwen3_research.plan experiment={preset} device.memory_gib=24" in lines, preset
        assert f"python -m qwen3_research experiment={preset}" in lines, preset
    assert any("kernels=nki_moe" in ln and "model.flavor=nki_debug" in ln and "verify_kernels" in ln for ln in lines)
    assert all("model.flavor=nki_debug" in c.argv or "kernels=nki_moe" not in c.argv for c in PROJECT)
    assert "python -m qwen3_research.doctor --run" in lines
    print(f"\n{len(COMMANDS)} documented commands ({len(PROJECT)} project commands):")
    for c in COMMANDS:
        verdict = RESULTS.get(c.line, "not a project command (install or import step)" if c.kind == "external"
                              else "not run in this session")
        print(f"  [{c.source}] {c.line}\n      {verdict}")


def test_the_old_headline_command_fails(host):
    """The README's former headline Trainium command (the tiny MoE, hidden 128, with kernels=nki_moe): one line, exit 2
    (model=native_moe is now the preset native + tiny_moe, the flavor the line names)."""
    env, cwd = host
    old = DocCommand("README.md before issue 22", "python -m qwen3_research model=native_moe kernels=nki_moe "
                     "device=neuron data.seq_len=256")
    old.argv = shlex.split(old.line)
    ok, verdict = run_documented(old, env, cwd)
    print(f"\n{old.line}\n  -> {verdict}")
    assert not ok and verdict.startswith("exit 2: config error: kernels=nki_moe: hidden width H=128 (model.flavor=tiny_moe)")


if __name__ == "__main__":  # list the parsed commands
    for c in COMMANDS:
        print(f"{c.kind:8} [{c.source}] {c.line}")
    sys.exit(0)
