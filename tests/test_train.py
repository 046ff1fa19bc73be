"""The main job end to end: loss falls on real text, metrics are sane, W&B holds the same history."""

from __future__ import annotations

import json
import math
import time

import pytest

from tests.conftest import FAST, assert_ok, read_metrics, run_cli, train_losses, wandb_records

METRIC_KEYS = {"step", "loss", "grad_norm", "lr", "tokens_per_s", "mfu", "step_time_s",
               "mem_current_gib", "mem_peak_gib", "mem_peak_pct", "mem_per_rank"}


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """`python -m qwen3_research` exactly as the README runs it (W&B offline), timed."""
    run_dir = tmp_path_factory.mktemp("default") / "run"
    t0 = time.perf_counter()
    proc = run_cli([], run_dir=run_dir, timeout=600)
    elapsed = time.perf_counter() - t0
    assert_ok(proc)
    return run_dir, elapsed, proc


@pytest.mark.slow
def test_default_run_learns(default_run):
    # Wall time is printed, not asserted (a loaded machine would fail it): benchmarks/bench_startup.py times runs.
    run_dir, elapsed, _ = default_run
    losses = train_losses(run_dir)
    print(f"default run: {elapsed:.1f} s, first loss {losses[0]:.4f}, last loss {losses[-1]:.4f}")
    assert len(losses) == 60
    # Untrained, the loss is ~ln(151936) = 11.93; a model that learns English drops far below.
    assert 11.0 < losses[0] < 12.5
    assert losses[-1] <= losses[0] - 1.0


@pytest.mark.slow
def test_metrics_are_complete_and_sane(default_run):
    run_dir, _, _ = default_run
    rows = [r for r in read_metrics(run_dir) if "loss" in r]
    assert rows, "no training rows in metrics.jsonl"
    for r in rows:
        assert METRIC_KEYS <= set(r), f"missing {METRIC_KEYS - set(r)} at step {r.get('step')}"
        assert all(math.isfinite(r[k]) for k in ("loss", "grad_norm", "lr", "tokens_per_s", "mfu", "step_time_s"))
        assert 0 < r["mfu"] <= 1, r["mfu"]
        assert r["tokens_per_s"] > 0 and r["step_time_s"] > 0 and r["lr"] > 0 and r["grad_norm"] > 0
        assert r["mem_current_gib"] > 0 and r["mem_peak_gib"] >= r["mem_current_gib"] * 0.5
        assert 0 < r["mem_peak_pct"] <= 100
        assert [m["rank"] for m in r["mem_per_rank"]] == [0]
    assert [r["step"] for r in rows] == list(range(1, 61))
    evals = [r["eval_loss"] for r in read_metrics(run_dir) if "eval_loss" in r]
    assert len(evals) == 3 and all(math.isfinite(e) for e in evals)  # every 20 steps
    assert evals[-1] < evals[0]


@pytest.mark.slow
def test_run_dir_layout_and_wandb_history_match_metrics(default_run):
    run_dir, _, _ = default_run
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    from omegaconf import OmegaConf

    from qwen3_research.config import register_configs

    register_configs()  # the resolvers .hydra/config.yaml's interpolations use (model.flavor's default)
    saved = OmegaConf.to_container(OmegaConf.load(run_dir / ".hydra" / "config.yaml"), resolve=True)
    records = wandb_records(run_dir)
    run = next(r for r in records if r["type"] == "run")["run"]
    config = run["config"]["update"]
    # The resolved config, as W&B stores it: every group and the values the run used. training.mixed_precision is
    # configured "auto" (.hydra) and recorded as what it resolved to on this device: none on cpu (bf16 on neuron).
    assert saved["training"]["mixed_precision"] == "auto"
    saved["training"]["mixed_precision"] = "none"
    assert saved["training"]["loss"] == "auto"  # likewise training.loss: the chunked loss on cpu
    saved["training"]["loss"] = "chunked"
    assert json.loads((run_dir / "summary.json").read_text())["mixed_precision"] == "none"
    for section in ("model", "parallelism", "optimizer", "data", "training", "kernels", "device"):
        assert config[section] == saved[section], section
    assert config["training"]["steps"] == 60 and config["model"]["flavor"] == "tiny"

    history = {}
    for r in records:
        if r["type"] != "history":
            continue
        items = r["history"]["item"]
        if isinstance(items, list):  # the raw protobuf shape: [{"key"|"nested_key", "value_json"}]
            items = {"/".join(i.get("nested_key") or [i["key"]]): json.loads(i["value_json"]) for i in items}
        if "train/loss" in items:
            history[int(items["train/step"])] = float(items["train/loss"])
    jsonl = {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}
    assert history.keys() == jsonl.keys()
    for step, loss in jsonl.items():
        assert abs(history[step] - loss) < 1e-9, (step, history[step], loss)


@pytest.mark.slow
def test_same_seed_same_losses_other_seed_differs(tmp_path):
    fast = [a for a in FAST if not a.startswith("training.steps")] + ["training.steps=5"]
    runs = {}
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        proc = run_cli(fast + [f"training.seed={seed}"], run_dir=tmp_path / name, timeout=300)
        assert_ok(proc)
        runs[name] = train_losses(tmp_path / name)
    print({k: [round(x, 6) for x in v] for k, v in runs.items()})
    assert len(runs["a"]) == 5
    assert runs["a"] == runs["b"]  # bit-identical on CPU
    assert max(abs(x - y) for x, y in zip(runs["a"], runs["c"])) > 1e-3


def test_summary_json_written(tmp_path):
    proc = run_cli(FAST, run_dir=tmp_path / "r", timeout=300)
    assert_ok(proc)
    import json

    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["steps"] == 3
    assert summary["final_loss"] == train_losses(tmp_path / "r")[-1]
    assert "step     3/3" in proc.stdout  # one console line per logged step


def test_empty_files_source_is_a_config_error(tmp_path):
    (tmp_path / "empty.txt").write_text("   \n")
    proc = run_cli(FAST + ["data=files", f"data.files={tmp_path}/*.txt"], run_dir=tmp_path / "r", timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and not ln.startswith("wandb")]
    assert lines[-1] == "config error: data.source=files: the source has no non-empty documents"


def test_files_source_trains_on_jsonl(tmp_path):
    import json

    text = open(__file__).read()
    with open(tmp_path / "c.jsonl", "w") as fh:
        for i in range(0, len(text), 400):
            fh.write(json.dumps({"body": text[i : i + 400]}) + "\n")
    proc = run_cli(FAST + ["data=files", f"data.files={tmp_path}/*.jsonl", "data.text_field=body"],
                   run_dir=tmp_path / "r", timeout=300)
    assert_ok(proc)
    assert len(train_losses(tmp_path / "r")) == 3


def test_grad_accumulation_matches_the_larger_batch(tmp_path):
    """2 micro-batches of 1 sequence = 1 batch of 2 sequences (same samples, same mean loss)."""
    base = [a for a in FAST if not a.startswith(("data.batch_size", "training.steps"))] + ["training.steps=3"]
    assert_ok(run_cli(base + ["data.batch_size=2"], run_dir=tmp_path / "big"))
    assert_ok(run_cli(base + ["data.batch_size=1", "training.grad_accum=2"], run_dir=tmp_path / "accum"))
    big, accum = train_losses(tmp_path / "big"), train_losses(tmp_path / "accum")
    print("batch 2:", big, "accum 2x1:", accum)
    assert max(abs(a - b) for a, b in zip(big, accum)) < 1e-5
    assert read_metrics(tmp_path / "accum")[0]["tokens"] == read_metrics(tmp_path / "big")[0]["tokens"] == 64
