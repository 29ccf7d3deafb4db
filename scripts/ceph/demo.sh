#!/usr/bin/env bash
# make ceph-demo: a miniature Ceph cluster (1 mon, 1 mgr, 3 BlueStore OSDs) on this machine, run
# twice: each OSD directly on an emulated SAS HDD (the baseline), then each OSD on a hybridcache
# cache in front of the same emulated HDD, set up with the Open CAS + Ceph study's recipe. The
# study's workloads run with fio's rbd engine on RBD images in a pool of size 2; the table puts our
# gains next to the study's. Output in $CEPH_OUT (default ceph-out/): report.md, results.json,
# ceph-gains.png, the fio JSON files. See docs/ceph.md.
#
# Environment: RUNTIME (seconds per measured workload, default 20), JOBS (fio jobs, default 2),
# OSDS (default 3), CEPH_DIR (run directory, default target/ceph), HC (the binary).
source "$(dirname "$0")/lib.sh"

RUNTIME=${RUNTIME:-20}
JOBS=${JOBS:-2}
OUT=${CEPH_OUT:-$ROOT/ceph-out}
IMAGE_SIZE=2G
# Each job works on its own slice of the image: HIT_REGION for the hit test (it must fit the cache
# with room to spare), REGION for the others.
HIT_REGION=64M
REGION=256M

mkdir -p "$OUT"
for config in ${CONFIGS:-bare cached}; do rm -f "$OUT/$config"-*; done
rm -f "$OUT"/report.md

# One fio run; prints nothing, leaves $OUT/CONFIG-NAME.json.
workload() {
    local config=$1 name=$2 rw=$3 bs=$4 size=$5
    shift 5
    say "$config: $name"
    rbd_fio "$config-$name" img --rw="$rw" --bs="$bs" --iodepth=16 --numjobs="$JOBS" \
        --size="$size" --offset_increment="$size" --group_reporting "$@"
    mv "$CEPH_DIR/$config-$name.json" "$OUT/"
}

# CPU time (jiffies) of the processes whose pid files are given. Each file is read on its own:
# nbdfuse writes its pid without a newline, so `cat` of several files would glue two pids into
# one number that names no process (the CPU of both was then lost).
cpu_of_pidfiles() {
    local f p t=0
    for f in "$@"; do
        [ -s "$f" ] || continue
        read -r p <"$f" || [ -n "$p" ] || continue
        [ -r "/proc/$p/stat" ] || continue
        t=$((t + $(awk '{print $14 + $15}' "/proc/$p/stat")))
    done
    echo "$t"
}

# CPU time used by the OSDs, hybridcache and nbdfuse since the last call, to say what bounds a
# run.
cpu_mark() {
    cpu_of_pidfiles "$CEPH_DIR"/run/osd.*.pid "$CEPH_DIR"/hc/*.pid
}

# The same CPU time by part: "OSDS HYBRIDCACHE NBDFUSE" (jiffies), so a report can say whose
# CPU a request costs (the cache's own, BlueStore's, or the FUSE device path this machine needs
# in place of a kernel NBD or ublk client).
cpu_parts() {
    echo "$(cpu_of_pidfiles "$CEPH_DIR"/run/osd.*.pid)" \
        "$(cpu_of_pidfiles "$CEPH_DIR"/hc/daemon.pid "$CEPH_DIR"/hc/serve.*.pid)" \
        "$(cpu_of_pidfiles "$CEPH_DIR"/hc/nbdfuse.*.pid)"
}

# The whole machine's busy and total CPU time (jiffies, every CPU) from /proc/stat: the OSDs and
# hybridcache are not all that runs here (the fio client with librbd, nbdfuse, the loop devices,
# the mon), so the report says how busy the machine was, not only what the OSDs used.
machine_mark() {
    awk '/^cpu / {print $2 + $3 + $4 + $7 + $8 + $9, $2 + $3 + $4 + $5 + $6 + $7 + $8 + $9}' \
        /proc/stat
}

# The CPU time of the shell's waited-for children (bash's `times`, second line): around one
# workload that is the fio client with librbd, which on this one machine shares the CPUs with the
# OSDs (the study's clients ran on other hosts). Seconds, from `times` output saved before and
# after.
client_seconds() {
    awk 'NR == 2 { for (i = 1; i <= 2; i++) { split($i, t, "m"); s += t[1] * 60 + t[2] } }
        END { printf "%.3f\n", s }' "$1"
}

cache_stats() {
    local config=$1 name=$2 i
    [ "$config" = cached ] || return 0
    for i in $(seq 1 "$OSDS"); do
        hc -P -i "$i" -o json >"$OUT/$config-$name.cache$i.json"
    done
}

# Every OSD's own counters (`ceph daemon osd.N perf dump`), before and after a workload: the
# report turns the differences into what each client write cost inside BlueStore (deferred
# writes, RocksDB WAL bytes, kv sync latency), which says what bounds a row.
perf_dump() {
    local config=$1 name=$2 when=$3 i
    for i in $(seq 0 $((OSDS - 1))); do
        ceph --admin-daemon "$CEPH_DIR/run/osd.$i.asok" perf dump \
            >"$OUT/$config-$name.osd$i.perf-$when.json" 2>/dev/null || true
    done
}

# What each OSD decided about its device: rotational or not picks BlueStore's HDD or SSD
# defaults (deferred writes, allocation size), so the report names it.
osd_metadata() {
    local config=$1 i
    for i in $(seq 0 $((OSDS - 1))); do
        cephc osd metadata "$i" -f json >"$OUT/$config-osd$i.metadata.json" 2>/dev/null || true
        ceph --admin-daemon "$CEPH_DIR/run/osd.$i.asok" config get \
            bluestore_prefer_deferred_size_hdd >"$OUT/$config-osd$i.deferred-hdd.json" \
            2>/dev/null || true
    done
}

reset_stats() {
    local config=$1 i
    [ "$config" = cached ] || return 0
    for i in $(seq 1 "$OSDS"); do hc -Z -i "$i" >/dev/null; done
}

run_config() {
    local config=$1 t0 t1
    say "$config: starting the cluster"
    start_stack "$config"
    rbd_create img "$IMAGE_SIZE"
    # Precondition, as Ceph benchmarks do: write every job's region once, sequentially in 1 MiB
    # writes, so BlueStore has allocated its extents. On a thin image's first write BlueStore
    # hands out new extents in order, and logically random 4 KiB writes reach the OSD's device
    # as one sequential stream (which seq cutoff rightly sends to the HDD); once allocated, they
    # overwrite in place at random offsets, as in the study. Before warming: these writes go
    # around the cache and would drop the hit region's cached copy.
    say "$config: preconditioning the image (each job's region written once)"
    rbd_fio precondition img --rw=write --bs=1M --iodepth=16 --numjobs="$JOBS" --size="$REGION" \
        --offset_increment="$REGION" --group_reporting
    # Warm the hit region (reads of it are promoted into the cache), then measure reads of it.
    say "$config: warming the hit region"
    rbd_fio warm img --rw=write --bs=4k --iodepth=16 --numjobs="$JOBS" --size="$HIT_REGION" \
        --offset_increment="$HIT_REGION" --group_reporting
    rbd_fio warm img --rw=randread --bs=4k --iodepth=16 --numjobs="$JOBS" --size="$HIT_REGION" \
        --offset_increment="$HIT_REGION" --group_reporting
    osd_metadata "$config"
    local spec name rw bs size t0 t1 m0 m1 n0 n1 po0 ph0 pf0 po1 ph1 pf1
    for spec in "randread-4k randread 4k $HIT_REGION" "randwrite-4k randwrite 4k $REGION" \
        "randrw70-4k randrw 4k $REGION" "seqwrite-512k write 512k $REGION" \
        "seqread-512k read 512k $REGION"; do
        read -r name rw bs size <<<"$spec"
        reset_stats "$config"
        perf_dump "$config" "$name" before
        t0=$(cpu_mark)
        read -r po0 ph0 pf0 <<<"$(cpu_parts)"
        read -r m0 n0 <<<"$(machine_mark)"
        times >"$CEPH_DIR/times.before"
        local extra=()
        [ "$rw" = randrw ] && extra=(--rwmixread=70)
        workload "$config" "$name" "$rw" "$bs" "$size" --time_based --runtime="$RUNTIME" \
            "${extra[@]}"
        times >"$CEPH_DIR/times.after"
        t1=$(cpu_mark)
        read -r po1 ph1 pf1 <<<"$(cpu_parts)"
        read -r m1 n1 <<<"$(machine_mark)"
        perf_dump "$config" "$name" after
        echo $(((t1 - t0))) >"$OUT/$config-$name.cpu"
        echo "$((po1 - po0)) $((ph1 - ph0)) $((pf1 - pf0))" >"$OUT/$config-$name.cpu-parts"
        echo "$((m1 - m0)) $((n1 - n0))" >"$OUT/$config-$name.machine"
        awk -v a="$(client_seconds "$CEPH_DIR/times.after")" \
            -v b="$(client_seconds "$CEPH_DIR/times.before")" 'BEGIN { printf "%.3f\n", a - b }' \
            >"$OUT/$config-$name.client"
        cache_stats "$config" "$name"
    done
    stop_stack
}

ceph_init
echo "$(nproc)" >"$OUT/nproc"
getconf CLK_TCK >"$OUT/clk_tck"
echo "$RUNTIME" >"$OUT/runtime"
echo "$SEQ_CUTOFF" >"$OUT/seq_cutoff"
echo "$JOBS x $REGION, sequential 1 MiB writes" >"$OUT/preconditioned"
# CONFIGS=cached reruns only the cached side (e.g. with SEQ_CUTOFF=never) against the baseline
# files a previous run left in $OUT.
for config in ${CONFIGS:-bare cached}; do run_config "$config"; done
# Debian's python3 has python3-matplotlib; a python3 earlier on PATH (pyenv) may not.
py=python3
[ -x /usr/bin/python3 ] && py=/usr/bin/python3
"$py" "$ROOT/scripts/ceph/report.py" "$OUT"
