"""``python -m qwen3_research.doctor``: the table on this host, exit 0/1/2, and ``--run``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from qwen3_research import titan
from tests.conftest import cli_env, run_cli
from tests.neuron_host_double import trn2_host


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
    world, group = _row(proc, "world size"), _row(proc, "process group")  # [status, value]: whatever the column widths
    assert world[0] == "ok" and world[1].startswith("1 x 1 node(s) = 1 (nproc_per_node=-1: auto)"), world
    assert group[0] == "ok" and group[1].startswith("gloo"), group
    assert "nki_moe (kernels=nki_moe needs device neuron (kernel nki_moe))" in out  # kernels.registry.kernel_support
    assert out.rstrip().endswith("the run can start here.")


def _fixes(proc) -> list[str]:
    return proc.stdout.split("missing (the run cannot start until each is fixed):\n")[1].strip().splitlines()


def test_doctor_with_device_neuron_exits_1_naming_what_to_install():
    """This CPU host asked for a Trainium run: no TorchNeuron, no neuron-ls, no driver, no runtime packages."""
    proc = _doctor(["device=neuron"], PATH=f"{Path(sys.executable).parent}:/usr/bin:/bin")
    print(proc.stdout)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    fixes = _fixes(proc)
    assert fixes[0] == ('- device: pip install "torch-neuronx==2.14.*" "neuronx-cc==2.*" nki --extra-index-url '
                        'https://pip.repos.neuron.amazonaws.com --extra-index-url https://download.pytorch.org/whl/cpu '
                        "(README 'Trainium hosts')")
    assert [f.split(":")[0] for f in fixes] == ["- device", "- neuron-ls", "- neuron driver", "- neuron runtime"]


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


# -- the first hour on a trn2: a simulated host (tests/neuron_host_double.py) --------------------------------------
# Acceptance f of issue 22: the table for a healthy host, for one whose cores another process holds, and for one
# missing triton; each exit status and fix line (run with -s to see them).
def _host_doctor(tmp_path, args, **host):
    proc = run_cli(list(args), module="qwen3_research.doctor", env=trn2_host(tmp_path, env=cli_env(), **host),
                   timeout=1800)
    print(f"\n$ python -m qwen3_research.doctor {' '.join(args)}   [simulated trn2.48xlarge: {host or 'healthy'}]")
    print(proc.stdout + proc.stderr + f"exit status {proc.returncode}")
    return proc


def _row(proc, item: str) -> list[str]:
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith(item + "  "))
    return line[len(item):].split(None, 1)


def test_doctor_on_a_healthy_trn2_host_exits_0(tmp_path):
    proc = _host_doctor(tmp_path, ["device=neuron"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _row(proc, "neuron-ls") == ["ok", "16 devices x 4 cores = 64 logical cores (LNC=2 by default), 96 GiB per device"]
    assert _row(proc, "cores in use") == ["ok", "none: no other process holds a NeuronCore"]
    assert _row(proc, "neuron driver")[0] == "ok" and _row(proc, "neuron driver")[1].startswith("2.25.4.0 (")
    assert _row(proc, "neuron runtime") == ["ok", "aws-neuronx-collectives 2.29.41.0, aws-neuronx-dkms 2.25.4.0, "
                                                  "aws-neuronx-runtime-lib 2.29.40.0, aws-neuronx-tools 2.27.33.0"]
    assert _row(proc, "world size")[1].startswith("64 x 1 node(s) = 64 (nproc_per_node=-1: auto)")
    assert _row(proc, "NEURON_RT_* set") == ["info", "none; the run's cores: NEURON_RT_VISIBLE_CORES=<local rank> per "
                                                     "rank (set by torch_neuronx's process group)"]
    assert _row(proc, "NEFF cache")[0] == "ok" and "(TORCH_NEURONX_NEFF_CACHE_DIR)" in _row(proc, "NEFF cache")[1]
    assert _row(proc, "torchtitan models") == ["ok", "import torchtitan.models.qwen3: ok"]
    assert _row(proc, "memory per rank") == ["ok", "24.0 GiB HBM per logical core (get_device_properties)"]
    assert "EFA" not in proc.stdout  # one node: no EFA needed
    assert proc.stdout.rstrip().endswith("the run can start here.")


def test_doctor_names_the_process_holding_cores_and_the_missing_efa(tmp_path):
    """pid 4242 holds device 0 (cores 0-3), which a 64-rank run needs; two nodes without EFA software."""
    proc = _host_doctor(tmp_path, ["device=neuron", "parallelism.nnodes=2", "parallelism.rdzv_endpoint=10.0.0.1:29500"],
                        held={0: (4242, "python other_training.py")}, efa=False)
    assert proc.returncode == 1
    assert _row(proc, "cores in use") == ["MISSING", "pid 4242 (python other_training.py) holds cores 0-3"]
    assert _fixes(proc) == [
        "- cores in use: the run needs cores 0-63: stop the other process (kill 4242) or wait for it; a reserved core "
        "stays unusable until its process ends (Neuron Runtime configuration guide)",
        "- EFA: install the EFA software (aws-efa-installer) and launch every node with EFA network interfaces "
        "(https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-start.html)"]


@pytest.mark.tt022
@pytest.mark.skipif(not titan.legacy(), reason="torchtitan 0.3.x's Qwen3 package does not import triton; the tt022 "
                    "tier (torchtitan 0.2.2, the base of AWS's fork) runs this")
def test_doctor_on_a_host_missing_triton_says_install_it(tmp_path):
    proc = _host_doctor(tmp_path, ["device=neuron"], triton_missing=True)
    assert proc.returncode == 1
    assert _row(proc, "torchtitan models") == [
        "MISSING", "import torchtitan.models.qwen3 failed: ModuleNotFoundError: No module named 'triton'"]
    assert _fixes(proc) == ["- torchtitan models: pip install triton (torchtitan's MoE kernels module imports it; "
                            "AWS's Qwen3 guide installs it; requirements-neuron.txt)"]


@pytest.mark.parametrize("need, status, fix", [
    ("", "ok", None),  # the default, 20 GiB: ok where this disk has that much (checked below)
    ("1e9", "MISSING", "free disk there (need >= 1e+09 GiB; QWEN3_NEFF_CACHE_MIN_GIB sets the minimum), or point "
                       "TORCH_NEURONX_NEFF_CACHE_DIR at a larger writable disk"),
    ("-3", "MISSING", "set QWEN3_NEFF_CACHE_MIN_GIB to a number of GiB >= 0, or unset it (default 20)"),
    ("lots", "MISSING", "set QWEN3_NEFF_CACHE_MIN_GIB to a number of GiB >= 0, or unset it (default 20)"),
])
def test_neff_cache_needs_free_disk(tmp_path, monkeypatch, need, status, fix):
    """The NEFF cache row: >= 20 GiB free on the cache's disk, or what QWEN3_NEFF_CACHE_MIN_GIB says."""
    import shutil

    from qwen3_research.devices.neuron_host import host_checks

    env = trn2_host(tmp_path)
    for k in ("PATH", "QWEN3_SYSFS_ROOT", "TORCH_NEURONX_NEFF_CACHE_DIR"):
        monkeypatch.setenv(k, env[k])
    monkeypatch.setenv("QWEN3_NEFF_CACHE_MIN_GIB", need)
    row = next(r for r in host_checks(1, 1, 2) if r.item == "NEFF cache")
    if need == "":
        status = "ok" if shutil.disk_usage(tmp_path).free >= 20 * 1024**3 else "MISSING"
    assert row.status == status, row
    if fix is not None:
        assert row.fix.startswith(fix), row.fix


def test_host_rows_one_free_core_is_enough_for_one_process(tmp_path, monkeypatch):
    """In-process: a single-process run (NEURON_RT_NUM_CORES=1) is not blocked by a process holding 60 of 64 cores,
    a 2-rank run needing cores 0-1 is; fi_info's efa provider is counted for two nodes."""
    from qwen3_research.devices.neuron_host import host_checks

    env = trn2_host(tmp_path, held={d: (7, "other") for d in range(15)})
    for k in ("PATH", "QWEN3_SYSFS_ROOT", "TORCH_NEURONX_NEFF_CACHE_DIR"):
        monkeypatch.setenv(k, env[k])
    rows = {r.item: r for r in host_checks(1, 1, 2)}
    assert rows["cores in use"].status == "info" and rows["cores in use"].value == "pid 7 (other) holds cores 0-59"
    assert rows["NEURON_RT_* set"].value == "none; the run's cores: NEURON_RT_NUM_CORES=1 (set for this single-process run)"
    rows = {r.item: r for r in host_checks(2, 2, 2)}
    assert rows["cores in use"].status == "MISSING" and "the run needs cores 0-1" in rows["cores in use"].fix
    assert (rows["EFA"].status, rows["EFA"].value) == ("ok", "fi_info -p efa: 2 efa endpoint(s) for parallelism.nnodes=2")
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0-3")
    rows = {r.item: r for r in host_checks(4, 1, 2)}
    assert rows["NEURON_RT_* set"].status == "MISSING"
    assert rows["NEURON_RT_* set"].fix.startswith("NEURON_RT_VISIBLE_CORES=0-3 in the environment would give each of "
                                                  "the 4 ranks the same NeuronCores")


def test_run_checks_on_neuron_use_one_core_and_kernel_shapes():
    """--run on neuron: one process per check (one NeuronCore each) and verify_kernels shapes the NKI kernels take."""
    from qwen3_research.doctor import verify_args

    assert verify_args("nki_moe", "neuron", 2) == ["model=native_moe", "data.seq_len=256", "data.batch_size=1",
                                                   "model.flavor=nki_debug"]
    assert verify_args("nki_rope", "neuron", 1) == ["model=native", "data.seq_len=128", "data.batch_size=1"]
    assert verify_args("nki", "neuron", 2) == verify_args("nki_moe", "neuron", 2)  # both NKI kernels: the MoE flavor
    assert verify_args("fast", "cpu", None) == ["model=native_moe", "data.seq_len=32", "data.batch_size=2"]
    assert verify_args("rope_fast", "cpu", None) == ["model=native", "data.seq_len=32", "data.batch_size=2"]
