"""checkpoint.async_mode: an asynchronous save holds the state of its step, is invisible until its write completed,
and a signal's save waits for it; the pinned mode is refused on CPU. (The SIGKILL during an asynchronous save and
the resume after it: tests/test_checkpoint.py::test_kill_during_an_async_save_resumes_from_the_previous_checkpoint.)"""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import pytest
import torch

from tests.conftest import FAST, run_cli


def _state(seed: int):
    from qwen3_research.run.train_state import TrainState

    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return TrainState(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1)))


def _train(state) -> None:
    state.model(torch.ones(2, 4) * (state.step + 1)).square().sum().backward()
    state.optimizer.step()
    state.optimizer.zero_grad()
    state.scheduler.step()
    state.step += 1


def _checkpointer(state, run_dir: Path, **cfg):
    from qwen3_research.config import CheckpointConfig
    from qwen3_research.run.checkpoint import Checkpointer

    return Checkpointer(state, CheckpointConfig(enable=True, **cfg), run_dir=run_dir, total_steps=9, layout="world=1",
                        data_layout={"seq_len": 4}, config={"model": {"backend": "toy"}})


def _names(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def _reloaded(run_dir: Path):
    state = _state(99)  # other weights, no optimizer state
    _checkpointer(state, run_dir, resume="auto").maybe_resume()
    return state


def _tensors(state) -> list[torch.Tensor]:
    out = [p.detach() for p in state.model.parameters()]
    for p in state.model.parameters():
        out += [state.optimizer.state[p][k] for k in ("exp_avg", "exp_avg_sq", "step")]
    return out


@pytest.mark.feature("asynchronous checkpoints (checkpoint.async_mode)")
def test_an_async_save_is_its_steps_state_and_unpublished_until_written(tmp_path, monkeypatch):
    """Step 2 saved asynchronously while its write is held back and step 3 changes every tensor: nothing is
    published (resume=auto finds no checkpoint) until the write completes, and the reload equals a synchronous save
    of step 2 exactly (weights, AdamW moments, schedule, step). Fails if the directory were published before the
    write's future resolved, or if the write read the live tensors instead of the staged copy."""
    from torch.distributed.checkpoint.filesystem import _FileSystemWriter

    from qwen3_research.run.checkpoint import find_checkpoint

    state = _state(0)
    _train(state), _train(state)
    _checkpointer(state, tmp_path / "sync").save(2)

    started, release = threading.Event(), threading.Event()
    write_data = _FileSystemWriter.write_data

    def held(self, plan, planner):  # the background write waits until the test has trained step 3
        started.set()
        assert release.wait(120)
        return write_data(self, plan, planner)

    monkeypatch.setattr(_FileSystemWriter, "write_data", held)
    ck = _checkpointer(state, tmp_path / "async", every=2, async_mode="async")
    stall = ck.maybe_save(2)
    assert started.wait(120), "the write did not start"
    _train(state)  # the weights, moments and schedule change while step 2 is being written
    print(f"\nwhile step 2 is written: {_names(tmp_path / 'async')}; stall {stall:.4f}s")
    assert _names(tmp_path / "async") == [".tmp-step-00000002"]
    assert find_checkpoint("auto", tmp_path / "async" / "checkpoints") is None and ck.published is None
    release.set()
    ck.wait()
    assert _names(tmp_path / "async") == ["step-00000002"] and ck.published == 2

    a, s = _reloaded(tmp_path / "async"), _reloaded(tmp_path / "sync")
    assert a.step == s.step == 2 and a.scheduler.get_last_lr() == s.scheduler.get_last_lr()
    assert all(torch.equal(x, y) for x, y in zip(_tensors(a), _tensors(s)))
    assert not torch.equal(_tensors(a)[0], _tensors(state)[0])  # step 3 really changed the weights
    assert ck.stalls == [{"step": 2, "mode": "async", "stall_s": stall}]


def test_a_signals_save_waits_for_the_one_in_flight_and_is_complete_on_return(tmp_path, monkeypatch):
    """save_now (a stop signal) with step 2's asynchronous write still held: it returns only once step 2 is
    published and step 3 saved synchronously; summary.json's stall record names both saves."""
    from torch.distributed.checkpoint.filesystem import _FileSystemWriter

    from qwen3_research.run.checkpoint import is_complete

    state = _state(0)
    _train(state), _train(state)
    started, release = threading.Event(), threading.Event()
    write_data = _FileSystemWriter.write_data

    def held_once(self, plan, planner):
        if not started.is_set():
            started.set()
            assert release.wait(120)
        return write_data(self, plan, planner)

    monkeypatch.setattr(_FileSystemWriter, "write_data", held_once)
    ck = _checkpointer(state, tmp_path, every=2, async_mode="async")
    ck.maybe_save(2)
    assert started.wait(120)
    _train(state)
    threading.Timer(0.5, release.set).start()
    path = ck.save_now()
    assert path.name == "step-00000003" and is_complete(path) and is_complete(path.parent / "step-00000002")
    summary = ck.stall_summary()
    print(f"\n{summary}")
    assert [(s["step"], s["mode"]) for s in summary["checkpoint_stalls"]] == [(2, "async"), (3, "sync")]
    assert summary["checkpoint_stalls"][1]["stall_s"] >= 0.4  # it waited for step 2's write


def _fsdp_state(seed: int, rank: int):
    from torch.distributed.fsdp import fully_shard

    from qwen3_research.run.train_state import TrainState

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 6))
    fully_shard(model)
    model.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return TrainState(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1)), rank=rank)


def _fsdp_train(state, rank: int) -> None:
    state.model(torch.ones(2, 8) * (state.step + 1 + rank)).square().sum().backward()
    state.optimizer.step()
    state.optimizer.zero_grad()
    state.scheduler.step()
    state.step += 1


def _full(state) -> list[torch.Tensor]:
    """Every parameter and AdamW moment, gathered (collective)."""
    out = []
    for p in state.model.parameters():
        out += [t.full_tensor() for t in (p.detach(), state.optimizer.state[p]["exp_avg"],
                                          state.optimizer.state[p]["exp_avg_sq"])]
    return out


def _two_ranks(rank: int, world: int, port: int, tmp: str, out: str) -> None:
    import torch.distributed as dist

    from qwen3_research.config import CheckpointConfig
    from qwen3_research.run.checkpoint import Checkpointer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)

    def checkpointer(state, where: str, **cfg):
        return Checkpointer(state, CheckpointConfig(enable=True, **cfg), run_dir=Path(tmp) / where, total_steps=9,
                            layout=f"world={world}", data_layout={"seq_len": 8}, config={"model": {"backend": "toy"}},
                            rank=rank, world_size=world)

    state = _fsdp_state(0, rank)
    _fsdp_train(state, rank), _fsdp_train(state, rank)
    checkpointer(state, "sync").save(2)
    ck = checkpointer(state, "async", every=2, async_mode="async")
    ck.maybe_save(2)
    for _ in range(3):  # FSDP's collectives on the default group while DCP's run on the save's own gloo group
        _fsdp_train(state, rank)
    ck.wait()
    dist.barrier()
    loaded = []
    for where in ("async", "sync"):
        s = _fsdp_state(1, rank)
        checkpointer(s, where, resume="auto").maybe_resume()
        loaded.append((s.step, s.scheduler.get_last_lr(), _full(s)))
    trained = _full(state)
    if rank == 0:
        (a_step, a_lr, a), (s_step, s_lr, b) = loaded
        torch.save({"steps": (a_step, s_step), "lrs": (a_lr, s_lr), "equal": all(torch.equal(x, y) for x, y in zip(a, b)),
                    "moved": not torch.equal(a[0], trained[0])}, out)
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_fsdp2_ranks_save_asynchronously_what_they_save_synchronously(tmp_path):
    """2 gloo ranks, FSDP2, AdamW: step 2 saved asynchronously while three more steps run their collectives, and the
    same step saved synchronously, reload to the same gathered weights and moments, bit for bit."""
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tmp_path / "result.pt"
    mp.start_processes(_two_ranks, args=(2, port, str(tmp_path), str(out)), nprocs=2, start_method="spawn")
    result = torch.load(out)
    print(f"\n{result}")
    assert result["steps"] == (2, 2) and result["lrs"][0] == result["lrs"][1]
    assert result["equal"] and result["moved"]


def test_pinned_staging_is_refused_on_cpu_in_one_line(tmp_path):
    """torch's pinned staging asserts an accelerator (torch/distributed/checkpoint/staging.py): one config error,
    exit 2, before any worker starts or the run dir is made."""
    run = tmp_path / "run"
    proc = run_cli([*FAST, "device=cpu", "checkpoint.enable=true", "checkpoint.async_mode=async_with_pinned_mem"],
                   run_dir=run)
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    print(f"\nexit {proc.returncode}: {lines[-1]}")
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("config error: checkpoint.async_mode=async_with_pinned_mem") and "device cpu" in lines[0]
    assert "checkpoint.async_mode=async" in lines[0] and not run.exists()
