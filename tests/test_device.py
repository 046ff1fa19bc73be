"""Device facts: LNC export to workers, Neuron HBM / peak FLOP/s (through a test double of
``torch.neuron``), GPU peaks from torchtitan's table, and the per-run peak-memory reset."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from qwen3_research import allocator, devices, titan
from qwen3_research.devices import lnc as lnc_facts
from qwen3_research.devices import runtime as device_runtime
from qwen3_research.errors import ConfigError
from tests.conftest import FAST, assert_ok, cli_env, fault_env, read_metrics, run_cli

GIB = 1024**3


# -- LNC ------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_lnc_reaches_every_worker_environment(tmp_path):
    """device.lnc=1 with 2 CPU worker processes: both ranks read NEURON_LOGICAL_NC_CONFIG=1 from
    their own os.environ (recorded by each worker into summary.json device_facts). The same run checks the
    allocator's off switch: QWEN3_CPU_ALLOCATOR=system gives both workers glibc as it comes (asked of glibc in the
    worker), even when the process that starts the command had mimalloc preloaded (the warm test server)."""
    env = cli_env(**{allocator.ENV: "system"})
    env.pop(devices.LNC_ENV, None)  # the parent shell has no LNC: only device.lnc can put it there
    proc = run_cli([*FAST, "training.steps=1", "device.lnc=1", "parallelism.nproc_per_node=2",
                    "parallelism.dp_shard=2"], run_dir=tmp_path / "run", env=env)
    assert_ok(proc)
    facts = json.loads((tmp_path / "run" / "summary.json").read_text())["device_facts"]
    assert [f["rank"] for f in facts] == [0, 1]  # two worker processes reported
    assert [f[devices.LNC_ENV] for f in facts] == ["1", "1"]
    assert [f["lnc"] for f in facts] == [1, 1]
    print("workers' allocator (QWEN3_CPU_ALLOCATOR=system):", [f["cpu_allocator"] for f in facts])
    assert [f["cpu_allocator"] for f in facts] == ["glibc default (large blocks mmapped)"] * 2


def test_lnc_conflicting_with_environment_is_refused(tmp_path):
    """NEURON_LOGICAL_NC_CONFIG=2 in the shell and device.lnc=1: exit 2, one line, no run dir."""
    proc = run_cli([*FAST, "device.lnc=1"], run_dir=tmp_path / "run", env=cli_env(**{devices.LNC_ENV: "2"}))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == ["config error: device.lnc=1 conflicts with NEURON_LOGICAL_NC_CONFIG=2 in the environment "
                     "(the Neuron runtime reads only the variable); unset NEURON_LOGICAL_NC_CONFIG or pass device.lnc=2"]
    assert not (tmp_path / "run").exists()


def test_lnc_resolution_rules():
    assert devices.resolve_lnc(None, "neuron", env={}) == 2  # trn2 runtime default
    assert devices.resolve_lnc(None, "cpu", env={}) is None  # nothing to export off neuron
    assert devices.resolve_lnc(1, "cpu", env={}) == 1
    assert devices.resolve_lnc(None, "neuron", env={devices.LNC_ENV: "1"}) == 1
    assert devices.resolve_lnc(2, "neuron", env={devices.LNC_ENV: "2"}) == 2  # agreeing is fine
    with pytest.raises(ConfigError, match="device.lnc must be 1 or 2"):
        devices.resolve_lnc(4, "neuron", env={})
    with pytest.raises(ConfigError, match="is not 1 or 2"):
        devices.resolve_lnc(None, "neuron", env={devices.LNC_ENV: "x"})


def test_nproc_auto_is_one_on_cpu_and_logical_cores_on_neuron(monkeypatch):
    """-1 (auto): 1 on cpu; on neuron the count torch_neuronx reports at the LNC (here a test double
    of the counting child process: 64 logical cores at LNC=2, 128 at LNC=1 on a trn2.48xlarge)."""
    assert devices.resolve_nproc_per_node(-1, "cpu", None) == 1
    assert devices.resolve_nproc_per_node(3, "neuron", 2) == 3  # explicit wins
    monkeypatch.setattr(lnc_facts, "neuron_logical_core_count", lambda lnc: {1: 128, 2: 64}[lnc])
    assert devices.resolve_nproc_per_node(-1, "neuron", 2) == 64
    assert devices.resolve_nproc_per_node(-1, "neuron", 1) == 128


def test_logical_core_count_asks_torch_neuronx_at_the_lnc(tmp_path, monkeypatch):
    """The count comes from torch_neuronx.device_count() in a child process started with the LNC in
    its environment. Here torch_neuronx is a test double package whose device_count() answers as a
    trn2.48xlarge would: 128 logical cores at LNC=1, 64 at LNC=2."""
    pkg = tmp_path / "double" / "torch_neuronx"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "# test double of torch_neuronx (device_count only)\n"
        "import os\n"
        "def device_count():\n"
        "    return {'1': 128, '2': 64}[os.environ['NEURON_LOGICAL_NC_CONFIG']]\n")
    monkeypatch.setenv("PYTHONPATH", f"{pkg.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    devices.neuron_logical_core_count.cache_clear()
    try:
        assert devices.neuron_logical_core_count(2) == 64
        assert devices.neuron_logical_core_count(1) == 128
    finally:
        devices.neuron_logical_core_count.cache_clear()


# -- Neuron facts through a test double of torch.neuron -------------------------------------------
class TorchNeuronTestDouble:
    """Test double of ``torch.neuron`` (torch_neuronx/neuron.py, memory.py in AWS's TorchNeuron
    sources): same function names and signatures; one trn2 logical core of 24 GiB at LNC=2."""

    def __init__(self, total_memory: int):
        self.total_memory = total_memory
        self.allocated = 0
        self.peak = 0
        self.calls: list[str] = []

    def device_count(self) -> int:
        return 1

    def synchronize(self, device=None) -> None:
        self.calls.append("synchronize")

    def get_device_properties(self, device=None):
        self.calls.append(f"get_device_properties({device})")
        return SimpleNamespace(name="trn2", total_memory=self.total_memory)

    def memory_allocated(self, device=None) -> int:
        self.calls.append("memory_allocated")
        return self.allocated

    def max_memory_allocated(self, device=None) -> int:
        self.calls.append("max_memory_allocated")
        return self.peak

    def reset_peak_memory_stats(self, device=None) -> None:
        self.calls.append("reset_peak_memory_stats")
        self.peak = self.allocated

    def allocate(self, nbytes: int) -> None:  # what running work would do to the counters
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)

    def free(self, nbytes: int) -> None:
        self.allocated -= nbytes


def _neuron_device(monkeypatch, double, lnc):
    monkeypatch.setattr(torch, "neuron", double, raising=False)
    # "neuron" is a torch device type only once torch_neuronx has registered it.
    monkeypatch.setattr(device_runtime, "_indexed", lambda kind, index: torch.device("meta"))
    monkeypatch.delenv(devices.LNC_ENV, raising=False)
    return devices.Device("neuron", 0, lnc)


def test_neuron_capacity_is_get_device_properties_total_memory(monkeypatch):
    """24 GiB per LNC=2 rank (96 GiB per 8-core trn2 chip), not 24 GiB x LNC = 48 as before."""
    double = TorchNeuronTestDouble(total_memory=24 * GIB)
    dev = _neuron_device(monkeypatch, double, 2)
    assert dev.capacity_bytes() == 24 * GIB
    assert "get_device_properties(0)" in double.calls  # asked for this rank's device index
    assert dev.memory().capacity_gib == 24.0


def test_neuron_peak_flops_at_lnc_1_and_2(monkeypatch):
    """AWS: 157e12 bf16 per LNC=2 rank (TorchTitan.diff), so 78.5e12 at LNC=1; fp32 181e12/8 per core."""
    double = TorchNeuronTestDouble(total_memory=24 * GIB)
    lnc2 = _neuron_device(monkeypatch, double, 2)
    lnc1 = _neuron_device(monkeypatch, double, 1)
    assert lnc2.peak_flops(torch.bfloat16) == 157e12
    assert lnc1.peak_flops(torch.bfloat16) == 78.5e12
    assert lnc2.peak_flops(torch.float32) == pytest.approx(45.25e12)
    assert lnc1.peak_flops(torch.float32) == pytest.approx(22.625e12)
    assert lnc2.peak_dtype(torch.float32) == "fp32" and lnc2.peak_dtype(torch.bfloat16) == "bf16"


def test_neuron_memory_percentages_synchronize_first_and_reset(monkeypatch):
    """6 GiB peak of 24 GiB = 25.0 %; after a reset and 3 GiB of new work the peak is 12.5 %
    (4.5 GiB live then, 1.5 of it left from before); counters are read only after a synchronize."""
    double = TorchNeuronTestDouble(total_memory=24 * GIB)
    dev = _neuron_device(monkeypatch, double, 2)
    double.allocate(6 * GIB)
    double.free(int(4.5 * GIB))
    double.calls.clear()
    m = dev.memory()
    assert double.calls[0] == "synchronize"  # before memory_allocated / max_memory_allocated
    assert (m.current_gib, m.peak_gib, m.peak_pct) == (1.5, 6.0, 25.0)
    dev.reset_peak_memory()
    double.allocate(int(1.5 * GIB))
    m = dev.memory()
    assert (m.peak_gib, m.peak_pct) == (3.0, 12.5)


# -- GPU peaks from torchtitan's table ------------------------------------------------------------
@pytest.mark.parametrize("name, bf16, fp32, tf32", [
    ("NVIDIA H100 80GB HBM3", 989e12, 67e12, 494.5e12),  # the SXM part's CUDA device name
    ("NVIDIA H100 PCIe", 756e12, 51e12, 378e12),
    ("NVIDIA H100 NVL", 835e12, 60e12, 417.5e12),
    ("NVIDIA A100-SXM4-80GB", 312e12, 19.5e12, 156e12),
])
def test_gpu_peaks_by_name_and_dtype(monkeypatch, tmp_path, name, bf16, fp32, tf32):
    """A mocked device-name table (torch.cuda.get_device_name): torchtitan's get_peak_flops tells
    H100 SXM from PCIe; fp32 without TF32 is the CUDA-core peak (15x below bf16 on H100 SXM), not
    TF32's; enabling TF32 switches to half the bf16 peak."""
    monkeypatch.setenv("PATH", str(tmp_path))  # no lspci: torchtitan then reads the name we give
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: name)
    assert devices.tf32_enabled() is False  # PyTorch's default, which this project keeps
    dev = devices.Device("cuda", 0, gpu_peak_table=titan.gpu_peak_flops)  # as the Trainer builds it
    assert dev.peak_flops(torch.bfloat16) == bf16
    assert dev.peak_dtype(torch.float32) == "fp32"
    assert dev.peak_flops(torch.float32) == fp32
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")  # what enabling TF32 sets
    tf = devices.Device("cuda", 0, gpu_peak_table=titan.gpu_peak_flops)
    assert tf.peak_dtype(torch.float32) == "tf32"
    assert tf.peak_flops(torch.float32) == tf32


def test_gpu_peak_reset_gives_each_run_its_own_peak(monkeypatch):
    """A fake process-wide CUDA counter: run 1 peaks at 30 GiB; run 2 (new Device + reset, as the
    Trainer does at start) peaks at 5 GiB and must report 5, not 30."""
    state = {"alloc": 0, "peak": 0}

    def alloc(n):
        state["alloc"] += n
        state["peak"] = max(state["peak"], state["alloc"])

    monkeypatch.setattr(torch.cuda, "set_device", lambda i: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: None)  # the counters are read after queued work
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: state["alloc"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d=None: state["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d=None: state.update(peak=state["alloc"]))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: SimpleNamespace(total_memory=80 * GIB))
    first = devices.Device("cuda", 0)
    first.reset_peak_memory()
    alloc(30 * GIB)
    alloc(-30 * GIB)
    assert first.memory().peak_gib == 30.0
    second = devices.Device("cuda", 0)
    second.reset_peak_memory()
    alloc(5 * GIB)
    assert second.memory().peak_gib == 5.0
    assert second.memory().peak_pct == 6.25  # 5 of 80 GiB


@pytest.mark.slow
def test_single_process_sweep_reports_each_points_own_peak(tmp_path):
    """Two points in one process (Hydra's basic launcher): batch 8 then batch 1 at seq_len 64. The
    logits alone are 8x64x151936x4 B = 311 MB per copy in the first point; the second point's
    peak must come out lower by at least 0.25 GiB, and each point reset the peak (VmHWM on Linux)."""
    sweep = tmp_path / "sweep"
    proc = run_cli(["-m", "data.batch_size=8,1", "data.seq_len=64", "training.steps=2", "training.eval_every=0",
                    "training.loss=full",  # the full-vocabulary logits are the point (the CPU default is chunked)
                    "logging.print_config=false", "logging.wandb.mode=disabled", "parallelism.nproc_per_node=1",
                    f"hydra.sweep.dir={sweep}"])
    assert_ok(proc)
    big, small = (sorted(sweep.glob(f"{i}_*"))[0] for i in (0, 1))
    peaks = [max(r["mem_peak_gib"] for r in read_metrics(d) if "mem_peak_gib" in r) for d in (big, small)]
    resets = [json.loads((d / "summary.json").read_text())["device_facts"][0]["peak_reset"] for d in (big, small)]
    print(f"peaks (GiB): first {peaks[0]:.3f}, second {peaks[1]:.3f}; resets {resets}")
    assert resets == ["VmHWM", "VmHWM"]
    assert peaks[1] < peaks[0] - 0.25, peaks


# -- NeuronCores a process reserves (device.prepare_neuron_cores) ---------------------------------------------
@pytest.fixture
def no_core_pins(monkeypatch):
    for var in (devices.VISIBLE_CORES_ENV, devices.NUM_CORES_ENV):
        monkeypatch.setenv(var, "")  # recorded, so whatever a test puts there is undone
        monkeypatch.delenv(var)
    monkeypatch.setattr(lnc_facts, "_set_by_us", {})


def test_single_process_neuron_run_takes_one_core_and_a_worker_group_none(no_core_pins):
    """One process: NEURON_RT_NUM_CORES=1 (the runtime otherwise reserves every core of the host for it). A later
    64-rank run from the same process (a sweep) does not inherit it; a user's choice of cores is kept."""
    assert devices.prepare_neuron_cores(1) == "NEURON_RT_NUM_CORES=1 (set for this single-process run)"
    assert os.environ["NEURON_RT_NUM_CORES"] == "1"
    assert devices.prepare_neuron_cores(64).startswith("NEURON_RT_VISIBLE_CORES=<local rank> per rank")
    assert "NEURON_RT_NUM_CORES" not in os.environ  # ours removed: each rank gets its own core from torch_neuronx
    env = {}  # a copy (the doctor asks this way): changed, but nothing recorded as ours
    devices.prepare_neuron_cores(1, env=env)
    assert env == {"NEURON_RT_NUM_CORES": "1"} and lnc_facts._set_by_us == {}
    env = {"NEURON_RT_VISIBLE_CORES": "5"}
    assert devices.prepare_neuron_cores(1, env=env) == "NEURON_RT_VISIBLE_CORES=5 (from the environment)"
    assert env == {"NEURON_RT_VISIBLE_CORES": "5"}
    env = {"NEURON_RT_NUM_CORES": "64"}  # AWS's recipe exports NEURON_RT_NUM_CORES=64 for its 64 ranks
    devices.prepare_neuron_cores(64, env=env)
    assert env == {"NEURON_RT_NUM_CORES": "64"}


def test_user_visible_cores_with_a_worker_group_is_a_config_error(no_core_pins):
    with pytest.raises(ConfigError) as e:
        devices.prepare_neuron_cores(4, env={"NEURON_RT_VISIBLE_CORES": "0-3"})
    assert str(e.value) == (
        "NEURON_RT_VISIBLE_CORES=0-3 in the environment would give each of the 4 ranks the same NeuronCores "
        "(torch_neuronx sets it to the local rank only when it is unset); unset NEURON_RT_VISIBLE_CORES, or set "
        "parallelism.nproc_per_node=1 for a single-process run on those cores")


def test_prepare_launch_pins_one_core_for_a_single_process_neuron_run(no_core_pins, monkeypatch, tmp_path):
    """The launcher's start-up (prepare_launch, given the resolved device, LNC and world size of
    ``resolve.ResolvedRun``) on a simulated neuron host: one process -> NEURON_RT_NUM_CORES=1 and the LNC in the
    environment the run inherits; the core count asked afterwards still sees every core (64)."""
    from tests.neuron_host_double import trn2_host

    monkeypatch.setenv("PYTHONPATH", trn2_host(tmp_path)["PYTHONPATH"])  # the torch_neuronx test double, for children
    monkeypatch.setenv(devices.LNC_ENV, "1")  # (prepare_launch exports it: restored after the test)
    devices.neuron_logical_core_count.cache_clear()
    try:
        devices.prepare_launch("neuron", 2, 1)
        assert os.environ[devices.LNC_ENV] == "2" and os.environ[devices.NUM_CORES_ENV] == "1"
        assert devices.neuron_logical_core_count(2) == 64  # the double counts visible cores: ours is not passed on
    finally:
        devices.neuron_logical_core_count.cache_clear()


# -- devices as specs (issue 32) --------------------------------------------------------------------------------
TOY_DEVICE = '''"""A toy device kind: one module, registered as the shipped ones are (qwen3_research/devices/cpu.py)."""
from qwen3_research.devices.registry import register
from qwen3_research.devices.spec import DeviceSpec

SPEC = register(DeviceSpec(
    kind="toy", dist_backend="gloo", start_method="spawn", auto_order=1, present=lambda: PRESENT[0],
    available=lambda: True, visible=lambda: True, unavailable_reason=lambda: "", local_devices=lambda lnc: 3,
    default_precision="bf16", default_loss="full", compile_backend="eager", peaks={"bf16": 1e12, "fp32": 0.5e12},
    torch_type="cpu", torch_device=lambda kind, rank: __import__("torch").device(kind),
    memory=lambda dev: Counters(), peak_flops=lambda dev, key, dtype: SPEC.peaks[key],
))


class Counters:  # the kind's own memory counters (DeviceSpec.memory)
    def reset(self):
        return "toy"

    def current_and_peak(self):
        return 1 << 30, 2 << 30

    def capacity(self):
        return 8 << 30

PRESENT = [False]
'''


def test_a_toy_device_kind_is_one_module(tmp_path, monkeypatch):
    """A device kind from one module (what conf/device/<kind>.yaml names): the registry lists it and gets it,
    device_kind and resolve_device_type take it, auto picks it where it is present (its auto order is lowest),
    a Device runs on it and the dist backend, peaks and nproc come from its spec. An unknown kind is refused
    naming the known ones."""
    import importlib

    (tmp_path / "toy_device.py").write_text(TOY_DEVICE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(devices.registry, "REGISTRY", dict(devices.REGISTRY))  # restored after the test
    monkeypatch.setattr(devices, "REGISTRY", devices.registry.REGISTRY)
    toy = importlib.import_module("toy_device")
    try:
        assert "toy" in devices.kinds() and devices.get("toy") is toy.SPEC
        assert devices.device_kind("toy") == "toy" and devices.device_kind(argv=["device=toy"]) == "toy"
        assert devices.resolve_device_type("toy") == "toy"
        assert devices.device_kind() != "toy"  # absent: auto passes it by
        toy.PRESENT[0] = True
        assert devices.device_kind() == "toy" and devices.kinds()[0] == "toy"
        assert devices.reference_peak("toy", "bf16") == 1e12
        assert devices.resolve_nproc_per_node(-1, "toy", None) == 3
        dev = devices.Device("toy")
        assert dev.spec is toy.SPEC and dev.dist_backend == "gloo"
        assert (dev.memory().current_gib, dev.memory().peak_pct) == (1.0, 25.0)
        assert dev.peak_flops(torch.bfloat16) == 1e12 and dev.peak_flops(torch.float32) == 0.5e12
        with pytest.raises(ConfigError, match=r"device.type='nope' is not a device kind; known: auto, toy, neuron, cuda, cpu"):
            devices.get("nope")
    finally:
        sys.modules.pop("toy_device", None)


def test_the_shipped_specs_hold_what_device_py_and_fit_said():
    """The facts that lived in device.py, config.py, compiling.py, elastic.py and fit.py, now each kind's spec."""
    cpu, cuda, neuron = (devices.get(k) for k in ("cpu", "cuda", "neuron"))
    assert devices.kinds() == ["neuron", "cuda", "cpu"]  # device.type=auto's order
    assert [s.dist_backend for s in (cpu, cuda, neuron)] == ["gloo", "nccl", "neuron"]
    assert [s.start_method for s in (cpu, cuda, neuron)] == ["fork", "spawn", "spawn"]
    assert [s.default_precision for s in (cpu, cuda, neuron)] == ["none", "none", "bf16"]
    assert [s.default_loss for s in (cpu, cuda, neuron)] == ["chunked", "full", "full"]
    assert [s.compile_backend for s in (cpu, cuda, neuron)] == ["inductor", "inductor", "neuron"]
    assert [s.torch_profiler for s in (cpu, cuda, neuron)] == [True, True, False]
    assert [s.memory_snapshot for s in (cpu, cuda, neuron)] == ["profiler", "allocator", None]
    assert [s.runs_on_host for s in (cpu, cuda, neuron)] == [True, False, False]
    assert [s.planning_table is not None for s in (cpu, cuda, neuron)] == [False, True, False]
    assert [s.flex_attention for s in (cpu, cuda, neuron)] == [False, True, False]
    assert [s.kernels_by_shape for s in (cpu, cuda, neuron)] == [False, False, True]
    # fit.py's literal 989e12 and device.py's tables: one place
    assert devices.reference_peak("cuda", "bf16") == 989e12 and devices.reference_peak("cuda", "fp32") == 67e12
    assert devices.reference_peak("cuda", "tf32") == 494.5e12
    assert devices.reference_peak("neuron", "bf16") == 157e12 and devices.reference_peak("neuron", "fp32") == 45.25e12
    with pytest.raises(KeyError, match="no reference tf32 peak"):
        devices.reference_peak("neuron", "tf32")
    assert cuda.compile_default(False, "bf16", ()) == (True, "auto: cuda, dense, bf16 measured 1.67x faster compiled "
                                                             "on one H200")
    assert cuda.compile_default(True, "bf16", ())[0] is False and neuron.compile_default is None


def test_device_kind_asks_no_torch(tmp_path):
    """devices.device_kind in a fresh process: torch stays unimported; auto is neuron where torch_neuronx is
    installed (a package on the path), cpu here; the command line's last device= wins."""
    import subprocess
    import sys as _sys

    code = ("import sys; from qwen3_research import devices; "
            "print(devices.device_kind(), devices.device_kind(argv=['device=cuda', 'device.type=cpu']), "
            "devices.device_kind('cuda'), 'torch' in sys.modules)")
    (tmp_path / "torch_neuronx").mkdir()
    (tmp_path / "torch_neuronx" / "__init__.py").write_text("")
    here = subprocess.run([_sys.executable, "-c", code], capture_output=True, text=True, env=cli_env(), timeout=120)
    trn = subprocess.run([_sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=cli_env(PYTHONPATH=f"{tmp_path}{os.pathsep}{cli_env().get('PYTHONPATH', '')}"))
    print(here.stdout, trn.stdout, here.stderr[-500:])
    assert here.stdout.split() == ["cpu", "cpu", "cuda", "False"]
    assert trn.stdout.split() == ["neuron", "cpu", "cuda", "False"]


# -- a new kind is one module and one YAML, through the CLI (issue 39) ----------------------------------------------
TOY_CONF = Path(__file__).parent / "conf"  # tests/conf/device/toy.yaml: what conf/device/<kind>.yaml is for a shipped kind


@pytest.mark.slow
def test_a_toy_device_kind_trains_checkpoints_and_resumes_through_the_cli(tmp_path):
    """tests/toy_device.py (a CPU-backed kind, registered through QWEN3_RESEARCH_DEVICE_MODULES) and
    tests/conf/device/toy.yaml (found through hydra.searchpath), nothing else: 4 steps straight with a checkpoint
    every 2; the same run killed in step 3 (after the step-2 save) and resumed reproduces steps 3-4 exactly. Every
    run reports device=toy, and its spec's peaks reach the MFU (the toy's made-up 1e12, not a measured CPU peak)."""
    env = cli_env(QWEN3_RESEARCH_DEVICE_MODULES="tests.toy_device")
    args = ["device=toy", f"hydra.searchpath=[file://{TOY_CONF}]", "training.steps=4", "data.seq_len=32",
            "data.batch_size=2", "training.eval_every=0", "logging.print_config=false", "logging.wandb.mode=disabled",
            "checkpoint.enable=true", "checkpoint.every=2"]
    straight, run = tmp_path / "straight", tmp_path / "run"
    first = run_cli(args, run_dir=straight, env=env)
    assert_ok(first)
    killed = run_cli(args, run_dir=run, env={**env, **fault_env("kill@3")})
    assert killed.returncode == -9, killed.stderr[-2000:]
    resumed = run_cli([*args, "checkpoint.resume=auto"], run_dir=run, env=env)
    assert_ok(resumed)
    assert "step-00000002 at step 2" in resumed.stdout, resumed.stdout[-2000:]
    ref = [r["loss"] for r in read_metrics(straight) if "loss" in r]
    got = [r["loss"] for r in read_metrics(run) if "loss" in r]  # steps 1-2, then 3-4 appended by the resume
    print(f"\ntoy device losses: straight {ref}\n                   resumed  {got}")
    assert "device=toy" in first.stdout and "device=toy" in resumed.stdout
    facts = json.loads((run / "summary.json").read_text())["device_facts"][0]
    assert facts["device"] == "cpu" and facts["peak_flops"] == 1e12 and facts["lnc"] is None, facts
    assert len(ref) == 4 and got == ref


# -- the CPU peak table (devices/peaks.py) shared by processes (issue 39), and a cache folder it cannot use (40) --------
MEASURE = """
import os, sys, time
import torch
from qwen3_research.devices import peaks
dtype = getattr(torch, sys.argv[1])
open(sys.argv[2], "w").close()  # ready: imports done
while not os.path.exists(sys.argv[3]):  # start together
    time.sleep(0.005)
peak = peaks.cached_cpu_peak(dtype)  # an empty table: both measure, then write
for i in range(1, 101):  # a hundred read-modify-writes each, interleaved with the other's
    last = peaks.raise_cpu_peak(dtype, peak + i)
print(dtype, last)  # the table keys its entry by (cpu, cores, threads, dtype, torch)
"""


def test_two_processes_measuring_at_once_keep_both_entries(tmp_path):
    """Two real processes, one cache folder (QWEN3_RESEARCH_CACHE), started together on an empty cpu_peak.json: each
    measures its own entry (fp32, fp64), then raises it 100 times. Both entries survive with each process's last
    value: without the table's lock a process writes back the table it read before the other's write, and one entry
    (or its latest value) is lost."""
    import subprocess

    cache, go = tmp_path / "cache", tmp_path / "go"
    env = cli_env(QWEN3_RESEARCH_CACHE=str(cache))
    procs = [subprocess.Popen([sys.executable, "-c", MEASURE, dtype, str(tmp_path / dtype), str(go)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for dtype in ("float32", "float64")]
    deadline = 120
    while not all((tmp_path / d).exists() for d in ("float32", "float64")) and deadline > 0:
        import time

        time.sleep(0.05)
        deadline -= 0.05
    go.touch()
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    written = {d: float(v) for d, v in (out.strip().splitlines()[-1].split() for out, _ in outs)}
    table = json.loads((cache / "cpu_peak.json").read_text())
    kept = {d: next((v for k, v in table.items() if f"|{d}|" in k), None) for d in written}
    print(f"\ncpu_peak.json after two processes at once: {len(table)} entries; "
          + "; ".join(f"{d}: {kept[d]} (its process wrote {v})" for d, v in written.items()))
    assert len(written) == 2 and kept == written
    assert not list(cache.glob("*.tmp"))


def _read_only_folder(tmp_path) -> Path:
    """A folder this process cannot create a file in: a chmod 555 one, or (root writes there anyway) sysfs's."""
    ro = tmp_path / "read-only"
    ro.mkdir()
    ro.chmod(0o555)
    for folder in (ro, Path("/sys/fs")):
        try:
            (folder / "probe").touch()
            (folder / "probe").unlink()
        except OSError:
            return folder
    pytest.skip("no folder this process cannot write to")


MEASURE_IN = """
import torch
from qwen3_research import devices
dev = devices.Device("cpu")
peak = dev.peak_flops(torch.float32)  # measured: no table to read
raised = dev.observed_flops(torch.float32, 2 * peak)  # a run beat it: raised, kept in this process
print(raised == 2 * peak, devices.cached_cpu_peak(torch.float32) == 2 * peak)
"""


@pytest.mark.parametrize("what", ["read-only", "a file"])
def test_an_unusable_cache_folder_warns_once_and_the_process_goes_on(tmp_path, what):
    """QWEN3_RESEARCH_CACHE read-only, or a file: a CPU device measures its peak, raises it and reads it back as a
    run does; the process warns once naming the folder and the variable that moves it, keeps its own table (the
    raised peak is the one it reads back), exits 0 and leaves no cpu_peak.<pid>.tmp. Before: a traceback, exit 1.
    (A full disk is not simulated here: it fails the same write, an OSError, in the same place.) Only the peak
    table: the token cache under the same folder (data.py) is issue 40's other part."""
    import subprocess

    if what == "a file":
        cache = tmp_path / "cache"
        cache.write_text("not a folder")
    else:
        cache = _read_only_folder(tmp_path)
    proc = subprocess.run([sys.executable, "-c", MEASURE_IN], capture_output=True, text=True, timeout=300,
                          env=cli_env(QWEN3_RESEARCH_CACHE=str(cache)))
    warnings = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "warning" in ln]
    print(f"\n{what}: exit {proc.returncode}, stdout {proc.stdout.split()}, {len(proc.stderr.splitlines())} stderr "
          f"line(s): {warnings}")
    assert proc.returncode == 0 and proc.stdout.split() == ["True", "True"], proc.stderr[-2000:]
    assert len(proc.stderr.splitlines()) == len(warnings) == 1, proc.stderr
    assert str(cache) in warnings[0] and "QWEN3_RESEARCH_CACHE" in warnings[0], warnings
    assert not list(tmp_path.rglob("cpu_peak.*.tmp")) and (not cache.is_dir() or not list(cache.glob("*.tmp")))
