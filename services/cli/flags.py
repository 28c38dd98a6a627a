"""Command-line flags built from config dataclasses' field metadata (the one definition):
EngineConfig's for every engine-running command, RequestLimits' for every server. `tandem serve`
and `tandem up` parse them, and `tandem up` passes a config on to its processes."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing

from tandem.common.limits import RequestLimits
from tandem.engine.config import EngineConfig


def _fields(cls):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        yield f, flag, hints[f.name]


def _add_flags(parser: argparse.ArgumentParser, cls) -> None:
    for f, flag, kind in _fields(cls):
        meta = f.metadata
        if kind is bool:  # the flag flips the default
            action = "store_false" if f.default else "store_true"
            parser.add_argument(flag, dest=f.name, action=action, help=meta["help"])
        else:
            base = (
                typing.get_args(kind)[0]
                if typing.get_origin(kind) in (typing.Union, types.UnionType)
                else kind
            )
            parser.add_argument(
                flag,
                dest=f.name,
                type=base,
                default=f.default,
                help=f"{meta['help']} (default: {f.default})",
                metavar=flag.lstrip("-").replace("-", "_").upper(),
                **meta["argparse"],
            )


def _argv(config) -> list[str]:
    """The flags that make a process run with config."""
    argv = []
    for f, flag, kind in _fields(type(config)):
        value = getattr(config, f.name)
        if kind is bool:
            if value != f.default:
                argv.append(flag)
        elif value is not None and value != f.default:
            argv += [flag, str(value)]
    return argv


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    _add_flags(parser, EngineConfig)


def add_limit_flags(parser: argparse.ArgumentParser) -> None:
    _add_flags(parser, RequestLimits)


def engine_config(args: argparse.Namespace, resolve_model) -> EngineConfig:
    """The EngineConfig the parsed flags describe; resolve_model(--model) names the checkpoint
    directory (the default model when --model is not given, a converted one for a .gguf file)."""
    values = {f.name: getattr(args, f.name) for f, _, _ in _fields(EngineConfig)}
    values["model_dir"] = str(resolve_model(values["model_dir"]))
    return EngineConfig(**values)


def request_limits(args: argparse.Namespace) -> RequestLimits:
    return RequestLimits(**{f.name: getattr(args, f.name) for f, _, _ in _fields(RequestLimits)})


def engine_argv(config: EngineConfig) -> list[str]:
    """The flags that make a worker run with config (what `tandem up` passes on)."""
    return _argv(config)


def limits_argv(limits: RequestLimits) -> list[str]:
    """The flags that make a router or worker enforce limits (what `tandem up` passes on)."""
    return _argv(limits)
