"""The `tandem` command: serve one service, bring a local cluster up, stream a completion."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from tandem.cli.flags import (
    add_engine_flags,
    add_limit_flags,
    add_router_flags,
    engine_config,
    request_limits,
    router_settings,
)
from tandem.cli.security_flags import (
    add_client_tls_flags,
    add_server_security_flags,
    add_tls_flags,
    client_tls_kwargs,
    tls_config,
)
from tandem.common.drain import DEFAULT_DRAIN_SECONDS
from tandem.common.keepalive import DEFAULT_KEEPALIVE_SECONDS
from tandem.common.logs import FORMATS, default_format
from tandem.common.logs import configure as configure_logs
from tandem.common.tracing import TRACES_ENV
from tandem.common.tracing import configure as configure_tracing
from tandem.decode.outcomes import LOAD_FAILURE_POLICIES
from tandem.openai.tools import PARSERS as TOOL_CALL_PARSERS

# Prometheus ports of `tandem serve` (on --host, path /metrics), on unless --metrics-port 0: the
# router's and a worker's differ so that a router and a worker on one host both get theirs.
ROUTER_METRICS_PORT = 9191
WORKER_METRICS_PORT = 9192


def _add_metrics_port(parser: argparse.ArgumentParser, default: int) -> None:
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=default,
        help=f"serve Prometheus metrics over HTTP on --host at this port, path /metrics "
        f"(default {default}; 0: none)",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument(
        "--log-format",
        choices=FORMATS,
        default=default_format(),
        help="text (the default) or json: one JSON object a line, with the request id, route "
        "and worker on a request's lines; also TANDEM_LOG_FORMAT, which the processes that "
        "`tandem up` starts inherit",
    )
    tracing_help = (
        "send OpenTelemetry traces (a span per request on the router, per phase and KV pull on "
        "the workers, under the client's traceparent) to this OTLP/HTTP collector, e.g. "
        "http://otel-collector:4318 (default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; none: off)"
    )
    parser.add_argument(
        "--otlp-traces-endpoint",
        default=os.environ.get(TRACES_ENV, ""),
        help=tracing_help,
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run one service (what the Helm chart runs)")
    serve_sub = serve.add_subparsers(dest="role", required=True)
    server_flags = argparse.ArgumentParser(add_help=False)  # every serve role's
    server_flags.add_argument(
        "--otlp-traces-endpoint", default=argparse.SUPPRESS, help=tracing_help
    )
    server_flags.add_argument(
        "--drain-seconds",
        type=float,
        default=DEFAULT_DRAIN_SECONDS,
        help="on SIGTERM: health NOT_SERVING at once, then up to this long to finish in-flight work",
    )
    server_flags.add_argument(
        "--keepalive-seconds",
        type=float,
        default=DEFAULT_KEEPALIVE_SECONDS,
        help="ping each peer with calls open this often; one unanswered as long closes its "
        "connection and ends its calls (a peer gone without closing it); 0: no pings, else >= 1",
    )
    for role in ("prefill", "decode", "both"):
        p = serve_sub.add_parser(role, help=f"a {role} worker", parents=[server_flags])
        p.add_argument("--host", default="127.0.0.1")
        p.add_argument("--port", type=int, default=50052)
        p.add_argument(
            "--advertise-host",
            default=None,
            help="the host other workers reach this one at (a prefill names it in its KV "
            "handoffs; default: --host, or, for a wildcard --host such as 0.0.0.0, this host's "
            "DNS name or address: a Kubernetes pod's)",
        )
        p.add_argument(
            "--admin-token",
            default=os.environ.get("TANDEM_ADMIN_TOKEN"),
            help="bearer token admin RPCs must carry (default: $TANDEM_ADMIN_TOKEN; none: open)",
        )
        p.add_argument(
            "--nixl-progress-thread",
            action="store_true",
            help="run NIXL's UCX progress thread (lower transfer latency, one busy core)",
        )
        p.add_argument(
            "--kv-pull-floor-gbps",
            type=float,
            default=None,
            help="a decode warns (once per prefill) when a KV pull from a prefill on its host runs under "
            "this many GB/s, a sign of a TCP lane (default: 5 between GPU pools, none between CPU "
            "pools; 0: never)",
        )
        p.add_argument(
            "--engine-process",
            action="store_true",
            help="run the engine core (scheduler, model runner, KV pool and, on a prefill or "
            "decode worker, its NIXL agent) in a process of its own beside this worker's gRPC "
            "process, so serving never waits on the gRPC side's interpreter",
        )
        p.add_argument(
            "--kv-prefix-pulls",
            action="store_true",
            help="cross-worker prefix pulls (prefill and both workers; needs the cluster token): "
            "lease this worker's cached prefixes to peers (LeasePrefix), and pull a prompt's "
            "prefix from the peer the router names instead of computing it (the router decides "
            "by its cost model: --prefix-pull-*)",
        )
        p.add_argument(
            "--kv-room-wait-seconds",
            type=float,
            default=10.0,
            help="a decode whose KV pool has no room for a handoff's prompt waits this long for "
            "room (within the handoff's lease) before it gives up on the pull (0: at once; then "
            "--kv-load-failure-policy says what happens; default: 10)",
        )
        p.add_argument(
            "--no-kv-early-reserve",
            dest="kv_early_reserve",
            action="store_false",
            help="a decode reserves a split request's KV blocks when its handoff comes, not when "
            "the router announces the request (by default the blocks are reserved while the "
            "prompt is computed, when the pool has room, and the pull starts at once; they are "
            "held for the prefill's time)",
        )
        p.add_argument(
            "--kv-load-failure-policy",
            choices=LOAD_FAILURE_POLICIES,
            default="recompute",
            help="a decode that cannot load a handoff's KV (no room, lease expiring, pull failed, "
            "prefill unreachable, lease unconfirmed): recompute computes the prompt itself (counted "
            "and logged); fail ends the request UNAVAILABLE and the router retries it once on "
            "another prefill/decode pair (default: recompute)",
        )
        p.add_argument(
            "--kv-pull-floor-mib",
            type=float,
            default=None,
            help="only pulls of at least this many MiB count against --kv-pull-floor-gbps (smaller ones "
            "are mostly fixed cost; default: 8)",
        )
        _add_metrics_port(p, WORKER_METRICS_PORT)
        add_server_security_flags(p)
        add_engine_flags(p)
        add_limit_flags(p)
    router = serve_sub.add_parser(
        "router", help="the router (the AsyncLLM endpoint clients use)", parents=[server_flags]
    )
    router.add_argument("--host", default="127.0.0.1")
    router.add_argument("--port", type=int, default=50051)
    router.add_argument(
        "--admin-token",
        default=os.environ.get("TANDEM_ADMIN_TOKEN"),
        help="bearer token admin RPCs must carry, also sent to the workers (default: $TANDEM_ADMIN_TOKEN)",
    )
    _add_metrics_port(router, ROUTER_METRICS_PORT)
    add_server_security_flags(router, public_face=True)
    add_router_flags(router)
    add_limit_flags(router)
    front = serve_sub.add_parser("openai", help="an OpenAI-compatible HTTP front for a router")
    front.add_argument("--target", default="127.0.0.1:50051", help="the router's host:port")
    front.add_argument("--otlp-traces-endpoint", default=argparse.SUPPRESS, help=tracing_help)
    front.add_argument("--host", default="127.0.0.1")
    front.add_argument("--port", type=int, default=8000)
    front.add_argument(
        "--served-model-name",
        default=None,
        help="the model id clients send (default: the directory name)",
    )
    front.add_argument(
        "--api-key",
        default=os.environ.get("TANDEM_API_KEY"),
        help="the key clients must send as Authorization: Bearer <key> on /v1/*, /tokenize and "
        "/detokenize (default: $TANDEM_API_KEY; none: open)",
    )
    front.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_CALL_PARSERS),
        help="how tool_choice 'auto' reads tool calls in the output (as vLLM's): hermes "
        '(<tool_call>{...}</tool_call>) or llama3_json ({"name", "parameters"}, after '
        "<|python_tag|>); without it 'auto' is refused and tools only reach the chat template",
    )
    front.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters clients choose by `model` (as vLLM's): name=path or JSON "
        '{"name": ..., "path": ...}; the path is a PEFT directory on the workers\' disk',
    )
    front.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds the requests in flight may run on before the front exits",
    )
    add_client_tls_flags(front)

    up = sub.add_parser("up", help="start router + workers locally and serve until Ctrl-C")
    up.add_argument("--otlp-traces-endpoint", default=argparse.SUPPRESS, help=tracing_help)
    up.add_argument("--port", type=int, default=50051, help="router port")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument(
        "--prefill",
        type=int,
        default=0,
        help="prefill workers (default: 1 prefill + 1 decode when no role count is given)",
    )
    up.add_argument("--decode", type=int, default=0, help="decode workers")
    up.add_argument("--both", type=int, default=0, help="aggregated (prefill+decode) workers")
    for role in ("prefill", "decode", "both"):
        up.add_argument(
            f"--{role}-tensor-parallel-size",
            type=int,
            default=None,
            metavar="N",
            help=f"ranks of each {role} worker (default: --tensor-parallel-size)",
        )
    up.add_argument(
        "--demo", action="store_true", help="stream a demo completion once the cluster is ready"
    )
    up.add_argument(
        "--metrics-port",
        type=int,
        default=ROUTER_METRICS_PORT,
        help="the router's Prometheus port (/metrics); each worker gets a free one, all printed; "
        "0: no metrics servers",
    )
    up.add_argument(
        "--cluster-token",
        default=os.environ.get("TANDEM_CLUSTER_TOKEN"),
        help="the cluster's shared secret (default: $TANDEM_CLUSTER_TOKEN, else a fresh random one)",
    )
    add_tls_flags(up, public_face=True)
    up.add_argument(
        "--admin-token",
        default=os.environ.get("TANDEM_ADMIN_TOKEN"),
        help="bearer token admin RPCs must carry, on the router and every worker "
        "(default: $TANDEM_ADMIN_TOKEN; none: open)",
    )
    up.add_argument(
        "--kv-room-wait-seconds",
        type=float,
        default=None,
        help="how long each decode waits for room in its KV pool for a handoff (as on `serve "
        "decode`; default: 10)",
    )
    up.add_argument(
        "--no-kv-early-reserve",
        dest="kv_early_reserve",
        action="store_false",
        help="each decode reserves a split request's KV blocks when its handoff comes, not while "
        "the prompt is computed (as on `serve decode`)",
    )
    up.add_argument(
        "--kv-load-failure-policy",
        choices=LOAD_FAILURE_POLICIES,
        default="recompute",
        help="what each decode does with a handoff whose KV it cannot load (as on `serve decode`; "
        "default: recompute)",
    )
    up.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        help="restarts of one process within 10 minutes before it is left down (default: 5)",
    )
    add_engine_flags(up)
    add_limit_flags(up)
    add_router_flags(up, discovery=False)

    gen = sub.add_parser("generate", help="stream a completion from a router")
    gen.add_argument("prompt")
    gen.add_argument("--target", default="127.0.0.1:50051")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as a user message through the chat template",
    )
    add_client_tls_flags(gen)

    from tandem.cli.bench import add_arguments as add_bench_arguments

    add_bench_arguments(
        sub.add_parser("bench", help="benchmark a running cluster (like vllm bench serve)")
    )

    default = sub.add_parser(
        "default-model", help="print the default model's directory (written on first use)"
    )
    default.add_argument(
        "--tiny", action="store_true", help="the tiny random model of the fast tests instead"
    )
    return parser


def _engine_config(args):
    from tandem.engine.checkpoints import resolve_model

    return engine_config(args, resolve_model)


def _serve(args) -> int:
    if args.role == "openai":
        from tandem.openai.app import serve_openai
        from tandem.openai.config import FrontConfig, parse_lora_modules

        try:
            config = FrontConfig(
                target=args.target,
                host=args.host,
                port=args.port,
                served_model_name=args.served_model_name,
                tls=client_tls_kwargs(args),
                api_key=args.api_key,
                tool_call_parser=args.tool_call_parser,
                lora_modules=parse_lora_modules(args.lora_modules),
                shutdown_timeout_s=args.shutdown_timeout,
            )
        except ValueError as exc:
            raise SystemExit(f"tandem serve openai: {exc}") from exc
        serve_openai(config)
        return 0
    if args.role == "router":
        from tandem.router.app import serve_router
        from tandem.router.config import RouterConfig

        config = RouterConfig(
            host=args.host,
            port=args.port,
            admin_token=args.admin_token,
            drain_seconds=args.drain_seconds,
            keepalive_seconds=args.keepalive_seconds,
            metrics_port=args.metrics_port,
            cluster_token=args.cluster_token,
            tls=tls_config(args),
            health_port=args.health_port,
            limits=request_limits(args),
            **router_settings(args),
        )
        from tandem.common import loop

        loop.run(serve_router(config))
        return 0
    from tandem.common.roles import Role
    from tandem.decode.pull_links import DEFAULT_FLOOR_MIN_MIB, PullFloor
    from tandem.worker.app import serve_worker
    from tandem.worker.config import WorkerConfig

    config = WorkerConfig(
        role=Role.parse(args.role),
        engine=_engine_config(args),
        host=args.host,
        port=args.port,
        advertise_host=args.advertise_host,
        nixl_progress_thread=args.nixl_progress_thread,
        kv_load_failure_policy=args.kv_load_failure_policy,
        kv_room_wait_s=args.kv_room_wait_seconds,
        kv_early_reserve=args.kv_early_reserve,
        engine_process=args.engine_process,
        kv_prefix_pulls=args.kv_prefix_pulls,
        admin_token=args.admin_token,
        kv_pull_floor=PullFloor(
            args.kv_pull_floor_gbps,
            DEFAULT_FLOOR_MIN_MIB if args.kv_pull_floor_mib is None else args.kv_pull_floor_mib,
        ),
        drain_seconds=args.drain_seconds,
        keepalive_seconds=args.keepalive_seconds,
        metrics_port=args.metrics_port,
        cluster_token=args.cluster_token,
        tls=tls_config(args),
        health_port=args.health_port,
        limits=request_limits(args),
    )
    asyncio.run(serve_worker(config))
    return 0


def generate(
    target: str,
    prompt: str,
    max_tokens: int,
    temperature: float = 0.0,
    top_p=None,
    top_k=None,
    seed=None,
    chat: bool = False,
    out=sys.stdout,
    tls: dict | None = None,
) -> None:
    """tls: LLM's TLS keyword arguments (root_certificates, certificate_chain, private_key, tls_server_name)."""
    from tandem.client import LLM, SamplingParams

    with LLM(target, **(tls or {})) as llm:
        if chat:
            prompt = llm.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True
            )
        # A rendered template holds its special tokens already (transformers tokenizes it without adding any).
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            add_special_tokens=not chat,
        )

        async def stream():
            async for output in llm.generate_async(prompt, params, streaming=True):
                out.write(output.outputs[0].text_diff)
                out.flush()
            out.write(
                f"\n[{output.outputs[0].finish_reason}: {len(output.outputs[0].token_ids)} tokens]\n"
            )

        asyncio.run(stream())


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        configure_logs(args.log_level, args.log_format)
        if args.command == "serve":
            configure_tracing(args.otlp_traces_endpoint, f"tandem-{args.role}")
            return _serve(args)
        if args.command == "up":
            # The processes up starts inherit it (each names itself by its role).
            configure_tracing(args.otlp_traces_endpoint, "tandem-up", check_only=True)
            os.environ[TRACES_ENV] = args.otlp_traces_endpoint
            from tandem.cli.up import up

            return up(args, _engine_config(args))
        if args.command == "generate":
            generate(
                args.target,
                args.prompt,
                args.max_tokens,
                args.temperature,
                args.top_p,
                args.top_k,
                args.seed,
                args.chat,
                tls=client_tls_kwargs(args),
            )
            return 0
        if args.command == "bench":
            from tandem.cli.bench import main as bench

            return bench(args)
        if args.command == "default-model":
            from tandem.engine.checkpoints import default_model_dir, tiny_model_dir

            print(tiny_model_dir() if args.tiny else default_model_dir())
            return 0
    except (ValueError, ImportError) as exc:
        print(f"tandem: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
