"""Where a process's threads spent their samples, from py-spy's raw output (`py-spy record -f raw
--threads`): per thread, the busy share and the functions with the most inclusive samples.

    python bench/pyspy_summary.py PROFILE.txt [--top 25]
"""

from __future__ import annotations

import argparse
from collections import Counter

IDLE = ("select", "epoll", "wait", "_wait_for_tstate_lock", "get (queue.py", "sleep")


def summarize(path: str, top: int) -> None:
    threads: Counter[str] = Counter()
    idle: Counter[str] = Counter()
    functions: dict[str, Counter[str]] = {}
    for line in open(path):
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack:
            continue
        frames = stack.split(";")
        thread, num = frames[0], int(count)
        threads[thread] += num
        if any(marker in frames[-1] for marker in IDLE):
            idle[thread] += num
        seen = set()
        for frame in frames[1:]:
            name = frame.split(" (")[0] + " " + frame.rsplit("/", 1)[-1].rstrip(")")
            if name not in seen:
                seen.add(name)
                functions.setdefault(thread, Counter())[name] += num
    for thread, num in threads.most_common(4):
        print(f"== {thread}: {num} samples, {num - idle[thread]} busy")
        for name, count in functions[thread].most_common(top):
            print(f"  {count:6d} {name[:140]}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("profile")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    summarize(args.profile, args.top)
