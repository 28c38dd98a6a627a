"""The engine's command-line flags, built from EngineConfig's field metadata (the one definition):
`tandem serve` and `tandem up` parse them, and `tandem up` passes a config on to its workers."""
from __future__ import annotations

import argparse
import dataclasses
import typing

from tandem.engine.config import EngineConfig


def _engine_fields():
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        yield f, flag, hints[f.name]


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    for f, flag, kind in _engine_fields():
        meta = f.metadata
        if kind is bool:  # the flag flips the default
            action = "store_false" if f.default else "store_true"
            parser.add_argument(flag, dest=f.name, action=action, help=meta["help"])
        else:
            base = typing.get_args(kind)[0] if typing.get_origin(kind) is typing.Union else kind
            parser.add_argument(flag, dest=f.name, type=base, default=f.default, help=meta["help"],
                                metavar=flag.lstrip("-").replace("-", "_").upper(), **meta["argparse"])


def engine_config(args: argparse.Namespace, resolve_model) -> EngineConfig:
    """The EngineConfig the parsed flags describe; resolve_model(--model) names the checkpoint
    directory (the default model when --model is not given, a converted one for a .gguf file)."""
    values = {f.name: getattr(args, f.name) for f, _, _ in _engine_fields()}
    values["model_dir"] = str(resolve_model(values["model_dir"]))
    return EngineConfig(**values)


def engine_argv(config: EngineConfig) -> list[str]:
    """The flags that make a worker run with config (what `tandem up` passes on)."""
    argv = []
    for f, flag, kind in _engine_fields():
        value = getattr(config, f.name)
        if kind is bool:
            if value != f.default:
                argv.append(flag)
        elif value is not None:
            argv += [flag, str(value)]
    return argv
