#!/bin/bash
# `make test-guest`'s ublk tests: hybridcache-ublk's RAM disk example (crates/ublk/examples)
# served through the kernel's ublk driver in a qemu guest, in two guest runs:
# scripts/guest/ublk-guest.sh (ext4, fio verify, e2fsck, requests in flight at once) and
# scripts/guest/ublk-recovery-guest.sh (the server killed with SIGKILL under fio and taken over
# by a new one: no I/O error). Fails when either guest run fails.
# RAMDISK names the example binary (default target/debug/examples/ramdisk).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BIN=${RAMDISK:-$ROOT/target/debug/examples/ramdisk}
[ -x "$BIN" ] || { echo "test-ublk: no $BIN (cargo build -p hybridcache-ublk --examples)" >&2; exit 2; }
rc=0
set +e
for script in ublk-guest.sh ublk-recovery-guest.sh; do
	"$ROOT/scripts/guest/run.sh" -t "${GUEST_TIMEOUT:-300}" -a "$BIN:/usr/bin/ramdisk" \
		"$ROOT/scripts/guest/$script" |
		grep -E '(ublk-guest|ublk-recovery|guest|ramdisk): |OK$|expected|still exists|vanished|requests in the backend|error'
	[ "${PIPESTATUS[0]}" = 0 ] || rc=1
done
exit "$rc"
