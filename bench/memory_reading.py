"""What an iteration record's memory reading costs the engine thread (services/engine/iteration_stats.py),
per call, with the device idle and with a queue of kernels in flight: the uncached reading (the
device's free memory, torch's host-allocator statistics, /proc) against memory_usage's cached one,
which the engine now asks every step. Usage: python3 bench/memory_reading.py [--device cuda:0]."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tandem.engine.iteration_stats import _read_memory, memory_usage


def per_call_us(fn, num: int) -> tuple[float, float]:
    times = []
    for _ in range(num):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1e6)
    times.sort()
    return statistics.median(times), times[int(len(times) * 0.9)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    device = args.device
    rows = {
        "uncached reading (before)": lambda: _read_memory(device),
        "memory_usage, cached (now)": lambda: memory_usage(device),
    }
    if device.startswith("cuda"):
        dev = torch.device(device)
        rows["  of which torch.cuda.mem_get_info"] = lambda: torch.cuda.mem_get_info(dev)
        rows["  of which host_memory_stats"] = torch.cuda.host_memory_stats
    print(
        f"# {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.startswith("cuda") else "")
    )
    print(f"{'call':<38}{'idle: median us':>17}{'p90':>8}{'busy: median us':>17}{'p90':>8}")
    for name, fn in rows.items():
        fn()
        idle = per_call_us(fn, args.calls)
        busy = (float("nan"), float("nan"))
        if device.startswith("cuda"):
            a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
            for _ in range(400):  # ~100+ ms of queued GEMMs: the device busy as under serving
                a @ a
            busy = per_call_us(fn, args.calls)
            torch.cuda.synchronize(device)
        print(f"{name:<38}{idle[0]:>17.1f}{idle[1]:>8.1f}{busy[0]:>17.1f}{busy[1]:>8.1f}")


if __name__ == "__main__":
    main()
