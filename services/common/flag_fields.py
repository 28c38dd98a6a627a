"""Config dataclass fields that are also command-line flags: the one definition of a setting's
name, default and help (services/cli/flags.py builds the flags from this metadata, and `tandem
up` passes a config on to its processes through it)."""

from __future__ import annotations

import dataclasses


def flag_field(default, help: str, flag: str | None = None, **argparse_kwargs):
    """A dataclass field with its flag: `flag` (default: --field-name) and argparse keywords
    (a `type` here replaces the field's own type as the flag's parser)."""
    return dataclasses.field(
        default=default, metadata={"help": help, "flag": flag, "argparse": argparse_kwargs}
    )


def split_list(value: str) -> tuple[str, ...]:
    """A comma-separated flag value as a tuple of its non-empty entries."""
    return tuple(v.strip() for v in value.split(",") if v.strip())
