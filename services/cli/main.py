"""The `tandem` command: serve one service, bring a local cluster up, stream a completion."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from tandem.common.drain import DEFAULT_DRAIN_SECONDS


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF checkpoint directory (default: the tiny default model)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--num-blocks", type=int, default=0, help="KV blocks (0: size from --kv-cache-gb)")
    p.add_argument("--kv-cache-gb", type=float, default=0.25, help="memory for the KV pool when --num-blocks is 0")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences per engine step")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step (chunked prefill)")
    p.add_argument("--max-model-len", type=int, default=0, help="context length (0: the model's)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    p.add_argument("--seed", type=int, default=0, help="seed of unseeded sampling")
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="do not reuse the KV of prompt prefixes seen before")
    p.add_argument("--kv-lease-seconds", type=float, default=30.0,
                   help="prefill: seconds a handed-off KV stays pinned waiting for the decode side")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run one service (what the Helm chart runs)")
    serve_sub = serve.add_subparsers(dest="role", required=True)
    drain = argparse.ArgumentParser(add_help=False)
    drain.add_argument("--drain-seconds", type=float, default=DEFAULT_DRAIN_SECONDS,
                       help="on SIGTERM: health NOT_SERVING at once, then up to this long to finish in-flight work")
    for role in ("prefill", "decode", "both"):
        p = serve_sub.add_parser(role, help=f"a {role} worker", parents=[drain])
        p.add_argument("--host", default="127.0.0.1")
        p.add_argument("--port", type=int, default=50052)
        p.add_argument("--admin-token", default=os.environ.get("TANDEM_ADMIN_TOKEN"),
                       help="bearer token admin RPCs must carry (default: $TANDEM_ADMIN_TOKEN; none: open)")
        p.add_argument("--nixl-progress-thread", action="store_true",
                       help="run NIXL's UCX progress thread (lower transfer latency, one busy core)")
        _add_engine_args(p)
    router = serve_sub.add_parser("router", help="the router (the AsyncLLM endpoint clients use)", parents=[drain])
    router.add_argument("--host", default="127.0.0.1")
    router.add_argument("--port", type=int, default=50051)
    router.add_argument("--workers", required=True, help="comma-separated worker addresses host:port")
    router.add_argument("--health-interval", type=float, default=1.0)
    router.add_argument("--admin-token", default=os.environ.get("TANDEM_ADMIN_TOKEN"),
                        help="bearer token admin RPCs must carry, also sent to the workers (default: $TANDEM_ADMIN_TOKEN)")

    up = sub.add_parser("up", help="start router + workers locally and serve until Ctrl-C")
    up.add_argument("--port", type=int, default=50051, help="router port")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--prefill", type=int, default=0,
                    help="prefill workers (default: 1 prefill + 1 decode when no role count is given)")
    up.add_argument("--decode", type=int, default=0, help="decode workers")
    up.add_argument("--both", type=int, default=0, help="aggregated (prefill+decode) workers")
    up.add_argument("--demo", action="store_true", help="stream a demo completion once the cluster is ready")
    _add_engine_args(up)

    gen = sub.add_parser("generate", help="stream a completion from a router")
    gen.add_argument("prompt")
    gen.add_argument("--target", default="127.0.0.1:50051")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--seed", type=int, default=None)

    sub.add_parser("default-model", help="print the default model's directory (written on first use)")
    return parser


def _engine_config(args):
    from tandem.engine.checkpoints import default_model_dir
    from tandem.engine.config import EngineConfig
    return EngineConfig(model_dir=str(args.model or default_model_dir()), block_size=args.block_size,
                        num_blocks=args.num_blocks, kv_cache_memory_gb=args.kv_cache_gb,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        max_model_len=args.max_model_len, dtype=args.dtype, device=args.device, seed=args.seed,
                        kv_lease_seconds=args.kv_lease_seconds, enable_prefix_caching=args.enable_prefix_caching)


def _serve(args) -> int:
    if args.role == "router":
        from tandem.router.app import serve_router
        from tandem.router.config import RouterConfig
        config = RouterConfig(host=args.host, port=args.port, health_interval_s=args.health_interval,
                              admin_token=args.admin_token, drain_seconds=args.drain_seconds,
                              workers=tuple(a.strip() for a in args.workers.split(",") if a.strip()))
        asyncio.run(serve_router(config))
        return 0
    from tandem.worker.app import serve_worker
    from tandem.worker.config import WorkerConfig
    config = WorkerConfig(role=args.role, engine=_engine_config(args), host=args.host, port=args.port,
                          nixl_progress_thread=args.nixl_progress_thread, admin_token=args.admin_token,
                          drain_seconds=args.drain_seconds)
    asyncio.run(serve_worker(config))
    return 0


def generate(target: str, prompt: str, max_tokens: int, temperature: float = 0.0, top_p=None, top_k=None,
             seed=None, out=sys.stdout) -> None:
    from tandem.client import LLM, SamplingParams
    with LLM(target) as llm:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)

        async def stream():
            async for output in llm.generate_async(prompt, params, streaming=True):
                out.write(output.outputs[0].text_diff)
                out.flush()
            out.write(f"\n[{output.outputs[0].finish_reason}: {len(output.outputs[0].token_ids)} tokens]\n")
        asyncio.run(stream())


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "serve":
            return _serve(args)
        if args.command == "up":
            from tandem.cli.up import up
            return up(args, _engine_config(args))
        if args.command == "generate":
            generate(args.target, args.prompt, args.max_tokens, args.temperature, args.top_p, args.top_k, args.seed)
            return 0
        if args.command == "default-model":
            from tandem.engine.checkpoints import default_model_dir
            print(default_model_dir())
            return 0
    except ValueError as exc:
        print(f"tandem: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
