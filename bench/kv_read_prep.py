"""What it costs to prepare and post one KV READ: descriptor lists built per READ vs prepared once.

The same prefill process as bench/kv_transfer.py owns the source pool; this process holds two
decode transceivers over one pool, one building every READ's descriptor lists anew
(`prepared_descriptors=False`: read_plan, get_xfer_descs twice, initialize_xfer) and one using
the lists prepared at open / add_peer (make_prepped_xfer with index arrays). For each block count
and layout both read the same ids, alternately, --iters times after --warmup. "prepare" is
read_blocks() less its call to agent.transfer() (checks, descriptors, NIXL's request), "post" that
call (on CPU without progress threads UCX copies small READs inside it), "pull" the READ from
read_blocks() to the data in place. Medians. A second table times preparing alone, back to back
(the post skipped, the handle released): what posting several READs in one poll round costs,
with the caches warm instead of just flushed by a copy.

    python bench/kv_read_prep.py                          # CPU, small shape (64 KiB blocks)
    python bench/kv_read_prep.py --shape llama-3.1-8b     # 4 MiB blocks
    python bench/kv_read_prep.py --device cuda --shape llama-3.1-8b

There is no roofline for preparing: the floor is zero, and the transfer it precedes is what it is
measured against ("pull").
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from kv_transfer import PREFILL_NAME, SHAPES, pick_block_ids, start_prefill

from tandem.kvtransfer import KvTransceiver

BLOCK_COUNTS = (16, 64, 256)
SEED = 0


def time_calls(obj, method: str) -> list[float]:
    """Wraps obj.method; each call appends its seconds to the returned list."""
    inner, seconds = getattr(obj, method), []

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - start)

    setattr(obj, method, timed)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--progress-thread",
        action="store_true",
        help="NIXL UCX progress threads in every agent (off: as tandem's workers run; each spins a core)",
    )
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()

    shape = SHAPES[args.shape]
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)
    # Scattered picks need room to scatter in; twice the largest READ.
    pool_blocks = 2 * max(BLOCK_COUNTS)

    prefill, conn, state = start_prefill(args.shape, pool_blocks, str(device), args.progress_thread)

    pool = shape.pool(pool_blocks, device)
    transceivers = {
        "per-READ": KvTransceiver(
            "bench-decode-per-read",
            pool,
            shape.layout_hash,
            progress_thread=args.progress_thread,
            prepared_descriptors=False,
        ),
        "prepared": KvTransceiver(
            "bench-decode-prepared", pool, shape.layout_hash, progress_thread=args.progress_thread
        ),
    }
    started = time.perf_counter()
    for transceiver in transceivers.values():
        transceiver.add_peer(state)
    add_peer_ms = (time.perf_counter() - started) * 1e3

    post_s = {}
    for name, transceiver in transceivers.items():
        # Times the post inside read_blocks, so that preparing is the rest of the call.
        post_s[name] = time_calls(transceiver._agent, "transfer")

    def read(name: str, remote_ids, local_ids) -> tuple[float, float, float, int]:
        """(prepare, post, pull seconds, descriptors) of one READ."""
        start = time.perf_counter()
        transfer = transceivers[name].read_blocks(PREFILL_NAME, remote_ids, local_ids, b"bench")
        returned = time.perf_counter()
        transfer.wait(60.0)
        posting = post_s[name].pop()
        pull = time.perf_counter() - start
        return returned - start - posting, posting, pull, transfer.num_descriptors

    print(
        f"# Preparing + posting one NIXL READ ({args.device}, progress thread "
        f"{'on' if args.progress_thread else 'off'}), shape {args.shape}: "
        f"{shape.block_nbytes / 2**10:.0f} KiB blocks, pool {pool_blocks} blocks"
    )
    print(
        f"# median of {args.iters} after {args.warmup} warm-up, the two paths alternating; "
        f"both add_peer calls (one prepares the peer's {pool_blocks} blocks): {add_peer_ms:.1f} ms"
    )
    header = (
        f"{'blocks':>6} {'layout':>10} {'descs':>5} | {'prepare us':>10} {'prepared':>8} {'speedup':>7} | "
        f"{'post us':>9} {'prepared':>9} | {'pull ms':>7} {'prepared':>8}"
    )
    print("# per-READ = descriptor lists built per READ, prepared = lists prepared once")
    print(header)
    print("-" * len(header))
    rng = random.Random(SEED)
    for num_blocks in BLOCK_COUNTS:
        for layout in ("contiguous", "scattered"):
            remote_ids, local_ids = pick_block_ids(rng, num_blocks, pool_blocks, layout)
            samples = {name: [] for name in transceivers}
            for i in range(args.warmup + args.iters):
                for name in transceivers:
                    sample = read(name, remote_ids, local_ids)
                    if i >= args.warmup:
                        samples[name].append(sample)
                stamps = pool.view(pool_blocks, -1).view(torch.uint8)[local_ids, 0].cpu().tolist()
                if stamps != [r % 251 for r in remote_ids]:
                    raise SystemExit(f"data check failed: {num_blocks} {layout} blocks misplaced")
            prepare, post, pull, descs = (
                {name: statistics.median(s[k] for s in samples[name]) for name in samples}
                for k in range(4)
            )
            if descs["per-READ"] != descs["prepared"]:
                raise SystemExit(f"descriptor counts differ: {descs}")
            print(
                f"{num_blocks:>6} {layout:>10} {int(descs['prepared']):>5} | "
                f"{prepare['per-READ'] * 1e6:>10.1f} {prepare['prepared'] * 1e6:>8.1f} "
                f"{prepare['per-READ'] / prepare['prepared']:>6.1f}x | "
                f"{post['per-READ'] * 1e6:>9.1f} {post['prepared'] * 1e6:>9.1f} | "
                f"{pull['per-READ'] * 1e3:>7.3f} {pull['prepared'] * 1e3:>8.3f}"
            )

    print()
    print("# preparing alone, back to back (nothing posted; the handle is released unposted)")
    header = f"{'blocks':>6} {'layout':>10} | {'prepare us':>10} {'prepared':>8} {'speedup':>7}"
    print(header)
    print("-" * len(header))
    for transceiver in transceivers.values():
        transceiver._agent.transfer = lambda handle, notif_msg=b"": "PROC"
    for num_blocks in BLOCK_COUNTS:
        for layout in ("contiguous", "scattered"):
            remote_ids, local_ids = pick_block_ids(rng, num_blocks, pool_blocks, layout)
            prepare = {name: [] for name in transceivers}
            for i in range(args.warmup + args.iters):
                for name, transceiver in transceivers.items():
                    start = time.perf_counter()
                    transfer = transceiver.read_blocks(PREFILL_NAME, remote_ids, local_ids, b"")
                    if i >= args.warmup:
                        prepare[name].append(time.perf_counter() - start)
                    transfer.abort()
            per_read, prepared = (statistics.median(prepare[name]) for name in transceivers)
            print(
                f"{num_blocks:>6} {layout:>10} | {per_read * 1e6:>10.1f} {prepared * 1e6:>8.1f} "
                f"{per_read / prepared:>6.1f}x"
            )

    conn.send_bytes(b"stop")
    conn.poll(30)
    prefill.join(30)
    for transceiver in transceivers.values():
        transceiver.close()


if __name__ == "__main__":
    main()
