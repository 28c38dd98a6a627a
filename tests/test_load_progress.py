"""Loading prints its progress (issue 35): a line each tenth of the tensors read and one at the
end, with bytes and rate, for a checkpoint directory and for a GGUF file's conversion."""

from __future__ import annotations

import logging

from tandem.engine.loader import _checkpoint_files, _read_tensors
from tandem.engine.progress import Progress


def test_a_load_logs_each_tenth_and_its_end(caplog, model_dirs):
    caplog.set_level(logging.INFO, logger="tandem.load")
    tensors = _read_tensors(_checkpoint_files(model_dirs["llama"]))
    lines = [r.getMessage() for r in caplog.records if r.name == "tandem.load"]
    assert lines[-1].startswith(f"loading weights from {model_dirs['llama']}: 100% (")
    assert f"of {len(tensors)}" in lines[-1] and "GB" in lines[-1]
    assert 2 <= len(lines) <= 11  # bounded: not a line a tensor


def test_progress_says_every_tenth_once():
    progress = Progress("work", 25, 2_500)
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("tandem.load").addHandler(handler)
    old_level = logging.getLogger("tandem.load").level
    logging.getLogger("tandem.load").setLevel(logging.INFO)
    try:
        for _ in range(25):
            progress.step(100)
    finally:
        logging.getLogger("tandem.load").removeHandler(handler)
        logging.getLogger("tandem.load").setLevel(old_level)
    assert [line.split(":")[1].split("%")[0].strip() for line in lines] == [
        "12", "20", "32", "40", "52", "60", "72", "80", "92", "100"
    ]  # fmt: skip
    assert "(25 of 25, 0.00 of 0.00 GB)" in lines[-1]
