"""Runs of block ids consecutive on both sides of a copy: one contiguous range each side (a NIXL
READ's descriptor, a host KV tier copy)."""

from __future__ import annotations


def coalesce_runs(source_ids, destination_ids) -> list[tuple[int, int, int]]:
    """Paired ids as (source start, destination start, number of blocks) runs, in the pairs'
    order. A run continues only while both sides advance by exactly one block."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in zip(source_ids, destination_ids):
        if runs:
            src_start, dst_start, count = runs[-1]
            if src == src_start + count and dst == dst_start + count:
                runs[-1] = (src_start, dst_start, count + 1)
                continue
        runs.append((src, dst, 1))
    return runs
