#!/bin/bash
# `make test-guest`'s ublk test: hybridcache-ublk's RAM disk example (crates/ublk/examples)
# served through the kernel's ublk driver in a qemu guest; the guest side is
# scripts/guest/ublk-guest.sh. Exits with the guest's verdict.
# RAMDISK names the example binary (default target/debug/examples/ramdisk).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BIN=${RAMDISK:-$ROOT/target/debug/examples/ramdisk}
[ -x "$BIN" ] || { echo "test-ublk: no $BIN (cargo build -p hybridcache-ublk --examples)" >&2; exit 2; }
rc=0
"$ROOT/scripts/guest/run.sh" -t 170 -a "$BIN:/usr/bin/ramdisk" "$ROOT/scripts/guest/ublk-guest.sh" |
	grep -E '(ublk-guest|guest|ramdisk): |OK$|expected|still exists|requests in the backend' || rc=$?
exit "${PIPESTATUS[0]}"
