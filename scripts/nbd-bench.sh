#!/usr/bin/env bash
# NBD throughput, in one invocation and interleaved: hybridcache (RAM cache, null core, write-back)
# against nbdkit's memory plugin (no caching: the transport's ceiling) and nbdkit's cache filter
# (write-back, cache on /dev/shm, null plugin). fio's nbd engine, 4 KiB random writes and reads at
# iodepth 1 and 32 (docs/perf.md §2). Prints a table of medians with p99/p99.99 latency, the
# ratios, and which of perf.md's targets are met.
#
#   scripts/nbd-bench.sh [--runtime S] [--reps N]
# Needs fio, nbdkit and a release build (cargo build --release).
set -euo pipefail
runtime=5
reps=3
while [ $# -gt 0 ]; do
    case "$1" in
        --runtime) runtime=$2; shift 2 ;;
        --reps) reps=$2; shift 2 ;;
        *) echo "usage: $0 [--runtime S] [--reps N]" >&2; exit 2 ;;
    esac
done
root=$(cd "$(dirname "$0")/.." && pwd)
bin=$root/target/release/hybridcache
[ -x "$bin" ] || { echo "build first: cargo build --release" >&2; exit 1; }
for tool in fio nbdkit python3; do
    command -v $tool >/dev/null || { echo "$tool is missing (make deps installs it)" >&2; exit 1; }
done
work=$(mktemp -d)
shmdir=$(mktemp -d -p /dev/shm)
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$work" "$shmdir"
}
trap cleanup EXIT

"$bin" daemon --control "$work/control.sock" --nbd-socket "$work/hc.sock" --state-dir "$work" 2>"$work/daemon.log" &
pids+=($!)
for _ in $(seq 50); do [ -S "$work/control.sock" ] && break; sleep 0.1; done
"$bin" --control "$work/control.sock" -S -d ram:1G -i 1 -c wb >/dev/null
"$bin" --control "$work/control.sock" -A -i 1 -d null:10G >/dev/null
nbdkit -f -U "$work/mem.sock" memory 1G & pids+=($!)
# The cache filter keeps its cache in $TMPDIR.
TMPDIR="$shmdir" nbdkit -f -U "$work/cf.sock" --filter=cache null 10G cache=writeback \
    cache-on-read=true & pids+=($!)
for s in mem cf; do for _ in $(seq 50); do [ -S "$work/$s.sock" ] && break; sleep 0.1; done; done

declare -A uri=(
    [hybridcache]="nbd+unix:///cas1-1?socket=$work/hc.sock"
    [nbdkit-memory]="nbd+unix:///?socket=$work/mem.sock"
    [nbdkit-cache]="nbd+unix:///?socket=$work/cf.sock"
)
servers=(hybridcache nbdkit-memory nbdkit-cache)
results=$work/results.txt
: >"$results"
for rep in $(seq "$reps"); do
    for rw in randwrite randread; do
        for qd in 1 32; do
            for s in "${servers[@]}"; do
                fio --output="$work/out.json" --output-format=json --ioengine=nbd --uri="${uri[$s]}" \
                    --name=bench --rw=$rw --bs=4k --iodepth=$qd --time_based --runtime="$runtime" \
                    --size=512m >/dev/null
                python3 - "$work/out.json" "$s" "$rw" "$qd" >>"$results" <<'EOF'
import json, sys
job = json.load(open(sys.argv[1]))["jobs"][0]
d = job["write" if "write" in sys.argv[3] else "read"]
p = d["clat_ns"].get("percentile", {})
print(sys.argv[2], sys.argv[3], sys.argv[4], round(d["iops"]),
      p.get("99.000000", 0) / 1e6, p.get("99.990000", 0) / 1e6)
EOF
                echo "rep $rep: $(tail -1 "$results")" >&2
            done
        done
    done
done
python3 - "$results" <<'EOF'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
med = {}
for s, rw, qd, iops, p99, p9999 in rows:
    med.setdefault((s, rw, int(qd)), []).append((int(iops), float(p99), float(p9999)))
print(f"{'pattern':<16}{'server':<15}{'IOPS':>9}{'p99 ms':>9}{'p99.99 ms':>11}{'vs memory':>11}{'vs cache':>10}")
for rw in ("randwrite", "randread"):
    for qd in (1, 32):
        base = {s: statistics.median(v[0] for v in med[(s, rw, qd)]) for s in ("nbdkit-memory", "nbdkit-cache")}
        for s in ("hybridcache", "nbdkit-memory", "nbdkit-cache"):
            v = med[(s, rw, qd)]
            iops = statistics.median(x[0] for x in v)
            print(f"{rw + ' qd' + str(qd):<16}{s:<15}{iops:>9.0f}{statistics.median(x[1] for x in v):>9.3f}"
                  f"{statistics.median(x[2] for x in v):>11.3f}{iops / base['nbdkit-memory']:>10.2f}x{iops / base['nbdkit-cache']:>9.2f}x")
# perf.md §2 targets for hybridcache: >= 0.9x the memory plugin at both depths, > 4x the cache
# filter at depth 32, p99.99 under 2 ms.
print("targets (perf.md §2):")
for rw in ("randwrite", "randread"):
    for qd in (1, 32):
        v = med[("hybridcache", rw, qd)]
        iops = statistics.median(x[0] for x in v)
        mem = statistics.median(x[0] for x in med[("nbdkit-memory", rw, qd)])
        cf = statistics.median(x[0] for x in med[("nbdkit-cache", rw, qd)])
        p9999 = statistics.median(x[2] for x in v)
        checks = [f"vs memory {iops / mem:.2f}x {'met' if iops >= 0.9 * mem else 'MISSED'} (>= 0.9x)",
                  f"p99.99 {p9999:.2f} ms {'met' if p9999 < 2 else 'MISSED'} (< 2 ms)"]
        if qd == 32:
            checks.append(f"vs cache filter {iops / cf:.2f}x {'met' if iops > 4 * cf else 'MISSED'} (> 4x)")
        print(f"  {rw} qd{qd}: " + "; ".join(checks))
EOF
