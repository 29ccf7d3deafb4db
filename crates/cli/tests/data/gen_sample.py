#!/usr/bin/env python3
"""Regenerates sample.blkparse: a small synthetic blkparse trace of two closed-loop jobs.

- pid 100 "dbserver": 4 KiB requests at queue depth 1, 30 % reads, random offsets in a 2 MiB
  region (so blocks are re-referenced and the miss-ratio curve has a knee);
- pid 200 "backup": 512 KiB sequential writes at queue depth 4.

Usage: python3 gen_sample.py > sample.blkparse
"""
import random


def job(pid, name, size, qd, n, read_share, sequential, base, span, service_ns, seed):
    rng = random.Random(seed)
    out, in_flight, nxt, t, issued = [], [], base, 0, 0

    def issue(t):
        nonlocal nxt
        op = "R" if rng.random() < read_share else "W"
        if sequential:
            off, nxt = nxt, nxt + size
        else:
            off = base + rng.randrange(span // size) * size
        sec, cnt = off // 512, size // 512
        out.append((t, f"{pid} Q {op}S {sec} + {cnt} [{name}]"))
        out.append((t + 1000, f"{pid} D {op}S {sec} + {cnt} [{name}]"))
        in_flight.append((sec, cnt, op))

    while issued < min(qd, n):
        issue(t)
        issued += 1
    while in_flight:
        sec, cnt, op = in_flight.pop(0)
        t += service_ns
        out.append((t, f"0 C {op}S {sec} + {cnt} [0]"))
        if issued < n:
            issue(t + 500)
            issued += 1
    return out


events = []
for ji, j in enumerate([
    job(100, "dbserver", 4096, 1, 600, 0.3, False, 0, 2 << 20, 2_000_000, 1),
    job(200, "backup", 512 << 10, 4, 120, 0.0, True, 1 << 30, 0, 8_000_000, 2),
]):
    events += [(t, ji, k, line) for k, (t, line) in enumerate(j)]
events.sort()
for i, (t, ji, _, line) in enumerate(events):
    print(f"  8,0 {ji % 4:>2} {i + 1:>8} {t // 10**9:>5}.{t % 10**9:09} {line}")
