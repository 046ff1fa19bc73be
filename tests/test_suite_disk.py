"""The suite's own disk use (tests/conftest.py): a module's tmp_path_factory directories go when the module ends,
unless one of its tests failed. A full suite wrote ~14 GB of run directories before, and CI ran out of disk."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT, cli_env

INNER = textwrap.dedent('''
    import pytest

    @pytest.fixture(scope="module")
    def run_dir(tmp_path_factory):
        d = tmp_path_factory.mktemp("module_run")
        (d / "checkpoint.bin").write_bytes(b"x" * 4096)
        return d

    def test_one(run_dir, tmp_path):
        (tmp_path / "own").write_text("y")
        assert run_dir.exists()

    def test_two(run_dir):
        assert {OUTCOME}
    ''')


@pytest.mark.parametrize("passes", [True, False], ids=["module-passes", "a-test-fails"])
def test_a_modules_directories_go_with_it_unless_a_test_failed(tmp_path, passes):
    (tmp_path / "inner").mkdir()
    (tmp_path / "inner" / "test_inner.py").write_text(INNER.replace("{OUTCOME}", str(passes)))
    base = tmp_path / "basetemp"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                           f"--basetemp={base}", "-o", "tmp_path_retention_policy=failed", str(tmp_path / "inner")],
                          cwd=ROOT, env=cli_env(PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=300)
    assert proc.returncode == (0 if passes else 1), proc.stdout + proc.stderr
    left = sorted(p.name for p in base.iterdir())
    print(f"{'passed' if passes else 'failed'}: left in the base directory: {left}")
    if passes:
        assert left == []
    else:  # the failed module keeps its run directory (and the failed test nothing of its own: it made none)
        assert "module_run0" in left and (base / "module_run0" / "checkpoint.bin").stat().st_size == 4096
