"""Composition of every config-group combination, and one-line errors for bad configurations."""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from qwen3_research.compose import CONF_DIR
from qwen3_research.config import ConfigError, RunConfig, register_configs, validate
from tests.conftest import run_cli

register_configs()

GROUPS = ["model", "parallelism", "kernels", "optimizer", "data", "device"]


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (Path(CONF_DIR) / group).glob("*.yaml"))


# What each option needs to be a complete run config (paths are only checked for data.files).
EXTRAS = {
    ("model", "hf"): ["model.path=/models/Qwen3-0.6B"],
    ("data", "files"): [f"data.files={Path(__file__).resolve()}"],
    ("data", "hf"): ["data.hf.name=wikitext"],
}


def test_every_combination_composes_and_validates():
    combos = list(itertools.product(*(options(g) for g in GROUPS)))
    assert len(combos) >= 3 * 1 * 1 * 1 * 3 * 4, f"too few options: {[options(g) for g in GROUPS]}"
    # Hydra composes each option of each group once, and every combination is assembled from those typed sections
    # and validated. Exact, because every option writes only its own group's section and interpolates only its own
    # keys (no option has a global package: test_group_options_extend_their_schema). Typing against the schema once
    # per section matters: OmegaConf's merge is 23 ms, and a compose per combination of the first four groups was
    # most of this test's minute.
    import copy
    import dataclasses

    from qwen3_research.resolve import check_device_settings

    def typed(cfg) -> RunConfig:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), cfg))

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        base = typed(OmegaConf.to_container(compose(config_name="config", overrides=[])))
        sections = {(g, o): getattr(typed({g: OmegaConf.to_container(
                        compose(config_name="config", overrides=[f"{g}={o}", *EXTRAS.get((g, o), [])])[g])}), g)
                    for g in GROUPS for o in options(g)}
    for combo in combos:
        rc = copy.deepcopy(dataclasses.replace(base, **{g: sections[(g, o)] for g, o in zip(GROUPS, combo)}))
        assert isinstance(rc, RunConfig)
        assert rc.model.backend == {"native": "native", "native_moe": "native", "hf": "hf"}[combo[0]]
        if rc.device.type == "neuron" and importlib.util.find_spec("torch_neuronx") is None:
            with pytest.raises(ConfigError, match="device.type=neuron needs TorchNeuron"):
                check_device_settings(validate(rc))
        else:
            check_device_settings(validate(rc))  # every shipped combination is valid as composed
    print(f"composed and validated {len(combos)} combinations")


def test_group_options_extend_their_schema(tmp_path):
    """A misspelled key inside a YAML option fails at compose time, naming the key."""
    import shutil

    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    (conf / "model" / "typo.yaml").write_text("defaults:\n  - /model_schema@_here_\n  - _self_\nflavr: tiny\n")
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        with pytest.raises(Exception) as e:
            compose(config_name="config", overrides=["model=typo"])
    from qwen3_research.compose import format_compose_error

    line = format_compose_error(e.value)
    assert "flavr" in line and "\n" not in line, line


# (overrides, text the one-line message must contain)
BAD = [
    (["model.flavr=tiny"], "model.flavr"),
    (["+training.stepz=3"], "training.stepz"),
    (["optimizer.lr=fast"], "optimizer.lr"),
    (["training.steps=1.5"], "training.steps"),
    (["model=transformer"], "model"),
    (["optimizer.lr=0"], "optimizer.lr must be > 0"),
    (["optimizer.lr=-1e-3"], "optimizer.lr must be > 0"),
    (["data.seq_len=0"], "data.seq_len must be >= 1"),
    (["data.batch_size=0"], "data.batch_size must be >= 1"),
    (["model.flavor=7B"], "model.flavor='7B'"),
    (["device=neuron"], "device.type=neuron needs TorchNeuron"),
    (["data=files", "data.files=/nonexistent/dir/*.txt"], "data.files='/nonexistent/dir/*.txt' matches no file"),
    (["data=files"], "data.files is required"),
    (["model=hf"], "model.path is required"),
    (["optimizer.decay=exp"], "optimizer.decay='exp' is not one of"),
    (["logging.wandb.mode=sometimes"], "logging.wandb.mode"),
    (["training.mixed_precision=fp8"], "training.mixed_precision"),
    (["optimizer.betas=[0.9,1.5]"], "optimizer.betas"),
    (["training.steps=3", "profiling.steps=[3,2]"], "profiling.steps=[3, 2] must be [a,b] with 1 <= a <= b <= training.steps=3"),
]


@pytest.mark.parametrize("overrides,expected", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_config_exits_with_one_line(overrides, expected, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(overrides, run_dir=run_dir, timeout=120)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, f"exit {proc.returncode}: {proc.stderr[-2000:]}"
    assert len(lines) == 1, f"expected one line, got:\n{proc.stderr}"
    assert expected in lines[0], lines[0]
    assert lines[0].startswith("config error: ")
    assert not run_dir.exists(), "a bad config must not create a run directory"


def test_validate_names_key_in_process():
    rc = RunConfig()
    rc.training.log_every = 0
    with pytest.raises(ConfigError, match="training.log_every must be > 0"):
        validate(rc)


def test_help_lists_groups():
    proc = run_cli(["--help"], timeout=120)
    assert proc.returncode == 0
    for group in GROUPS:
        assert f"{group}:" in proc.stdout or f"{group}/" in proc.stdout, group
    assert "native_moe" in proc.stdout and "embedded" in proc.stdout
    assert "Every key, its default and the module that reads it: docs/CONFIG.md" in proc.stdout
    # Hydra's --info prints Hydra's own information, not one run's values (issue 40: the help said it did)
    assert "--info defaults-tree" in proc.stdout and "with --info." not in proc.stdout
    # The per-group schemas are internal: they are not a group a user picks from.
    groups = proc.stdout.split("== Config ==")[0]
    assert "schema" not in groups, groups


@pytest.mark.parametrize("args,expected", [
    (["-m", "training.stepz=1,2"], "config error: training.stepz: unknown key"),
    (["-m", "model=nativ,hf"], "Could not find 'model/nativ'"),
    (["-m", "training.steps=two,3"], "config error: training.steps"),
    (["--cfg", "job", "training.stepz=1"], "config error: training.stepz: unknown key"),
], ids=["sweep-unknown-key", "sweep-unknown-option", "sweep-wrong-type", "cfg-unknown-key"])
def test_sweep_and_cfg_typos_are_one_line_like_a_run(args, expected, tmp_path):
    """Hydra alone would print a multi-line message and exit 1; a plain run gives one line and exit 2."""
    proc = run_cli([*args, f"hydra.sweep.dir={tmp_path / 'sweep'}"], timeout=120)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, f"exit {proc.returncode}: {proc.stderr[-2000:]}"
    assert len(lines) == 1 and expected in lines[0], proc.stderr
    assert not (tmp_path / "sweep").exists()


def test_cfg_still_prints_the_config():
    proc = run_cli(["--cfg", "job", "training.steps=7"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "steps: 7" in proc.stdout


def test_sweep_with_no_points_says_so(tmp_path):
    proc = run_cli(["-m", "training.steps=range(0,0)", f"hydra.sweep.dir={tmp_path / 'sweep'}"], timeout=120)
    assert proc.returncode == 2, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("config error")]
    assert errors == ["config error: the sweep has no points: its swept values (training.steps=range(0,0)) give no "
                      "combination to run; give every swept key at least one value"], proc.stderr
    assert "compare:" not in proc.stderr


def test_kernel_warning_is_one_console_line():
    import subprocess
    import sys

    # What every command and rank sets up (qwen3_research.startup): a warning is one "warning: ..." line, without
    # the source file and line (pytest swaps the warning hooks per test, so a fresh process shows it).
    code = ("import warnings; from qwen3_research.startup import quiet_libraries; quiet_libraries(); "
            "from qwen3_research.kernels.registry import KernelMatchWarning; "
            "warnings.warn(\"kernel entry 'moe_fast' matches no module\", KernelMatchWarning); "
            "warnings.warn(\"kernel entry 'moe_fast' matches no module\", KernelMatchWarning)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stderr == "warning: kernel entry 'moe_fast' matches no module\n", out.stderr


# -- experiment presets (conf/experiment/): AWS's Trainium recipes -------------------------------------------------
# The one group whose options set keys of several sections (# @package _global_, the lightning-hydra-template
# way); every other option writes only its own section (test_group_options_extend_their_schema).
def test_only_experiment_options_are_global():
    for group in GROUPS:
        for path in (Path(CONF_DIR) / group).glob("*.yaml"):
            assert "@package" not in path.read_text(), f"{path}: a group option writes only its own section"
    experiments = options("experiment")
    assert experiments == ["sft", "trn2_lora", "trn2_qwen3_8b", "trn2_smoke"]  # sft, trn2_lora: issue 41
    for name in experiments:
        assert (Path(CONF_DIR) / "experiment" / f"{name}.yaml").read_text().startswith("# @package _global_\n")


# AWS's Qwen3-8B recipe, parmoham-aws/test-repo-parmoham docs/torchtitan/qwen3/qwen3_8b_tp4_fsdp.toml, and the
# torchtitan 0.2.2 defaults it leaves implicit (AdamW betas/weight decay, linear decay to 0, bf16 params).
AWS_QWEN3_8B = {
    "model.flavor": "8B", "data.seq_len": 4096, "data.batch_size": 1, "parallelism.tp": 4,
    "parallelism.dp_shard": -1, "parallelism.dp_replicate": 1, "parallelism.nproc_per_node": 64,
    "parallelism.activation_checkpoint": "selective", "optimizer.lr": 3e-4, "optimizer.eps": 1e-8,
    "optimizer.betas": [0.9, 0.95], "optimizer.weight_decay": 0.1, "optimizer.warmup_steps": 2,
    "optimizer.decay": "linear", "optimizer.min_lr_ratio": 0.0, "optimizer.grad_clip": 1.0, "training.steps": 500,
    "training.mixed_precision": "bf16", "training.grad_accum": 1, "training.eval_every": 0, "compile.enable": False,
    "checkpoint.enable": False, "device.type": "neuron"}
# Its single-core smoke test (TorchTitan_Neuron_Tutorial_Qwen3_on_AWS_Trainium.md): one core, debug model, TP 1,
# global batch 2 over local batch 1.
AWS_SMOKE = {**AWS_QWEN3_8B, "model.flavor": "debug", "parallelism.tp": 1, "parallelism.nproc_per_node": 1,
             "training.grad_accum": 2, "training.steps": 10}


def _simulate_torchneuron(monkeypatch):
    """validate() asks importlib whether torch_neuronx is installed: here it is (a Trainium host)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "torch_neuronx" else real(name, *a))


@pytest.mark.parametrize("name,expected", [("trn2_qwen3_8b", AWS_QWEN3_8B), ("trn2_smoke", AWS_SMOKE)])
def test_trn2_presets_equal_aws_recipe_and_validate(name, expected, monkeypatch):
    from qwen3_research import models
    from qwen3_research.config import to_run_config
    from qwen3_research.parallel import validate_degrees
    from qwen3_research.resolve import auto_settings

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"experiment={name}"])
    rc = to_run_config(auto_settings(OmegaConf.to_container(cfg, resolve=True)))  # the auto settings as a run resolves them
    got = {k: getattr(getattr(rc, k.split(".")[0]), k.split(".")[1]) for k in expected}
    assert got == expected
    _simulate_torchneuron(monkeypatch)
    validate(rc)
    d = validate_degrees(rc.parallelism, seq_len=rc.data.seq_len, **models.describe(rc.model))
    print(f"experiment={name}: {d.describe()}")
    assert (d.world_size, d.dp_shard, d.tp) == ((64, 16, 4) if name == "trn2_qwen3_8b" else (1, 1, 1))
    # a command-line key still wins over the preset
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        assert compose(config_name="config", overrides=[f"experiment={name}", "data.seq_len=256"]).data.seq_len == 256


def test_mixed_precision_auto_is_bf16_on_neuron_only(monkeypatch):
    """training.mixed_precision defaults to auto: bf16 on neuron (AWS's recipes), none on cpu/cuda (unchanged);
    an explicit value is kept; device=auto follows TorchNeuron's presence, as the device itself does. The auto
    settings are filled in one place (``resolve.auto_settings``); ``to_run_config`` and ``validate`` are pure."""
    from qwen3_research.config import to_run_config
    from qwen3_research.resolve import auto_settings

    def resolved(device, mp="auto"):
        return auto_settings({"device": {"type": device}, "training": {"mixed_precision": mp}})["training"]

    assert [resolved(d)["mixed_precision"] for d in ("cpu", "cuda", "neuron", "auto")] == ["none", "none", "bf16", "none"]
    assert resolved("neuron", "none")["mixed_precision"] == "none" and resolved("cpu", "bf16")["mixed_precision"] == "bf16"
    assert RunConfig().training.mixed_precision == "auto"
    assert to_run_config(auto_settings({"device": {"type": "neuron"}})).training.mixed_precision == "bf16"
    assert to_run_config({"device": {"type": "neuron"}}).training.mixed_precision == "auto"  # pure: nothing filled in
    rc = RunConfig()
    assert validate(rc) is rc and rc.training.mixed_precision == "auto" and rc.training.loss == "auto"  # not mutated
    _simulate_torchneuron(monkeypatch)
    assert resolved("auto")["mixed_precision"] == "bf16"


def test_a_misspelled_key_in_an_experiment_preset_fails_at_compose_time(tmp_path):
    """A global preset is typed by the run schema like any option: one line naming the key."""
    import shutil

    from qwen3_research.compose import format_compose_error

    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    (conf / "experiment" / "typo.yaml").write_text("# @package _global_\ntraining:\n  stepz: 3\n")
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        with pytest.raises(Exception) as e:
            compose(config_name="config", overrides=["experiment=typo"])
    assert format_compose_error(e.value) == ("config error: training.stepz: unknown key (Key 'stepz' not in "
                                             "'TrainingConfig'); check the spelling, or print valid keys with --cfg job")
