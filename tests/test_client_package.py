"""The client distribution needs only grpcio and protobuf."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def test_client_declares_only_grpcio_and_protobuf():
    deps = tomllib.loads((ROOT / "client" / "pyproject.toml").read_text())["project"][
        "dependencies"
    ]
    assert sorted(d.split(">")[0].split("=")[0].split("<")[0] for d in deps) == [
        "grpcio",
        "protobuf",
    ]


def test_client_imports_without_torch_or_transformers():
    code = (
        "import sys\n"
        "for name in ('torch', 'transformers', 'tokenizers', 'safetensors', 'numpy'): sys.modules[name] = None\n"
        "import tandem.client as c\n"
        "c.LLM, c.AsyncLLM, c.SamplingParams\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers') and sys.modules[m] is not None]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
