"""Measured matmul peaks: the practical peak of a device at this thread count, and the CPU's cached per (cpu,
threads, dtype, torch) so every run on this host computes its MFU over the same figure. The reference (datasheet)
peaks are each kind's spec's (``DeviceSpec.peaks``; ``devices.reference_peak``). torch is imported when called."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

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


def _cpu_peak_table(dtype) -> tuple[Path, dict, str]:
    import platform  # here, not at the top: 2 ms of every start (the allocator's re-exec pays it twice)

    import torch

    threads = torch.get_num_threads()
    key = f"{platform.processor() or platform.machine()}|{os.cpu_count()}|{threads}|{dtype}|torch{torch.__version__}"
    path = cache_dir() / "cpu_peak.json"
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    return path, table, key


def _write_cpu_peak_table(path: Path, table: dict) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(table, indent=1))
    os.replace(tmp, path)


def cached_cpu_peak(dtype) -> float:
    """Measured CPU matmul peak, cached per (cpu, threads, dtype) so runs agree on MFU."""
    import torch

    path, table, key = _cpu_peak_table(dtype)
    if key not in table:
        table[key] = measure_matmul_peak(torch.device("cpu"), dtype)
        _write_cpu_peak_table(path, table)
    return float(table[key])


def raise_cpu_peak(dtype, reached: float) -> float:
    """The cached CPU peak raised to a rate a run ``reached`` (see ``Device.observed_flops``); returns it. No new
    measurement here: it runs inside a run's step loop, where its matmuls' buffers became the step's memory peak
    (a batch-1 sweep point reported 2.04 GiB, its step 1.19) and its seconds the step's time."""
    path, table, key = _cpu_peak_table(dtype)
    table[key] = max(float(table.get(key, 0.0)), reached)
    _write_cpu_peak_table(path, table)
    return float(table[key])


def torch_dtype(key: str):
    """bf16 | fp32 | tf32 -> the torch dtype a matmul at that peak runs in."""
    import torch

    return torch.bfloat16 if key == "bf16" else torch.float32
