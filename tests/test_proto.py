"""The generated stubs are in sync with proto/, and the proto documents itself."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTOS = sorted((ROOT / "proto" / "tandem" / "v1").glob("*.proto"))


def test_committed_stubs_are_fresh(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{ROOT / 'proto'}",
            f"--python_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            *map(str, PROTOS),
        ],
        check=True,
    )
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert generated, "protoc produced nothing"
    for rel in generated:
        committed = ROOT / "client" / rel
        assert committed.is_file(), f"{rel} is not committed: run `make proto`"
        assert committed.read_text() == (tmp_path / rel).read_text(), (
            f"{rel} is stale: run `make proto`"
        )


def test_every_rpc_and_field_is_documented():
    undocumented = []
    for path in PROTOS:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            stripped = line.strip()
            is_field = re.match(
                r"^(optional |repeated )?[\w.<>, ]+ \w+ = \d+;", stripped
            ) and not stripped.startswith("//")
            is_decl = re.match(r"^(rpc|message|service|enum) ", stripped)
            if (is_field or is_decl) and not lines[i - 1].strip().startswith("//"):
                undocumented.append(f"{path.name}:{i + 1}: {stripped}")
    assert not undocumented, "undocumented:\n" + "\n".join(undocumented)


def test_the_service_has_one_rpc_per_seed_method():
    from tandem.v1 import llm_pb2

    rpcs = set(llm_pb2.DESCRIPTOR.services_by_name["AsyncLLM"].methods_by_name)
    assert {
        "Generate",
        "Abort",
        "Encode",
        "Preprocess",
        "CollectiveRpc",
        "GetDataTransceiverState",
        "GetKvCacheCapacity",
        "GetKvCacheEvents",
        "StreamKvCacheEvents",
        "GetStats",
        "StreamStats",
        "PauseGeneration",
        "ResumeGeneration",
        "Release",
        "Resume",
        "UpdateWeights",
        "Setup",
        "Shutdown",
        "GetServerInfo",
        "GetTokenizer",
    } <= rpcs
