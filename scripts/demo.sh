#!/usr/bin/env bash
# make demo: hybridcache in front of an emulated HDD RAID 60, measured with and without the cache.
#
# What it does, all under ./demo-data (left there for inspection):
#   1. creates a 1 GiB sparse cache file (a persistent cache) and an emulated slow core: the
#      calibrated RAID 60 of the study (4 groups of 10 disks at 7200 rpm, 64 KiB strip) with 64 GiB
#      disks (a 2 TiB array), keeping its data in a sparse file (demo-data/core.img);
#   2. starts `hybridcache daemon` (sockets in demo-data, 32 NBD workers so the RAID sees the queue
#      depth), starts cache 1 and adds the RAID as core 1, exported over NBD as cas1-1;
#   3. runs fio's nbd engine against cas1-1: 4 KiB random writes at iodepth 1 and 16 and a qd1
#      re-read of just-written data, first with the cache in pass-through (the core alone), then in
#      write-back; every write run gets its own fresh 512 GiB range of the array, so no run hits
#      data an earlier one left in the cache;
#   4. prints a speed-up table, the cache statistics and how to connect clients, then stops the
#      cache without flushing (-T -n: the dirty data stays on the persistent cache) and the daemon.
#
# Run it through `make demo` (installs fio etc. and builds first), or alone after
# `cargo build --release -p hybridcache`. Re-running starts from scratch (cache recreated with
# --force, core file recreated). Environment: DEMO_RUNTIME (seconds per run, default 6).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bin=$root/target/release/hybridcache
data=$root/demo-data
ctl=$data/control.sock
nbdsock=$data/nbd.sock
pidfile=$data/daemon.pid
runtime=${DEMO_RUNTIME:-6}
cache_size=1G
core_spec="raid:preset=study60,disk_size=64G,file=$data/core.img"
uri="nbd+unix:///cas1-1?socket=$nbdsock"
export HYBRIDCACHE_CONTROL=$ctl

say() { printf '\n== %s\n' "$*"; }
die() { echo "demo: $*" >&2; exit 1; }

# --- what is needed -------------------------------------------------------------------------
[ -x "$bin" ] || die "$bin is missing: run 'make demo' (or cargo build --release -p hybridcache)"
for tool in fio python3 truncate; do
    command -v "$tool" >/dev/null || die "$tool is missing: 'make deps' installs it"
done
fio --enghelp=nbd >/dev/null 2>&1 || die "this fio has no nbd engine (Debian's fio package has it): 'make deps'"

hc() { "$bin" "$@"; }

# Stop a daemon: stop cache 1 without flushing (its dirty data stays on the persistent cache
# device: cleaning ~100k scattered 4 KiB lines to the emulated RAID takes about a minute even
# with 32 writes in flight, too long for a demo),
# then SIGTERM, then SIGKILL if it has not gone after 15 s (safe too: the cache is crash-consistent).
stop_daemon() {
    local pid=$1
    kill -0 "$pid" 2>/dev/null || return 0
    timeout 20 "$bin" -T -n -i 1 >/dev/null 2>&1 || true
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 150); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then
        echo "demo: daemon $pid did not stop after SIGTERM; killing it" >&2
        kill -KILL "$pid" 2>/dev/null || true
    fi
    wait "$pid" 2>/dev/null || true
}

daemon_pid=""
on_exit() {
    local rc=$?
    if [ -n "$daemon_pid" ]; then stop_daemon "$daemon_pid"; fi
    rm -f "$pidfile"
    if [ "$rc" != 0 ]; then
        echo "demo: failed (exit $rc); the daemon's log is $data/daemon.log" >&2
    fi
}
trap on_exit EXIT
trap 'exit 130' INT TERM

# --- a clean slate ----------------------------------------------------------------------------
mkdir -p "$data"
if [ -f "$pidfile" ]; then
    old=$(cat "$pidfile")
    if [ -n "$old" ] && kill -0 "$old" 2>/dev/null && grep -q hybridcache "/proc/$old/cmdline" 2>/dev/null; then
        echo "stopping the daemon a previous demo left running (pid $old)"
        stop_daemon "$old"
    fi
    rm -f "$pidfile"
fi
rm -f "$ctl" "$nbdsock" "$data"/*.json
# The new cache forgets whatever the previous one held, so the core starts afresh as well.
rm -f "$data/core.img"
truncate -s "$cache_size" "$data/cache.img"

say "starting the daemon (log: demo-data/daemon.log)"
"$bin" daemon --control "$ctl" --nbd-socket "$nbdsock" --state-dir "$data" --nbd-workers 32 >"$data/daemon.log" 2>&1 &
daemon_pid=$!
echo "$daemon_pid" >"$pidfile"
for _ in $(seq 100); do [ -S "$ctl" ] && [ -S "$nbdsock" ] && break; sleep 0.1; done
[ -S "$ctl" ] || { cat "$data/daemon.log" >&2; die "the daemon did not create $ctl"; }
echo "hybridcache daemon --control demo-data/control.sock --nbd-socket demo-data/nbd.sock --state-dir demo-data --nbd-workers 32  (pid $daemon_pid)"

say "cache: demo-data/cache.img ($cache_size sparse file), core: emulated RAID 60"
echo "+ hybridcache -S -d demo-data/cache.img -i 1 -c wb --force"
hc -S -d "$data/cache.img" -i 1 -c wb --force
echo "+ hybridcache -A -i 1 -d '${core_spec/$root\//}'"
hc -A -i 1 -d "$core_spec"
hc -L

# --- the workload -----------------------------------------------------------------------------
# run_fio NAME RW IODEPTH OFFSET IO_SIZE: 4 KiB random I/O over [OFFSET, OFFSET+512G), at most
# IO_SIZE bytes and $runtime seconds. A fixed seed makes a randread with the same offset and size
# visit the very blocks a randwrite wrote, in the same order.
run_fio() {
    local name=$1 rw=$2 qd=$3 offset=$4 io_size=$5
    printf '  %-28s ' "$name"
    fio --output="$data/$name.json" --output-format=json --ioengine=nbd --uri="$uri" \
        --name="$name" --rw="$rw" --bs=4k --iodepth="$qd" --offset="$offset" --size=512g \
        --io_size="$io_size" --runtime="$runtime" --randseed=2026 >/dev/null \
        || die "fio $name failed: see demo-data/$name.json"
    python3 - "$data/$name.json" <<'EOF'
import json, sys
j = json.load(open(sys.argv[1]))["jobs"][0]
d = j["read"] if j["read"]["io_bytes"] else j["write"]
p99 = d["clat_ns"]["percentile"]["99.000000"] / 1e6
print(f"{d['iops']:9.0f} IOPS  p99 {p99:7.2f} ms  ({d['io_bytes'] >> 20} MiB in {d['runtime'] / 1000:.1f} s)")
EOF
}
written() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["jobs"][0]["write"]["io_bytes"])' "$1"; }

# The caps keep the write-back runs to 128 + 256 MiB, 37% of the cache at most: with no
# background cleaning yet, a write-back cache full of dirty data runs at the core's speed.
say "core alone: cache in pass-through (hybridcache -Q -c pt -i 1 -f yes), ${runtime} s per run"
hc -Q -c pt -i 1 -f yes
run_fio core-randwrite-qd1 randwrite 1 0 128m
run_fio core-randwrite-qd16 randwrite 16 512g 256m
run_fio core-reread-qd1 randread 1 0 "$(written "$data/core-randwrite-qd1.json")"

say "with the cache: write-back (hybridcache -Q -c wb -i 1), counters reset (-Z)"
hc -Q -c wb -i 1
hc -Z -i 1
run_fio cache-randwrite-qd1 randwrite 1 1024g 128m
run_fio cache-randwrite-qd16 randwrite 16 1536g 256m
run_fio cache-reread-qd1 randread 1 1024g "$(written "$data/cache-randwrite-qd1.json")"

# --- results ----------------------------------------------------------------------------------
say "speed-up: 4 KiB random I/O over NBD, emulated RAID 60 core (study60, 2 TiB)"
python3 - "$data" <<'EOF'
import json, sys
def stat(name):
    j = json.load(open(f"{sys.argv[1]}/{name}.json"))["jobs"][0]
    d = j["read"] if j["read"]["io_bytes"] else j["write"]
    return d["iops"], d["clat_ns"]["percentile"]["99.000000"] / 1e6
rows = [("randwrite 4k qd1", "randwrite-qd1"), ("randwrite 4k qd16", "randwrite-qd16"),
        ("randread 4k qd1 (re-read)", "reread-qd1")]
fmt = "{:<26} {:>12} {:>12} {:>9} {:>14} {:>14}"
print(fmt.format("", "core IOPS", "cache IOPS", "speed-up", "core p99 ms", "cache p99 ms"))
for label, key in rows:
    ci, cp = stat("core-" + key)
    hi, hp = stat("cache-" + key)
    print(fmt.format(label, f"{ci:.0f}", f"{hi:.0f}", f"{hi / ci:.0f}x", f"{cp:.2f}", f"{hp:.3f}"))
EOF
core_qd1=$(python3 -c 'import json,sys; print(round(json.load(open(sys.argv[1]))["jobs"][0]["write"]["iops"]))' \
    "$data/core-randwrite-qd1.json")
cat <<EOF

These are bursts that fit in the cache: the write-back runs wrote at most 384 MiB into $cache_size.
Once the cache is full of dirty data, writes go as fast as cleaning drains it to the core (about
$core_qd1 IOPS at 4 KiB random for the core alone here); cleaning sorts dirty lines by address and
keeps many writes in flight, so set an aggressive policy for write-heavy loads:
  hybridcache -X -n cleaning -i 1 -p acp-very-aggressive
'hybridcache bench run --protocol steady' measures that regime (docs/bench.md).
EOF

say "cache statistics, write-back phase only (hybridcache -P -i 1)"
hc -P -i 1

say "connecting clients (the daemon stops below; the first two commands bring it back)"
cat <<EOF
  export HYBRIDCACHE_CONTROL=$ctl
  # the daemon again, and this cache with its dirty data:
  $bin daemon --control $ctl --nbd-socket $nbdsock --state-dir $data --nbd-workers 32 &
  $bin -S -d $data/cache.img --load
  # fio
  fio --ioengine=nbd --uri='$uri' --name=t --rw=randwrite --bs=4k --iodepth=16 --size=1g \\
      --output=out.json --output-format=json
  # qemu-img / qemu-io
  qemu-img info '$uri'
  qemu-io -f raw -c 'write -P 0xab 0 64k' -c 'read -P 0xab 0 64k' '$uri'
  # a file system through nbdfuse and a loop device
  mkdir -p /tmp/hc-fuse /mnt/cached
  nbdfuse /tmp/hc-fuse/disk '$uri' &
  dev=\$(losetup -f --show --direct-io=on /tmp/hc-fuse/disk)
  mkfs.ext4 -q \$dev && mount \$dev /mnt/cached
  umount /mnt/cached && losetup -d \$dev && fusermount3 -u /tmp/hc-fuse
EOF

say "stopping: hybridcache -T -n -i 1 (dirty data stays on the cache device), then SIGTERM"
hc -T -n -i 1
kill -TERM "$daemon_pid"
wait "$daemon_pid" || die "the daemon exited with an error (see demo-data/daemon.log)"
daemon_pid=""
echo "stopped. demo-data/ keeps cache.img, core.img (sparse: 'du -h' shows what is used), the fio"
echo "JSON of every run and daemon.log."
