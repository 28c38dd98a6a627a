"""`tandem up`: a local cluster in the foreground until Ctrl-C, its processes supervised
(testing/supervisor.py): a worker that dies is started again and the rest keep serving."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

from tandem.cli.flags import engine_argv, limits_argv, request_limits, router_argv
from tandem.cli.security_flags import tls_config
from tandem.testing.cluster import LocalCluster
from tandem.testing.supervisor import RestartPolicy, Supervisor

# A chat model answers a question through its chat template; a model without one continues a text.
DEMO_QUESTION = "What is the capital of France?"
DEMO_PROMPT = "The quick brown fox"


def _has_chat_template(model_dir: str) -> bool:
    config = Path(model_dir) / "tokenizer_config.json"
    return (Path(model_dir) / "chat_template.jinja").is_file() or (
        config.is_file() and bool(json.loads(config.read_text()).get("chat_template"))
    )


def role_worker_args(args, roles: list[str]) -> dict[str, list[str]]:
    """--<role>-tensor-parallel-size N: the flag each worker of that role gets on top of the engine flags."""
    worker_args: dict[str, list[str]] = {}
    for role in dict.fromkeys(roles):
        size = getattr(args, f"{role}_tensor_parallel_size", None)
        if size is not None:
            for index in range(1, roles.count(role) + 1):
                worker_args[f"{role}-{index}"] = ["--tensor-parallel-size", str(size)]
    return worker_args


def up(args, engine) -> int:
    roles = ["prefill"] * args.prefill + ["decode"] * args.decode + ["both"] * args.both
    if not roles:
        roles = ["prefill", "decode"]
    if (args.prefill == 0) != (args.decode == 0):
        print(
            "tandem: --prefill and --decode go together (both > 0) or not at all", file=sys.stderr
        )
        return 2
    limits = limits_argv(request_limits(args))
    router_args = [*router_argv(args), *limits]
    # Tokens reach the processes in their environment, not on their (world-readable) command line.
    env = {"TANDEM_ADMIN_TOKEN": args.admin_token} if args.admin_token else None
    # Each decode's policy for a handoff whose KV it cannot load (the other roles pull none).
    worker_args = role_worker_args(args, roles)
    for index in range(1, roles.count("decode") + 1):
        decode_args = worker_args.setdefault(f"decode-{index}", [])
        if args.kv_load_failure_policy != "recompute":
            decode_args += ["--kv-load-failure-policy", args.kv_load_failure_policy]
        if args.kv_room_wait_seconds is not None:
            decode_args += ["--kv-room-wait-seconds", str(args.kv_room_wait_seconds)]
        if not args.kv_early_reserve:
            decode_args.append("--no-kv-early-reserve")
    if (
        args.prefix_pulls
    ):  # the router's --prefix-pulls: the workers that run prompts serve and pull
        for role in ("prefill", "both"):
            for index in range(1, roles.count(role) + 1):
                worker_args.setdefault(f"{role}-{index}", []).append("--kv-prefix-pulls")
    cluster = LocalCluster(
        roles=roles,
        engine_args=engine_argv(engine) + limits,
        host=args.host,
        router_port=args.port,
        router_args=router_args,
        env=env,
        metrics=args.metrics_port != 0,
        router_metrics_port=args.metrics_port,
        cluster_token=args.cluster_token,
        tls=tls_config(args),
        worker_args=worker_args,
    )
    supervisor = Supervisor(cluster, RestartPolicy(max_restarts=args.max_restarts))
    print(
        f"tandem: starting router on {args.host}:{args.port} with workers {roles} (model {engine.model_dir})",
        flush=True,
    )
    for name, extra in cluster.worker_args.items():
        print(f"  {name}: {' '.join(extra)}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    # Ctrl-C stops, even when started with SIGINT ignored (a script's `&` job), where Python would
    # install no handler of its own and a SIGINT would never stop the cluster.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        cluster.start()
        print(f"tandem: ready on {cluster.address}; logs in {cluster.log_dir}", flush=True)
        for s in cluster.services:
            metrics = f"   metrics http://{s.metrics_address}/metrics" if s.metrics_address else ""
            print(f"  {s.name:10s} {s.address}{metrics}", flush=True)
        if args.demo:
            from tandem.cli.main import generate

            chat = _has_chat_template(engine.model_dir)
            prompt = DEMO_QUESTION if chat else DEMO_PROMPT
            print(
                f"tandem: demo {'chat answer to' if chat else 'completion of'} {prompt!r}:",
                flush=True,
            )
            generate(
                cluster.address, prompt, max_tokens=48, chat=chat, tls=cluster.client_tls_kwargs()
            )
        chat_flag = " --chat" if _has_chat_template(engine.model_dir) else ""
        tls_flags = "".join(f" --{k} {v}" for k, v in cluster.client_tls_flags().items())
        print(
            f"tandem: serving on {cluster.address}; try `tandem generate --target {cluster.address}{tls_flags}"
            f'{chat_flag} "Hello"`. Ctrl-C stops.',
            flush=True,
        )
        while not supervisor.router_gone:
            supervisor.poll()
            time.sleep(0.2)
        print("tandem: the router has stopped; stopping the workers", flush=True)
        return 0 if cluster.router.process.returncode == 0 else 1
    except KeyboardInterrupt:
        print("\ntandem: stopping", flush=True)
        return 0
    finally:
        cluster.stop()
