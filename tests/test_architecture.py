"""Imports go downward only (DESIGN.md): cli -> router | worker -> prefill | decode -> kvtransfer
-> engine -> kernels, with common and text beside them; decode never imports prefill, the router
imports no engine code, the engine imports no grpc, nothing imports the CLI."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {
    "kernels": ROOT / "kernels",
    "engine": ROOT / "services/engine",
    "kvtransfer": ROOT / "services/kvtransfer",
    "prefill": ROOT / "services/prefill",
    "decode": ROOT / "services/decode",
    "worker": ROOT / "services/worker",
    "router": ROOT / "services/router",
    "common": ROOT / "services/common",
    "text": ROOT / "services/text",
    "testing": ROOT / "services/testing",
    "cli": ROOT / "services/cli",
    "client": ROOT / "client/tandem/client",
    "openai": ROOT / "services/openai",
    "rl": ROOT / "services/rl",
}
# What each package may import of tandem (v1, the generated stubs, is open to every layer but
# the engine and the kernels, which speak no protobuf).
ALLOWED = {
    "kernels": set(),
    "engine": {
        "kernels",
        "common.exceptions",
        "common.kv_hash",
        "common.block_runs",
        "common.flag_fields",
    },
    "kvtransfer": {"engine", "kernels", "common", "v1"},
    "prefill": {"kvtransfer", "engine", "common", "v1"},
    "decode": {"kvtransfer", "engine", "common", "v1"},
    "worker": {"prefill", "decode", "kvtransfer", "engine", "kernels", "text", "common", "v1"},
    "router": {"text", "common", "v1"},
    "text": {"common", "v1"},
    "common": {"v1"},
    "testing": {"common", "v1", "client"},
    "cli": set(PACKAGES) | {"v1"},
    "client": {"v1"},
    "openai": {"client", "common", "v1"},
    # The trainer's side of weight sync: the public stubs, and the UCX settings its NIXL agent
    # shares with the workers' (not the transceiver: a trainer holds no KV pool).
    "rl": {"v1", "kvtransfer.ucx_env"},
}
# Third-party modules a layer must not touch.
FORBIDDEN_MODULES = {
    "engine": {"grpc"},
    "kernels": {"grpc"},
    "kvtransfer": {"grpc"},
    "text": {"torch"},
    "router": {"torch", "nixl"},
    "common": {"torch", "nixl"},
    "client": {"torch"},
    "openai": {"torch", "nixl"},
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _violations(package: str) -> list[str]:
    found = []
    for path in sorted(PACKAGES[package].rglob("*.py")):
        for name in _imports(path):
            top = name.split(".")[0]
            if top in FORBIDDEN_MODULES.get(package, ()):
                found.append(f"{path.relative_to(ROOT)} imports {name}")
            if not name.startswith("tandem."):
                continue
            target = name.split(".")[1]
            allowed = ALLOWED[package]
            if target == package or target in allowed or ".".join(name.split(".")[1:3]) in allowed:
                continue
            found.append(f"{path.relative_to(ROOT)} imports {name}")
    return found


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_imports_go_downward_only(package):
    assert _violations(package) == []


def test_the_rules_catch_an_upward_import(tmp_path, monkeypatch):
    """The checker itself: a decode module importing prefill, a router module importing the engine."""
    (tmp_path / "decode").mkdir()
    (tmp_path / "decode" / "bad.py").write_text(
        "from tandem.prefill.context import ContextPhase\nimport grpc\n"
    )
    (tmp_path / "router").mkdir()
    (tmp_path / "router" / "bad.py").write_text(
        "import torch\nfrom tandem.engine.llm_engine import LLMEngine\n"
    )
    monkeypatch.setitem(PACKAGES, "decode", tmp_path / "decode")
    monkeypatch.setitem(PACKAGES, "router", tmp_path / "router")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _violations("decode") == ["decode/bad.py imports tandem.prefill.context"]
    assert sorted(_violations("router")) == [
        "router/bad.py imports tandem.engine.llm_engine",
        "router/bad.py imports torch",
    ]


def _import_with_blocked(modules: list[str], blocked: list[str]) -> subprocess.CompletedProcess:
    code = (
        "import sys\n"
        + "".join(f"sys.modules[{b!r}] = None\n" for b in blocked)
        + "".join(f"import {m}\n" for m in modules)
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_the_router_and_the_text_layer_run_without_torch_or_the_engine():
    result = _import_with_blocked(
        ["tandem.router.app", "tandem.text.front"],
        ["torch", "nixl", "tandem.engine", "tandem.worker", "tandem.kvtransfer"],
    )
    assert result.returncode == 0, result.stderr


def test_the_engine_runs_without_grpc():
    result = _import_with_blocked(
        ["tandem.engine.engine_core", "tandem.engine.llm_engine"], ["grpc"]
    )
    assert result.returncode == 0, result.stderr
