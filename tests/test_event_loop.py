"""The servers' event loop choice (common/loop.py): asyncio's by default, uvloop only when asked."""

import asyncio

import pytest

from tandem.common import loop


async def _running_loop_type():
    return type(asyncio.get_running_loop()).__module__


def test_the_default_loop_is_asyncios(monkeypatch):
    monkeypatch.delenv(loop.EVENT_LOOP_ENV, raising=False)
    assert loop.loop_name() == "asyncio"
    assert loop.run(_running_loop_type()).startswith("asyncio")


def test_uvloop_runs_when_asked(monkeypatch):
    pytest.importorskip("uvloop")
    monkeypatch.setenv(loop.EVENT_LOOP_ENV, "uvloop")
    assert loop.loop_name() == "uvloop"
    assert loop.run(_running_loop_type()).startswith("uvloop")


def test_an_unknown_loop_is_refused(monkeypatch):
    monkeypatch.setenv(loop.EVENT_LOOP_ENV, "trio")
    with pytest.raises(
        ValueError, match="TANDEM_EVENT_LOOP must be 'uvloop' or 'asyncio', got 'trio'"
    ):
        loop.loop_name()
