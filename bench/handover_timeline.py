"""The handover's timeline across the router, the prefill and the decode (issue 39), from
timestamps the processes write when `bench/handover_timeline.patch` is applied and TANDEM_T=1:

    git apply bench/handover_timeline.patch
    TANDEM_T=1 python bench/disagg_e2e.py --num-requests 12 --prompt-len 1024 --max-tokens 16
    cat /tmp/tandem-logs-*/*.log | grep '^TT' > tt.log      # LocalCluster's worker logs
    python bench/handover_timeline.py tt.log
    git apply -R bench/handover_timeline.patch

Each line the patch writes is `TT <unix time> <pid> <label> [request id]` (one host: the
clocks agree). For the first N split requests (the bench's 2-token handover pass), times are
taken from the moment the router holds the prefill's reply (rtr_ctx_done); each label's first
occurrence after the one before that request's reply is kept, and the medians are printed in
order: the prefill's step that emitted the first token (eng_step1 of the prefill's pid), the
reply leaving it (ses_yield), the router, the decode's session (ses_start), its generation phase
(dec_run, dec_reserved, dec_agent), the READ on the poller thread (poll_post0: picked up,
poll_posted: prepared and posted, poll_done: found done), dec_pulled, the engine's arrival and
step (eng_arrived, eng_step0 / eng_step1: a step's start and end, with its count of outputs: 0 for
a step whose outputs the next one collects; eng_step1 is keyed by that count, so the prefill's
step that hands the first token over reads as `eng_step1 (1 out)`, not as the launch before
it), dec_confirm0 / dec_confirmed (the lease confirm asked / answered), and the second token leaving the decode (ses_yield) and reaching the router (rtr_msg).
On both workers: eng_stats / eng_kvev (the engine thread's stats and KV events after a step),
eng_putall (the loop takes a step's outputs), snk_msg0 / snk_msg1 / snk_pushed (an output's
message built and queued on the session). The prefill's handoff straight to the decode:
push_send (queued for the decode's stream), push_yield (taken by gRPC to write), srv_direct (the
decode has it); srv_started: the decode's request started after its handoff; rtr_ctx0: the
router sends the context phase.
"""

from __future__ import annotations

import argparse
import statistics


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("log", help="the TT lines of every process of one run")
    parser.add_argument("--requests", type=int, default=12, help="split requests to read")
    parser.add_argument("--show", type=int, default=2, help="requests printed in full")
    args = parser.parse_args()
    with open(args.log) as f:
        lines = sorted(
            (line.split() for line in f if line.startswith("TT ")), key=lambda r: float(r[1])
        )
    starts = [i for i, row in enumerate(lines) if row[3] == "rtr_ctx_done"]
    offsets: dict[str, list[float]] = {}
    # The first reply is the bench's warm-up request: skipped.
    for k, i in enumerate(starts[1 : args.requests]):
        t0 = float(lines[i][1])
        j = i
        while j > 0 and t0 - float(lines[j - 1][1]) < 0.006:
            j -= 1
        seen: set[str] = set()
        shown = []
        for row in lines[j : i + 40]:
            if row[3] == "rtr_ctx_done" and row is not lines[i]:
                break
            key = f"{row[2]}:{row[3]}"
            if row[3] == "eng_step1" and len(row) > 4:
                # A step with outputs and one without (a launch whose outputs the next step
                # collects) are different moments: their first occurrences are kept apart.
                key += f" ({row[4]} out)"
            ms = (float(row[1]) - t0) * 1e3
            shown.append(f"{ms:8.2f} {row[2]} {row[3]} {' '.join(row[4:])}")
            if key not in seen and -6 < ms < 60:
                seen.add(key)
                offsets.setdefault(key, []).append(ms)
        if k < args.show:
            print("---")
            print("\n".join(shown[:30]))
    print(
        "=== medians, ms from the router holding the prefill's reply (pid:label, first occurrence)"
    )
    for key, values in sorted(offsets.items(), key=lambda kv: statistics.median(kv[1])):
        print(f"{statistics.median(values):8.2f}  n={len(values):2d}  {key}")


if __name__ == "__main__":
    main()
