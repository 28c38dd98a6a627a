"""Command-line flags built from config dataclasses' field metadata (the one definition):
EngineConfig's for every engine-running command, RequestLimits' for every server, RouterConfig's
for the router (and `tandem up`). `tandem serve` and `tandem up` parse them, and `tandem up`
passes a config on to its processes."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing

from tandem.common.limits import RequestLimits
from tandem.engine.config import EngineConfig
from tandem.router.config import DISCOVERY_FIELDS, RouterConfig


def _fields(cls, skip: tuple[str, ...] = ()):
    """(field, flag, type) of each of cls's flag fields (those with flag_field's metadata), but
    the skipped ones."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata or f.name in skip:
            continue
        flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        yield f, flag, hints[f.name]


def _add_flags(parser: argparse.ArgumentParser, cls, skip: tuple[str, ...] = ()) -> None:
    for f, flag, kind in _fields(cls, skip):
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
            shown = ",".join(f.default) if isinstance(f.default, tuple) else f.default
            parser.add_argument(
                flag,
                dest=f.name,
                default=f.default,
                help=f"{meta['help']} (default: {shown})",
                metavar=flag.lstrip("-").replace("-", "_").upper(),
                **{"type": base, **meta["argparse"]},
            )


def _flag_values(cls, values: dict, skip: tuple[str, ...] = ()) -> list[str]:
    """The flags that set cls's fields to `values` (field name -> value; a default sets none)."""
    argv = []
    for f, flag, kind in _fields(cls, skip):
        value = values[f.name]
        if kind is bool:
            if value != f.default:
                argv.append(flag)
        elif value is not None and value != f.default:
            argv += [flag, ",".join(value) if isinstance(value, tuple) else str(value)]
    return argv


def _argv(config) -> list[str]:
    """The flags that make a process run with config."""
    return _flag_values(
        type(config), {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    )


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    _add_flags(parser, EngineConfig)


def add_limit_flags(parser: argparse.ArgumentParser) -> None:
    _add_flags(parser, RequestLimits)


def add_router_flags(parser: argparse.ArgumentParser, discovery: bool = True) -> None:
    """RouterConfig's own flags (the server's are added apart); discovery=False: not the worker
    discovery ones (`tandem up` wires its own workers)."""
    _add_flags(parser, RouterConfig, () if discovery else DISCOVERY_FIELDS)


def router_settings(args: argparse.Namespace) -> dict:
    """RouterConfig's own fields as the parsed flags set them (`tandem serve router`)."""
    return {f.name: getattr(args, f.name) for f, _, _ in _fields(RouterConfig)}


def router_argv(args: argparse.Namespace) -> list[str]:
    """Every flag `tandem up` passes its router (its router flags but discovery, defaults too:
    they win over the faster health polls the test clusters' launcher sets by default)."""
    argv = []
    for f, flag, kind in _fields(RouterConfig, DISCOVERY_FIELDS):
        value = getattr(args, f.name)
        if kind is bool:  # a switch: named only where it flips its default
            argv += [flag] if value != f.default else []
        else:
            argv += [flag, str(value)]
    return argv


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
