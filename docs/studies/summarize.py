#!/usr/bin/python3
"""The offload and nhit tables of docs/bench.md ("What the studies found, reproduced"), computed
from the bench runner's results.json files, so the tables can be checked and rebuilt.

    summarize.py offload DIR offload  # DIR/offload-{core,off,on,fixed}-N/results.json
    summarize.py offload DIR slow     # DIR/slow-{off,on}-N/results.json
    summarize.py nhit DIR PREFIX   # DIR/PREFIX-{off,on}-N/results.json (off: always, on: nhit 2)

Figures are medians over the runs found; the runs themselves are listed next to the IOPS.
Statistics are the cache's counters after the measured phase minus before it.
"""
import glob
import json
import os
import statistics
import sys


def runs(base, name):
    """The ok cells of every run DIR/name-N, as a list of (run dir, cell)."""
    out = []
    for d in sorted(glob.glob(os.path.join(base, f"{name}-[0-9]*"))):
        p = os.path.join(d, "results.json")
        if not os.path.exists(p):
            continue
        with open(p) as f:
            for c in json.load(f)["cells"]:
                if c["status"] == "ok":
                    out.append((d, c))
    return out


def med(v):
    v = [x for x in v if x is not None]
    return statistics.median(v) if v else None


def fmt(v):
    if v is None:
        return "-"
    if v == 0:
        return "0"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}"


def kilo(v):
    return f"{v / 1000:.1f}k"


def spread(v):
    """'83.8k (79.5-98.1k)': the median, then the lowest and highest run."""
    return f"{kilo(med(v))} ({min(v) / 1000:.1f}-{kilo(max(v))})"


def delta(c, k):
    o = c["outcome"]
    if not o.get("stats_after") or not o.get("stats_before"):
        return None
    return o["stats_after"][k] - o["stats_before"][k]


def reads(c):
    keys = ["read_hits", "read_full_misses", "read_partial_misses", "pass_through_reads"]
    v = [delta(c, k) for k in keys]
    return None if None in v else sum(v)


def pct(a, b):
    return None if a is None or not b else 100.0 * a / b


def p99_ms(c):
    fio = c["outcome"]["fio"]
    d = fio["write"] if fio["write"]["bytes"] > 0 and fio["read"]["bytes"] == 0 else fio["read"]
    return d["lat_p99_us"] / 1000


OFFLOAD_RUNS = {
    # offload-ssd*.toml: the RAM cache as it is.
    "offload": [
        ("offload-core", "core alone"),
        ("offload-off", "offload off"),
        ("offload-on", "on: 50%, threshold 1"),
        ("offload-fixed", "fixed: 25%, threshold 0"),
    ],
    # offload-slowcache*.toml: the cache device capped at 15k IOPS.
    "slow": [
        ("slow-off", "offload off"),
        ("slow-on", "on: 50%, threshold 1"),
    ],
}


def offload(base, which):
    print("| pattern | configuration | runs | IOPS (lowest-highest) | read hit % "
          "| reads offloaded | writes offloaded | bytes read from the core | read p99 ms |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for pat in ["randread", "randrw70"]:
        for name, label in OFFLOAD_RUNS[which]:
            cs = [c for _, c in runs(base, name) if f"/{pat}/" in c["key"]]
            if not cs:
                continue
            core_alone = name.endswith("-core")
            iops = [c["outcome"]["fio"]["iops"] for c in cs]
            hit = [pct(delta(c, "read_hits"), reads(c)) for c in cs]
            off_r = [pct(delta(c, "offload_reads"), reads(c)) for c in cs]
            off_w = [delta(c, "offload_writes") for c in cs]
            core = [pct(delta(c, "core_read_bytes"), delta(c, "exported_read_bytes")) for c in cs]
            p99 = [p99_ms(c) for c in cs]
            cells = [
                pat,
                label,
                str(len(cs)),
                spread(iops),
                "-" if core_alone else fmt(med(hit)),
                "-" if core_alone else f"{fmt(med(off_r))}%",
                "-" if core_alone else f"{med(off_w):,.0f}",
                "-" if core_alone else f"{fmt(med(core))}%",
                fmt(med(p99)),
            ]
            print("| " + " | ".join(cells) + " |")


def nhit(base, prefix):
    print("| promotion | IOPS (runs) | read hit % | lines inserted | core reads, MB | p99 ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, label in [("off", "always"), ("on", "nhit, threshold 2")]:
        cs = [c for _, c in runs(base, f"{prefix}-{name}")]
        if not cs:
            continue
        iops = [c["outcome"]["fio"]["iops"] for c in cs]
        hit = [pct(delta(c, "read_hits"), reads(c)) for c in cs]
        # A read-only workload writes the cache only to insert: its bytes over the line size
        # are the lines inserted (promotion's whole effect), whatever the miss counters say.
        ins = [delta(c, "cache_written_bytes") / c["outcome"]["stats_after"]["line_size"]
               for c in cs]
        core = [delta(c, "core_read_bytes") / 1e6 for c in cs]
        p99 = [p99_ms(c) for c in cs]
        print(f"| {label} | {kilo(med(iops))} ({', '.join(f'{x / 1000:.1f}' for x in iops)}) "
              f"| {fmt(med(hit))} | {fmt(med(ins))} | {fmt(med(core))} | {fmt(med(p99))} |")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "offload" and sys.argv[3] in OFFLOAD_RUNS:
        offload(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 4 and sys.argv[1] == "nhit":
        nhit(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)
