#!/usr/bin/env bash
# make test-ceph: the short functional check of Ceph on hybridcache. A cluster (1 mon, 1 mgr, 3
# BlueStore OSDs) on three hybridcache caches set up with the study's recipe, an RBD image in a
# pool of size 2, fio's rbd engine writing with crc32c checksums and reading everything back,
# one OSD killed with kill -9 and restarted during the writes, HEALTH_OK again, then down.
# Everything it starts is stopped and removed on every exit path (lib.sh's cleanup).
source "$(dirname "$0")/lib.sh"

t_start=$(date +%s)
ceph_init
say "cluster on hybridcache"
start_stack cached
rbd_create img 256M
say "fio (rbd engine) writes 32 MiB with crc32c checksums while osd.1 is killed and restarted"
rbd_fio verify img --rw=randwrite --bs=4k --iodepth=16 --size=32M --verify=crc32c \
    --verify_fatal=1 --do_verify=1 &
fio_pid=$!
sleep 4
kill -KILL "$(cat "$CEPH_DIR/run/osd.1.pid")"
sleep 2
start_osd 1
wait "$fio_pid" || die "fio failed: $(cat "$CEPH_DIR/verify.json" 2>/dev/null | tail -5)"
/usr/bin/env python3 - "$CEPH_DIR/verify.json" <<'PY' || die "fio reported an error"
import json, sys
t = open(sys.argv[1]).read()
j = json.loads(t[t.index("{"):])["jobs"][0]
w, r = j["write"]["io_bytes"], j["read"]["io_bytes"]
print(f"fio: error {j['error']}, wrote {w >> 20} MiB, verified {r >> 20} MiB")
sys.exit(0 if j["error"] == 0 and w >= 32 << 20 and r >= w else 1)
PY
wait_health 180
for i in $(seq 1 "$OSDS"); do
    hc -P -i "$i" -o json | /usr/bin/env python3 -c '
import json, sys
r = json.load(sys.stdin)["raw"]
errors = sum(r[k] for k in ("cache_read_errors", "cache_write_errors", "core_read_errors",
                            "core_write_errors"))
print("cache %s: %d lines, %d dirty, %d device errors"
      % (sys.argv[1], r["occupancy_lines"], r["dirty_lines"], errors))
sys.exit(1 if errors else 0)' "$i" || die "cache $i saw device errors"
done
say "test-ceph: passed in $(($(date +%s) - t_start)) s"
