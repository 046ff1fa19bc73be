"""Measured matmul peaks: the practical peak of a device at this thread count, and the CPU's cached per (cpu,
threads, dtype, torch) so every run on this host computes its MFU over the same figure. The reference (datasheet)
peaks are each kind's spec's (``DeviceSpec.peaks``; ``devices.reference_peak``). torch is imported when called."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

from qwen3_research.devices.host import cache_dir


def measure_matmul_peak(device, dtype, n: int = 1024, seconds: float = 0.4) -> float:
    """Best observed square-matmul FLOP/s on ``device`` (a torch.device) in ``dtype``."""
    import torch

    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = 0.0
    deadline = time.perf_counter() + seconds
    a @ b  # warm-up
    # At least one timed product: a slow dtype (bf16 on a CPU without bf16 units takes longer
    # than ``seconds`` per product) would otherwise report, and cache, a peak of 0.
    while best == 0.0 or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        a @ b
        torch.get_device_module(device).synchronize(device)  # asynchronous devices: wait for the product
        best = max(best, 2 * n**3 / (time.perf_counter() - t0))
    return best


CACHE_ENV = "QWEN3_RESEARCH_CACHE"
TABLE = "cpu_peak.json"
_unusable: dict = {}  # this process's table once the cache folder failed (a warning said so, once)


def _cpu_peak_key(dtype) -> str:
    import platform  # here, not at the top: 2 ms of every start (the allocator's re-exec pays it twice)

    import torch

    threads = torch.get_num_threads()
    return f"{platform.processor() or platform.machine()}|{os.cpu_count()}|{threads}|{dtype}|torch{torch.__version__}"


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _update_cpu_peak(key: str, new: Callable[[float | None], float | None]) -> float:
    """The table's entry ``key`` after ``new(current entry or None)`` (None: keep it), read and rewritten under
    the table's lock: two processes measuring at once (two pytest workers, two sweep points on one host) each
    add their entry to what the other wrote instead of writing back the table they read before it. A cache folder
    that cannot hold the table (read-only, full, a file) warns once and the process keeps its own table."""
    if _unusable.get("dir") is not None:
        return _in_process(key, new)
    from filelock import FileLock  # deferred: start-up (filelock costs ~0.1 s; only a CPU run's peak needs it)

    folder = None
    try:
        folder = cache_dir()
        path = folder / TABLE
        with FileLock(folder / f"{TABLE}.lock"):
            table = _read(path)
            value = new(table.get(key))
            if value is not None:
                table[key] = value
                _write(path, table)
            return float(table[key])
    except OSError as e:
        _warn_unusable(folder, e)
        return _in_process(key, new)


def _write(path: Path, table: dict) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(table, indent=1))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # a full disk's half-written table: never left behind


def _in_process(key: str, new: Callable[[float | None], float | None]) -> float:
    value = new(_unusable["table"].get(key))
    if value is not None:
        _unusable["table"][key] = value
    return float(_unusable["table"][key])


def _warn_unusable(folder: Path | None, e: OSError) -> None:
    where = folder or os.environ.get(CACHE_ENV) or "the cache folder"
    _unusable.update(dir=where, table={})
    why = "a file, not a folder" if os.path.isfile(where) else (e.strerror or str(e))
    print(f"warning: the CPU peak table cannot be kept in {where} ({why}); this process measures its own peak and "
          f"caches nothing. Set {CACHE_ENV} to a writable folder to keep it", file=sys.stderr, flush=True)


def cached_cpu_peak(dtype) -> float:
    """Measured CPU matmul peak, cached per (cpu, threads, dtype) so runs agree on MFU: the first process to need an
    entry measures it, later ones (and one that measured at the same time) read the entry that was written."""
    import torch

    key = _cpu_peak_key(dtype)
    path = None if _unusable.get("dir") is not None else _cache_path()
    known = _read(path).get(key) if path is not None else _unusable["table"].get(key)
    if known is not None:
        return float(known)
    # measured outside the lock (0.4 s and more); under it, an entry another process wrote meanwhile wins
    measured = measure_matmul_peak(torch.device("cpu"), dtype)
    return _update_cpu_peak(key, lambda current: measured if current is None else None)


def _cache_path() -> Path | None:
    try:
        return cache_dir() / TABLE
    except OSError as e:
        _warn_unusable(None, e)
        return None


def raise_cpu_peak(dtype, reached: float) -> float:
    """The cached CPU peak raised to a rate a run ``reached`` (see ``Device.observed_flops``); returns it. No new
    measurement here: it runs inside a run's step loop, where its matmuls' buffers became the step's memory peak
    (a batch-1 sweep point reported 2.04 GiB, its step 1.19) and its seconds the step's time."""
    return _update_cpu_peak(_cpu_peak_key(dtype), lambda current: max(float(current or 0.0), reached))


def torch_dtype(key: str):
    """bf16 | fp32 | tf32 -> the torch dtype a matmul at that peak runs in."""
    import torch

    return torch.bfloat16 if key == "bf16" else torch.float32
