#!/usr/bin/env bash
# scripts/ceph/ops.sh: operations under load on Ceph over hybridcache (docs/ceph.md).
#   1. kill -9 one OSD during a fio run with --verify=crc32c, restart it;
#   2. kill -9 the hybridcache daemon during a second such run, restart it (it loads its caches
#      from its configuration file and state directory, as `--load` does), re-attach the OSDs' devices, restart the
#      OSDs (they lost their block devices with the daemon: see docs/ceph.md).
# Each time: the cluster returns to HEALTH_OK, fio's verify passes, no fio error.
# Environment as for demo.sh; OPS_SIZE is the region each fio run writes and verifies (64M).
source "$(dirname "$0")/lib.sh"

SIZE=${OPS_SIZE:-64M}

# verify_run NAME OFFSET: writes SIZE at OFFSET with checksums, then reads it all back and checks.
verify_run() {
    rbd_fio "$1" img --rw=randwrite --bs=4k --iodepth=16 --size="$SIZE" --offset="$2" \
        --verify=crc32c --verify_fatal=1 --do_verify=1
}

fio_ok() {
    local name=$1
    /usr/bin/env python3 - "$CEPH_DIR/$name.json" <<'PY'
import json, sys
t = open(sys.argv[1]).read()
j = json.loads(t[t.index("{"):])["jobs"][0]
w, r = j["write"]["io_bytes"], j["read"]["io_bytes"]
print(f"  fio: error {j['error']}, wrote {w >> 20} MiB, verified {r >> 20} MiB")
sys.exit(0 if j["error"] == 0 and w > 0 and r >= w else 1)
PY
}

# A fio run in the background, a fault once it has done some writing, the repair, the verdict.
with_fault() {
    local name=$1 offset=$2 fault=$3 pid t0 t1
    verify_run "$name" "$offset" &
    pid=$!
    sleep 8
    kill -0 "$pid" 2>/dev/null || die "$name: fio finished before the fault; make OPS_SIZE larger"
    t0=$(date +%s.%N)
    "$fault"
    wait_health 300
    t1=$(date +%s.%N)
    awk -v a="$t0" -v b="$t1" 'BEGIN { printf "  HEALTH_OK %.1f s after the fault\n", b - a }'
    wait "$pid" || die "$name: fio failed (see $CEPH_DIR/$name.json)"
    fio_ok "$name" || die "$name: fio reported an error"
}

kill_osd() {
    say "kill -9 osd.1, restart it"
    kill -KILL "$(cat "$CEPH_DIR/run/osd.1.pid")"
    sleep 3
    start_osd 1
}

kill_daemon() {
    local i
    say "kill -9 the hybridcache daemon; restart it, re-attach the OSDs' devices, restart the OSDs"
    kill -KILL "$(cat "$CEPH_DIR/hc/daemon.pid")"
    sleep 2
    kill_pidfiles "$CEPH_DIR"/run/osd.*.pid
    detach_osd_devices
    start_hc_daemon
    hc -L
    for i in $(seq 0 $((OSDS - 1))); do attach_osd_device "$i" >/dev/null; done
    for i in $(seq 0 $((OSDS - 1))); do start_osd "$i"; done
}

ceph_init
say "cluster on hybridcache"
start_stack cached
rbd_create img 1G
with_fault osd-kill 0 kill_osd
with_fault daemon-kill 512M kill_daemon
say "both regions read back once more after the restarts"
for r in "osd-kill 0" "daemon-kill 512M"; do
    read -r name offset <<<"$r"
    rbd_fio "reread-$name" img --rw=randwrite --bs=4k --iodepth=16 --size="$SIZE" \
        --offset="$offset" --verify=crc32c --verify_fatal=1 --verify_only=1
done
say "ops: passed"
