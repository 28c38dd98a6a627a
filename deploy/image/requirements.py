"""What the image installs, read from pyproject.toml (the one source of the pins).

Used twice: on the host by build.py to fill the wheelhouse (`pip download`), and inside
the Dockerfile to install. Three files, one per image layer, so a change to one group
does not reinstall the others (BuildKit keys a COPY by content):

  torch.txt    torch alone (the largest layer, changes least)
  runtime.txt  every other runtime dependency of tandem and tandem-client, plus the
               build backend (tandem installs with --no-build-isolation)
  nixl.txt     the nixl meta package: installed with its deps (nixl-cu12 and nixl-cu13)
               in the gpu variant, without them in the cpu variant (see nixl_cpu.py)

Stdlib only (tomllib): it runs on the image's bare Python before anything is installed.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import tomllib

# Distributions the image installs from its own source tree, not from the index.
LOCAL = {"tandem", "tandem-client"}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*")


def _name(requirement: str) -> str:
    match = _NAME.match(requirement)
    if not match:
        raise ValueError(f"cannot read a distribution name from {requirement!r}")
    return re.sub(r"[-_.]+", "-", match.group(0)).lower()


def _project(path: Path) -> dict:
    with path.open("rb") as f:
        return tomllib.load(f)["project"]


def groups(root: Path) -> dict[str, list[str]]:
    """{'torch': [...], 'runtime': [...], 'nixl': [...]} from the two pyproject files under root."""
    server = _project(root / "pyproject.toml")
    client = _project(root / "client" / "pyproject.toml")
    with (root / "pyproject.toml").open("rb") as f:
        build_requires = tomllib.load(f)["build-system"]["requires"]
    out: dict[str, list[str]] = {"torch": [], "runtime": [], "nixl": []}
    seen: set[str] = set()
    for requirement in server["dependencies"] + client["dependencies"] + build_requires:
        requirement = requirement.replace(" ", "")
        if ";" in requirement:
            raise ValueError(
                f"environment markers are not supported in the image's requirements: {requirement!r}"
            )
        name = _name(requirement)
        if name in LOCAL or name in seen:
            continue
        seen.add(name)
        out[name if name in ("torch", "nixl") else "runtime"].append(requirement)
    if not out["torch"] or not out["nixl"]:
        raise ValueError("pyproject.toml must list torch and nixl")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--root", type=Path, default=Path(__file__).resolve().parents[2], help="repository root"
    )
    parser.add_argument(
        "--out", type=Path, required=True, help="directory for torch.txt, runtime.txt, nixl.txt"
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for group, requirements in groups(args.root).items():
        (args.out / f"{group}.txt").write_text("".join(f"{r}\n" for r in requirements))
    return 0


if __name__ == "__main__":
    sys.exit(main())
