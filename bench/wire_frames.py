"""What a step's outputs cost to cross from the engine core process to the worker's IO process
(issue 28, `--engine-process`): one frame of N StepOutputs, encoded in the core and decoded in the
IO process: each output a map of its fields, the frame decoded to plain values and each output
converted back into the dataclass (before), against the frame read in two passes with each
output's map left raw and read by a decoder typed for StepOutput (engine/wire.py now).

    python bench/wire_frames.py                  # 64 and 256 outputs a frame

There is no roofline: the floor is zero; the step it rides beside is what it is measured against
(a 256-sequence decode step of the 8B shape on an H100: ~9.5 ms).
"""

from __future__ import annotations

import argparse
import statistics
import time

import msgspec

from tandem.engine import wire
from tandem.engine.messages import StepOutput
from tandem.engine.sequence import FinishReason
from tandem.worker.core_protocol import Outputs


def outputs(n: int) -> list[StepOutput]:
    """A decode step's outputs: one token each, a few finishing."""
    return [
        StepOutput(
            f"req-{i}",
            [1000 + i],
            [None],
            -1.5,
            i % 50 == 0,
            FinishReason.LENGTH if i % 50 == 0 else None,
            None,
            32,
            0,
            new_ranks=[None],
        )
        for i in range(n)
    ]


def timed_us(fn, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="64,256")
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    print("outputs | path | core: pack + encode (us) | IO process: decode + unpack (us)")
    print("--- | --- | --- | ---")
    for n in (int(s) for s in args.sizes.split(",")):
        outs = outputs(n)

        def encode():  # the core's side, the same both ways: wire.pack per output, one frame
            return wire.encode(Outputs([[o.request_id, *wire.pack(o)] for o in outs]))

        def converted(frame):  # before: plain values, then msgspec.convert per output
            items = msgspec.msgpack.decode(frame, ext_hook=wire._ext_hook)[1]["items"]
            return [msgspec.convert(p, StepOutput, strict=False) for _, _, p in items]

        def typed(frame):  # now
            return [wire.unpack(k, p) for _, k, p in wire.decode(frame)[0].items]

        frame = encode()
        encode_us = timed_us(encode, args.iters)
        for name, decode in (("decoded, converted", converted), ("raw, typed", typed)):
            assert decode(frame) == outs
            print(
                f"{n} | {name} | {encode_us:.1f} | "
                f"{timed_us(lambda f=frame, d=decode: d(f), args.iters):.1f}"
            )


if __name__ == "__main__":
    main()
