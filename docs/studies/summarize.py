#!/usr/bin/python3
"""The tables of docs/bench.md ("What the studies found, reproduced"), computed
from the bench runner's results.json files, so the tables can be checked and rebuilt.

    summarize.py offload DIR offload  # DIR/offload-{core,off,on,fixed}-N/results.json
    summarize.py offload DIR slow     # DIR/slow-{off,on}-N/results.json
    summarize.py nhit DIR PREFIX   # DIR/PREFIX-{off,on}-N/results.json (off: always, on: nhit 2)
    summarize.py burst DIR     # DIR/burst-{raid,ssd}-{off,on}-N (lazy flush off, on)
    summarize.py tail DIR      # DIR/tail-{wb,wt}-N (tail-ssd.toml --cache-mode wb, wt)
    summarize.py readahead DIR # DIR/readahead-{off,on}-N (readahead-raid.toml, -on.toml)

Figures are medians over the runs found; each run (or their range) is given next to the IOPS.
Statistics are the cache's counters after the measured phase minus before it.

The runs behind the tables of docs/bench.md are kept whole (every results.json; `hybridcache bench
overlay` redraws the lazy flush charts from them) in docs/studies/runs.json.gz:

    summarize.py unpack DIR    # writes DIR/NAME/results.json for every run in the bundle
    summarize.py pack OUT DIR...   # the reverse: bundles DIR/NAME/results.json
"""
import glob
import gzip
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


def fmt_old(v):
    """The number style of the lazy flush, tail and read-ahead tables."""
    if v is None:
        return "-"
    if v >= 100:
        return f"{v:,.0f}"
    if v >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}"


def main_dir(c):
    """fio's figures of the direction that wrote, or of the reads for read-only patterns."""
    fio = c["outcome"]["fio"]
    return fio["write"] if fio["write"]["bytes"] > 0 else fio["read"]


def burst(base):
    print("| core | config | lazy flush | IOPS (runs) | p99 ms | p99.99 ms | seconds |")
    print("|---|---|---|---:|---:|---:|---:|")
    for core in ["raid", "ssd"]:
        for lf in ["off", "on"]:
            for cfg in ["core", "cache"]:
                # The core alone does not depend on lazy flush: shown once, from the off runs.
                if cfg == "core" and lf == "on":
                    continue
                cs = [c for _, c in runs(base, f"burst-{core}-{lf}")
                      if c["key"].startswith(cfg + "/")]
                if not cs:
                    continue
                iops = [c["outcome"]["fio"]["iops"] for c in cs]
                p99 = [main_dir(c)["lat_p99_us"] / 1000 for c in cs]
                p4 = [main_dir(c)["lat_p9999_us"] / 1000 for c in cs]
                secs = [c["outcome"]["fio"]["seconds"] for c in cs]
                print(f"| {core} | {cfg} | {lf if cfg == 'cache' else '(no cache)'} "
                      f"| {fmt_old(med(iops))} ({', '.join(fmt_old(x) for x in iops)}) "
                      f"| {fmt_old(med(p99))} | {fmt_old(med(p4))} | {fmt_old(med(secs))} |")


def tail(base):
    cols = [(nj, qd) for nj in (1, 4, 8) for qd in (1, 8, 32)]
    metrics = [
        ("IOPS", lambda c: c["outcome"]["fio"]["iops"], False),
        ("writes p99.99 ms", lambda c: c["outcome"]["fio"]["write"]["lat_p9999_us"] / 1000, True),
        ("reads p99.99 ms", lambda c: c["outcome"]["fio"]["read"]["lat_p9999_us"] / 1000, True),
        ("writes mean ms", lambda c: c["outcome"]["fio"]["write"]["lat_mean_us"] / 1000, True),
    ]
    for pat in ["randrw70", "randrw30"]:
        for label, fn, ratio in metrics:
            n = len({d for d, _ in runs(base, "tail-wb")})
            print(f"\n**{pat}, {label}** (median of {n} runs)\n")
            print("| mode | " + " | ".join(f"{nj}/{qd}" for nj, qd in cols) + " |")
            print("|---|" + "---:|" * len(cols))
            rows = {}
            for mode in ["wb", "wt"]:
                cells = [c for _, c in runs(base, f"tail-{mode}")]
                rows[mode] = [med([fn(c) for c in cells
                                   if c["key"] == f"cache/{pat}/4K/{nj}x{qd}/r0"])
                              for nj, qd in cols]
                print(f"| {mode} | " + " | ".join(fmt_old(x) for x in rows[mode]) + " |")
            if ratio:
                print("| wb / wt | " + " | ".join(
                    f"{a / b:.2f}x" if a and b else "-" for a, b in zip(rows["wb"], rows["wt"]))
                    + " |")


def readahead(base):
    print("| pattern | nj/qd | core MB/s | cache, no read-ahead | cache, read-ahead "
          "| read-ahead / none |")
    print("|---|---|---:|---:|---:|---:|")
    for pat in ["read", "randread"]:
        for qd in [1, 8]:
            key = f"/{pat}/4K/1x{qd}/r0"

            def mbs(name, cfg):
                return [c["outcome"]["fio"]["mb_s"] for _, c in runs(base, name)
                        if c["key"] == cfg + key]

            # Both kinds of run measure the core alone: all of them count.
            core = med(mbs("readahead-off", "core") + mbs("readahead-on", "core"))
            off = med(mbs("readahead-off", "cache"))
            on = med(mbs("readahead-on", "cache"))
            print(f"| {pat} | 1/{qd} | {fmt_old(core)} | {fmt_old(off)} | {fmt_old(on)} "
                  f"| {fmt_old(on / off) if on and off else '-'}x |")



BUNDLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "runs.json.gz")


def pack(out, dirs):
    runs_ = {}
    for base in dirs:
        for p in sorted(glob.glob(os.path.join(base, "*", "results.json"))):
            with open(p) as f:
                runs_[os.path.basename(os.path.dirname(p))] = json.load(f)
    with gzip.open(out, "wt") as f:
        json.dump(runs_, f, separators=(",", ":"), sort_keys=True)
    print(f"{out}: {len(runs_)} runs")


def unpack(base):
    with gzip.open(BUNDLE, "rt") as f:
        runs_ = json.load(f)
    for name, d in runs_.items():
        os.makedirs(os.path.join(base, name), exist_ok=True)
        with open(os.path.join(base, name, "results.json"), "w") as f:
            json.dump(d, f)
    print(f"{base}: {len(runs_)} runs")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "offload" and sys.argv[3] in OFFLOAD_RUNS:
        offload(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 4 and sys.argv[1] == "nhit":
        nhit(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 3 and sys.argv[1] in ("burst", "tail", "readahead"):
        {"burst": burst, "tail": tail, "readahead": readahead}[sys.argv[1]](sys.argv[2])
    elif len(sys.argv) == 3 and sys.argv[1] == "unpack":
        unpack(sys.argv[2])
    elif len(sys.argv) >= 4 and sys.argv[1] == "pack":
        pack(sys.argv[2], sys.argv[3:])
    else:
        sys.exit(__doc__)
