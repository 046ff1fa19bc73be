"""The suite's warm CLI (tests/warm_cli.py) must be indistinguishable from a cold `python -m qwen3_research`."""

from __future__ import annotations

import re
import subprocess
import sys

from tests import warm_cli
from tests.conftest import FAST, ROOT, cli_env, read_metrics


def _cold(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qwen3_research", *args], cwd=ROOT, env=cli_env(),
                          capture_output=True, text=True, timeout=300)


def _warm(args: list[str]) -> subprocess.CompletedProcess:
    proc = warm_cli.run("qwen3_research", args, cwd=ROOT, env=cli_env(), base_env=cli_env(), timeout=300)
    assert proc is not None, "warm_cli refused a run with the default environment"
    return proc


def _steady(text: str) -> list[str]:
    """The lines of a run's output without the figures that are timings."""
    out = []
    for ln in text.splitlines():
        ln = re.sub(r"^\[\d{4}-\d\d-\d\d [\d:,]+\]", "", ln)  # the logging time stamp
        words = [w for w in ln.split() if not w.startswith(("tokens_per_s=", "mfu=", "step_time_s=", "first_step_s=",
                                                              "steady_step_s=", "build_s=", "mem_peak_gib="))]
        out.append(" ".join(words))
    return out


def test_server_is_warm_and_fork_clean():
    srv = warm_cli.server(cli_env())
    if srv is None:  # QWEN3_TESTS_COLD_CLI=1: nothing warm to check
        return
    assert srv.usable and srv.missing == [], srv.missing


def test_warm_run_equals_a_cold_run(tmp_path):
    args = [*FAST, "parallelism.dp_shard=2", "parallelism.nproc_per_node=2"]
    cold = _cold([*args, f"hydra.run.dir={tmp_path / 'cold'}"])
    warm = _warm([*args, f"hydra.run.dir={tmp_path / 'warm'}"])
    assert cold.returncode == warm.returncode == 0, (cold.stderr[-2000:], warm.stderr[-2000:])
    losses = {k: [(r["step"], r["loss"]) for r in read_metrics(tmp_path / k) if "loss" in r] for k in ("cold", "warm")}
    assert len(losses["cold"]) == 3 and losses["warm"] == losses["cold"]  # 2 forked ranks, bit-identical
    assert sorted(_steady(warm.stdout)) == sorted(_steady(cold.stdout))  # two ranks interleave their lines


def test_warm_config_error_equals_a_cold_one(tmp_path):
    args = [*FAST, "model.flavr=tiny", f"hydra.run.dir={tmp_path / 'r'}"]
    cold, warm = _cold(args), _warm(args)
    assert cold.returncode == warm.returncode == 2
    assert warm.stderr == cold.stderr and warm.stdout == cold.stdout
    assert not (tmp_path / "r").exists()


def test_a_childs_exit_leaves_the_servers_temporary_directories_alone():
    """W&B's media directory, made and registered for removal at exit when wandb is imported (in the server), was
    removed by the first child's exit, and a later sweep's W&B table failed with FileNotFoundError. Each child has
    its own now, as a cold process does."""
    outs = [warm_cli.run("tests.wandb_media_probe", [], cwd=ROOT, env=cli_env(), base_env=cli_env(), timeout=120)
            for _ in range(3)]
    assert all(p is not None and p.returncode == 0 for p in outs), [p and p.stderr[-2000:] for p in outs]
    lines = [p.stdout.strip() for p in outs]
    print(lines)
    assert all(ln.endswith("exists=True") for ln in lines) and len(set(lines)) == 3, lines
