#!/usr/bin/env python3
"""Compare two builds of the engine bench, interleaved (docs/performance.md §10).

    scripts/engine-bench-ab.py BEFORE AFTER [--rounds N] [--reps R] [--json FILE]

BEFORE and AFTER are engine bench binaries (`cargo bench --no-run -p hybridcache-engine --bench
engine` prints where it put one; copy it away before building the other). In each round every
case (randwrite, randwrite_hit, randread_hit, seqwrite, flush at 1 and 2 threads; 4 KiB requests
and lines, persistent) runs `--quick --reps R` with both binaries, their order alternating from
round to round. Prints medians of IOPS (flush: bytes/s) and of CPU time per request (the
samples' `cpu_seconds`, which both binaries must report; flush: per 4 KiB line flushed), and the
load average at the start of every round. On a shared machine the CPU column is the one to
read; at load 6-8 on 2 vCPUs its medians still move by about 10% between runs of one build.
"""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile

CASES = [(t, th) for th in (1, 2)
         for t in ("randwrite", "randwrite_hit", "randread_hit", "seqwrite", "flush")]


def run(binary, test, threads, reps, js):
    cmd = [binary, "--bench", "--quick", "--reps", str(reps), "--test", test,
           "--threads", str(threads), "--req", "4", "--line", "4", "--persistence", "on",
           "--json", js]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{p.stderr[-2000:]}")
    with open(js) as f:
        return json.load(f)["results"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", help="write every sample here")
    a = ap.parse_args()
    samples, loads = {}, []
    js = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
    for r in range(a.rounds):
        with open("/proc/loadavg") as f:
            loads.append(" ".join(f.read().split()[:3]))
        for test, threads in CASES:
            order = [("before", a.before), ("after", a.after)]
            for which, binary in order if r % 2 == 0 else order[::-1]:
                for res in run(binary, test, threads, a.reps, js):
                    for s in res["samples"]:
                        if "cpu_seconds" not in s:
                            sys.exit(f"{binary} does not report cpu_seconds")
                        samples.setdefault(res["label"], {}).setdefault(which, []).append(s)
        print(f"round {r + 1}/{a.rounds} done", file=sys.stderr)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"samples": samples, "loads": loads}, f)
    print("| case | before median | after median | after/before | CPU µs/req before "
          "| CPU µs/req after | CPU after/before |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, by in samples.items():
        flush = label.startswith("flush")

        def med(which):
            v = by[which]
            rate = statistics.median(s["bytes"] / s["seconds"] if flush
                                     else s["ops"] / s["seconds"] for s in v)
            cpu = statistics.median(s["cpu_seconds"] * 1e6 / (s["bytes"] / 4096 if flush
                                                               else s["ops"]) for s in v)
            return rate, cpu
        (rb, cb), (ra, ca) = med("before"), med("after")
        shown = (lambda x: f"{x / 1e9:.2f} GB/s") if flush else (lambda x: f"{x / 1e3:.0f}k")
        print(f"| {label} | {shown(rb)} | {shown(ra)} | {ra / rb:.3f} | {cb:.3f} | {ca:.3f} "
              f"| {ca / cb:.3f} |")
    print(f"\nload average (1, 5, 15 min) at the start of each round: {'; '.join(loads)}")


if __name__ == "__main__":
    main()
