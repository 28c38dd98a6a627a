"""Log lines as text (the default) or one JSON object a line (`--log-format json`), each carrying
the request it serves.

A request's handler binds its fields (`bind(request_id=..., worker=...)`) into a context
variable; asyncio copies the context into the tasks a handler starts, so every line logged on
the request's behalf carries them, in both formats, without threading them through calls. Lines
logged outside a request (start-up, health, the engine thread) carry none.

The format is a process setting: `--log-format` (or TANDEM_LOG_FORMAT, which `tandem up` and the
Helm chart set for the processes they start).
"""

from __future__ import annotations

import contextvars
import datetime
import json
import logging
import os

FORMATS = ("text", "json")
FORMAT_ENV = "TANDEM_LOG_FORMAT"
_TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# The request fields bound in this context (None: none); replaced, never mutated (contexts
# share the dict).
_FIELDS: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "tandem_log_fields", default=None
)


def bind(**fields) -> None:
    """Adds fields (None or "" skipped) to every line logged from this context on."""
    given = {name: str(value) for name, value in fields.items() if value not in (None, "")}
    if given:
        _FIELDS.set({**bound(), **given})


def bound() -> dict[str, str]:
    return _FIELDS.get() or {}


class _Fields(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.tandem_fields = bound()
        return True


class JsonFormatter(logging.Formatter):
    """{"ts", "level", "logger", "message", the bound fields, "exception" when there is one}."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
            **getattr(record, "tandem_fields", {}),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class TextFormatter(logging.Formatter):
    """The plain format, the bound fields appended as key=value."""

    def __init__(self):
        super().__init__(_TEXT)

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = getattr(record, "tandem_fields", {})
        if not fields:
            return text
        return text + " [" + " ".join(f"{k}={v}" for k, v in fields.items()) + "]"


def check_format(value: str) -> str:
    if value not in FORMATS:
        raise ValueError(
            f"log format must be one of {', '.join(FORMATS)} (--log-format, {FORMAT_ENV}), "
            f"got {value!r}"
        )
    return value


def default_format() -> str:
    return os.environ.get(FORMAT_ENV, "text")


def configure(level: str, fmt: str) -> None:
    """The root logger's one handler (stderr) in fmt; children this process starts inherit fmt."""
    check_format(fmt)
    os.environ[FORMAT_ENV] = fmt
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(_Fields())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
