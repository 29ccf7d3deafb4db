#!/bin/bash
# `make test-guest`'s ublk tests, in three guest runs:
#  - scripts/guest/ublk-guest.sh: hybridcache-ublk's RAM disk example (crates/ublk/examples)
#    through the kernel's ublk driver (ext4, fio verify, e2fsck, requests in flight at once);
#  - scripts/guest/ublk-recovery-guest.sh: that server killed with SIGKILL under fio and taken
#    over by a new one: no I/O error;
#  - scripts/guest/ublk-daemon-guest.sh: the daemon inside the guest serving a cached volume as
#    /dev/ublkbN (`--frontend ublk`), killed with SIGKILL under fio and restarted with --load:
#    no I/O error, e2fsck clean; the in-use guard of -T; ublk against nbd IOPS.
# Fails when any guest run fails. RAMDISK names the example binary (default
# target/debug/examples/ramdisk), HYBRIDCACHE the daemon's (default target/debug/hybridcache).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BIN=${RAMDISK:-$ROOT/target/debug/examples/ramdisk}
HC=${HYBRIDCACHE:-$ROOT/target/debug/hybridcache}
[ -x "$BIN" ] || { echo "test-ublk: no $BIN (cargo build -p hybridcache-ublk --examples)" >&2; exit 2; }
[ -x "$HC" ] || { echo "test-ublk: no $HC (cargo build -p hybridcache)" >&2; exit 2; }
rc=0
set +e
for script in ${UBLK_GUEST_SCRIPTS:-ublk-guest.sh ublk-recovery-guest.sh ublk-daemon-guest.sh}; do
	start=$(date +%s)
	"$ROOT/scripts/guest/run.sh" -t "${GUEST_TIMEOUT:-300}" -a "$BIN:/usr/bin/ramdisk" \
		-a "$HC:/usr/bin/hybridcache" "$ROOT/scripts/guest/$script" |
		grep -E '(ublk-guest|ublk-recovery|ublk-daemon|guest|ramdisk): |OK$|expected|still exists|vanished|requests in the backend|error'
	status=${PIPESTATUS[0]}
	echo "test-ublk: $script: exit $status after $(($(date +%s) - start)) s"
	[ "$status" = 0 ] || rc=1
done
exit "$rc"
