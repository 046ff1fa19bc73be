"""``python -m qwen3_research.doctor``: the table on this host, exit 0/1/2, and ``--run``."""

from __future__ import annotations

import pytest

from tests.conftest import cli_env, run_cli


def _doctor(args, **env):
    return run_cli(list(args), module="qwen3_research.doctor", env=cli_env(**env), timeout=1800)


def test_doctor_on_cpu_says_the_default_run_can_start():
    """Exit 0 on this CPU host; one row per fact the issue asks for; the Neuron pieces reported absent."""
    proc = _doctor([])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    print(proc.stdout)
    out = proc.stdout
    for item in ("python", "torch", "torchtitan", "transformers", "neuron packages", "device", "LNC / logical cores",
                 "world size", "memory per rank", "process group", "compile backend", "kernel options here", "W&B"):
        assert f"\n{item} " in out, f"no row {item!r}"
    assert "absent (not a Trainium install)" in out
    assert "device.type=auto -> cpu" in out
    assert "world size               ok      1 x 1 node(s) = 1 (nproc_per_node=-1: auto)" in out
    assert "process group            ok      gloo" in out
    assert "nki_moe (nki_moe needs device neuron; nki_moe needs the nki / nkilib packages)" in out
    assert out.rstrip().endswith("the run can start here.")


def test_doctor_with_device_neuron_exits_1_naming_what_to_install():
    proc = _doctor(["device=neuron"])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    fixes = proc.stdout.split("missing (the run cannot start until each is fixed):\n")[1].strip().splitlines()
    assert fixes == ['- device: pip install "torch-neuronx==2.14.*" "neuronx-cc==2.*" nki --extra-index-url '
                     'https://pip.repos.neuron.amazonaws.com --extra-index-url https://download.pytorch.org/whl/cpu '
                     "(README 'Trainium hosts')"]


def test_doctor_reports_an_lnc_conflict_with_its_fix():
    proc = _doctor(["device.lnc=1"], NEURON_LOGICAL_NC_CONFIG="2")
    assert proc.returncode == 1
    assert "- LNC: unset NEURON_LOGICAL_NC_CONFIG or pass device.lnc=2" in proc.stdout


def test_doctor_bad_override_is_a_config_error():
    proc = _doctor(["devce=cpu"])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "config error: devce: unknown key (Key 'devce' not in 'RunConfig'); check the spelling, or print valid keys with --cfg job"]


@pytest.mark.slow
def test_doctor_run_checks_every_backend_and_kernel_option_here():
    """--run on CPU: 3 tiny runs (native, native_moe, hf) + verify_kernels for fast, moe_fast, rope_fast
    (reference has nothing to verify; triton/nki cannot run here) = 6 checks, all pass."""
    proc = _doctor(["--run"])
    print(proc.stdout[-2500:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = proc.stdout.split("\nresults\n")[1]
    rows = [ln.split()[:3] for ln in results.splitlines()[2:] if ln.startswith(("run ", "verify_kernels "))]
    assert rows == [["run", "model=native", "pass"], ["run", "model=native_moe", "pass"], ["run", "model=hf", "pass"],
                    ["verify_kernels", "kernels=fast", "pass"], ["verify_kernels", "kernels=moe_fast", "pass"],
                    ["verify_kernels", "kernels=rope_fast", "pass"]]
    assert "6/6 checks pass" in proc.stdout
