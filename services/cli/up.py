"""`tandem up`: a local cluster in the foreground until Ctrl-C."""
from __future__ import annotations

import signal
import sys
import time

from tandem.cli.cluster import LocalCluster

DEMO_PROMPT = "The quick brown fox"


def _engine_args(args, engine) -> list[str]:
    return ["--model", engine.model_dir, "--block-size", str(engine.block_size), "--num-blocks", str(engine.num_blocks),
            "--kv-cache-gb", str(engine.kv_cache_memory_gb), "--max-num-seqs", str(engine.max_num_seqs),
            "--max-num-batched-tokens", str(engine.max_num_batched_tokens), "--max-model-len", str(engine.max_model_len),
            "--dtype", engine.dtype, "--device", engine.device, "--seed", str(engine.seed),
            "--kv-lease-seconds", str(engine.kv_lease_seconds),
            *([] if engine.enable_prefix_caching else ["--no-prefix-caching"]),
            *(["--enforce-eager"] if engine.enforce_eager else []),
            *([] if engine.overlap_scheduling else ["--no-overlap-scheduling"])]


def up(args, engine) -> int:
    roles = ["prefill"] * args.prefill + ["decode"] * args.decode + ["both"] * args.both
    if not roles:
        roles = ["prefill", "decode"]
    if (args.prefill == 0) != (args.decode == 0):
        print("tandem: --prefill and --decode go together (both > 0) or not at all", file=sys.stderr)
        return 2
    cluster = LocalCluster(roles=roles, engine_args=_engine_args(args, engine), host=args.host, router_port=args.port)
    print(f"tandem: starting router on {args.host}:{args.port} with workers {roles} (model {engine.model_dir})", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        cluster.start()
        print(f"tandem: ready on {cluster.address}; logs in {cluster.log_dir}", flush=True)
        for s in cluster.services:
            print(f"  {s.name:10s} {s.address}", flush=True)
        if args.demo:
            from tandem.cli.main import generate
            print(f"tandem: demo completion of {DEMO_PROMPT!r}:", flush=True)
            generate(cluster.address, DEMO_PROMPT, max_tokens=48)
        print(f"tandem: serving on {cluster.address}; try `tandem generate --target {cluster.address} \"Hello\"`. "
              "Ctrl-C stops.", flush=True)
        while True:
            cluster.check_alive()
            time.sleep(1)
    except KeyboardInterrupt:
        print("\ntandem: stopping", flush=True)
        return 0
    finally:
        cluster.stop()
