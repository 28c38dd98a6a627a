"""The front's configuration (`tandem serve openai`): one frozen dataclass, checked when built."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from tandem.client import LoRARequest
from tandem.openai.tools import PARSERS

_ADAPTER_NAME = re.compile(r"^[A-Za-z0-9_.:/-]{1,256}$")


@dataclass(frozen=True)
class FrontConfig:
    target: str = "127.0.0.1:50051"
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    # LLM's TLS keyword arguments for a TLS router (root_certificates, certificate_chain,
    # private_key, tls_server_name).
    tls: dict = field(default_factory=dict)
    # The bearer token the API's routes demand (None: open).
    api_key: str | None = None
    # How tool_choice "auto" reads calls in the output (tools.PARSERS); None: it is refused.
    tool_call_parser: str | None = None
    # The LoRA adapters clients choose by `model` (vLLM's --lora-modules), ids 1, 2, ...
    lora_modules: tuple[LoRARequest, ...] = ()
    # On SIGTERM: how long requests in flight may run on before the front exits anyway.
    shutdown_timeout_s: float = 30.0

    def __post_init__(self):
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ValueError(
                f"unknown tool-call parser {self.tool_call_parser!r}: choose one of "
                f"{', '.join(sorted(PARSERS))}"
            )
        names = [a.lora_name for a in self.lora_modules]
        if len(set(names)) != len(names):
            raise ValueError(f"LoRA adapter names must differ, got {names}")
        if self.served_model_name is not None and self.served_model_name in names:
            raise ValueError(
                f"LoRA adapter name {self.served_model_name!r} is the served model's name"
            )
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"shutdown timeout must be >= 0, got {self.shutdown_timeout_s}")

    @property
    def adapters(self) -> dict[str, LoRARequest]:
        return {a.lora_name: a for a in self.lora_modules}


def parse_lora_modules(specs: list[str]) -> tuple[LoRARequest, ...]:
    """vLLM's --lora-modules values: `name=path`, or JSON {"name": ..., "path": ...}. The adapters
    get lora_int_id 1, 2, ... in the order given."""
    adapters = []
    for number, spec in enumerate(specs, start=1):
        if spec.lstrip().startswith("{"):
            try:
                fields = json.loads(spec)
                name, path = fields["name"], fields["path"]
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(
                    f"--lora-modules {spec!r}: JSON needs string 'name' and 'path' ({exc})"
                ) from exc
        else:
            name, sep, path = spec.partition("=")
            if not sep:
                raise ValueError(f"--lora-modules {spec!r}: write name=path")
        if not isinstance(name, str) or not _ADAPTER_NAME.match(name):
            raise ValueError(
                f"--lora-modules {spec!r}: the name must be 1-256 characters of letters, digits "
                "and _ . : / -"
            )
        if not isinstance(path, str) or not path:
            raise ValueError(f"--lora-modules {spec!r}: the path is empty")
        adapters.append(LoRARequest(name, number, path))
    return tuple(adapters)
