"""Issue 40, items 2 and 5: what the chosen option does not read, and a kernel option that does nothing, refused at
start-up in one line, before any worker starts and before any run directory exists.

Each case failed on the old code: the key was accepted and ignored (the embedded corpus, a random model, a dense
model trained), and kernels=nki_moe on a dense CPU model warned and trained (exit 0)."""

from __future__ import annotations

from pathlib import Path

import pytest

from qwen3_research.compose import compose
from qwen3_research.errors import ConfigError
from qwen3_research.resolve import resolve_run
from tests.conftest import FAST, run_cli

MOE_FLAVORS = "model.flavor=tiny_moe|debug_moe|nki_debug|30B-A3B|235B-A22B"

CASES = {  # overrides -> the one line (after "config error: ")
    "data-files-without-data-files": (["data.files=/data/*.txt"],
        "data.files='/data/*.txt' is read only by data=files|data=chat (data.source=files|chat); this run's data.source=embedded "
        "ignores it: add data=files, or drop data.files"),
    "data-hf-name-with-data-files": (["data=files", f"data.files={Path(__file__).resolve()}", "data.hf.name=wikitext"],
        "data.hf.name='wikitext' is read only by data=hf|data=chat (data.source=hf|chat); this run's data.source=files ignores it: "
        "add data=hf, or drop data.hf.name"),
    "model-path-with-native": (["model=native", "model.path=/models/Qwen3-0.6B"],
        "model.path='/models/Qwen3-0.6B' is read only by model=hf; this run's model=native ignores it: use model=hf, "
        "or drop model.path"),
    "flavor-with-hf": (["model=hf", "model.path=/models/Qwen3-0.6B", "model.flavor=tiny_moe"],
        "model.flavor='tiny_moe' is read only by model=native|native_moe; this run's model=hf ignores it: use "
        "model=native, or drop model.flavor"),
    "aux-loss-coef-on-dense": (["model.moe.aux_loss_coef=0.01"],
        "model.moe.aux_loss_coef=0.01 is read only by a mixture-of-experts model that balances with aux_loss; this "
        "run's model=native model.flavor=tiny (model.moe.balance: none) ignores it: use a flavor that does "
        f"({MOE_FLAVORS}), or drop model.moe.aux_loss_coef"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_key_the_chosen_option_does_not_read_is_refused_naming_its_reader(case):
    overrides, expected = CASES[case]
    with pytest.raises(ConfigError) as e:
        resolve_run(compose([*overrides, "device=cpu"]), kernels=False)
    print(f"\n{' '.join(overrides)}: {e.value}")
    assert str(e.value) == expected


def test_what_the_chosen_option_reads_is_accepted():
    """The same keys where their option reads them (and a MoE coefficient on a MoE model) resolve."""
    resolve_run(compose(["model=native_moe", "model.moe.aux_loss_coef=0.01", "model.moe.bias_coef=0.002",
                         "model.moe.routing_stats=false", "device=cpu"]), kernels=False)
    resolve_run(compose(["model=native", "model.flavor=tiny_moe", "model.moe.aux_loss_coef=0.01", "device=cpu"]),
                kernels=False)


def _refused_before_any_worker(proc, run_dir, start: str) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    out = proc.stdout + proc.stderr
    print(f"\nexit {proc.returncode}: {lines[-1] if lines else ''}")
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(start), out[-3000:]
    assert "rank" not in out and "kernel plan" not in out and "step" not in proc.stdout, out[-3000:]
    assert not run_dir.exists()
    return lines[0]


def test_the_cli_refuses_data_files_without_data_files_before_any_worker(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(["data.files=/data/*.txt", *FAST], run_dir=run_dir)
    _refused_before_any_worker(proc, run_dir, "config error: data.files='/data/*.txt' is read only by data=files")


def test_the_cli_refuses_nki_moe_on_cpu_before_any_worker(tmp_path):
    """The design card's command (model=native kernels=nki_moe) on CPU: the device rule first, not a no-match
    warning and 60 steps of the dense model."""
    run_dir = tmp_path / "run"
    proc = run_cli(["model=native", "kernels=nki_moe", "device=cpu", *FAST], run_dir=run_dir)
    _refused_before_any_worker(proc, run_dir, "config error: kernels=nki_moe needs device neuron (kernel nki_moe); "
                                              "this run's device is cpu")


def test_the_cli_refuses_a_kernel_option_that_matches_nothing(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(["model=native", "kernels=moe_fast", "device=cpu", *FAST], run_dir=run_dir)
    line = _refused_before_any_worker(proc, run_dir, "config error: kernels=moe_fast matches no module of "
                                                     "model=native model.flavor=tiny")
    assert MOE_FLAVORS in line
