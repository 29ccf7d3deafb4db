#!/bin/bash
# `make test-guest`'s nbd test: the Linux kernel's nbd driver, in a qemu guest, against the host
# daemon's TCP export (docs/guest.md). The host runs `hybridcache daemon --nbd-listen
# 127.0.0.1:0` with a write-back cache and one core (cas1-1) on sparse files; the guest runs
# scripts/guest/nbd-guest.sh. Exits with the guest's verdict; a daemon that died or logged a
# panic fails the test too.
#   test-nbd.sh [CONNECTIONS]    (default 4: nbd-client -C 4, one TCP connection each)
# HYBRIDCACHE names the binary (default target/debug/hybridcache); GUEST_SCRIPT replaces the guest
# script (for experiments).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
G=${GUEST_DIR:-$ROOT/target/guest}
BIN=${HYBRIDCACHE:-$ROOT/target/debug/hybridcache}
conns=${1:-4}
[ -x "$BIN" ] || { echo "test-nbd: no $BIN (cargo build -p hybridcache)" >&2; exit 2; }

mkdir -p "$G/tmp"
work=$(mktemp -d "$G/tmp/nbd.XXXXXX")
dpid=
cleanup() {
	if [ -n "$dpid" ] && kill -0 "$dpid" 2>/dev/null; then
		kill -TERM "$dpid" 2>/dev/null || true
		for _ in $(seq 100); do kill -0 "$dpid" 2>/dev/null || break; sleep 0.1; done
		kill -KILL "$dpid" 2>/dev/null || true
	fi
	[ -n "$dpid" ] && wait "$dpid" 2>/dev/null || true
	rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

truncate -s 256M "$work/cache.img"
truncate -s 2G "$work/core.img"
hc() { "$BIN" "$@" --control "$work/control.sock"; }

: >"$work/daemon.log"
# qemu's chardev forward connects when qemu starts, but the guest's nbd-client sends its first
# byte only after the boot (up to 16 s on a busy machine) and then waits up to 15 s more
# (nbd-guest.sh): the default 10 s handshake timeout would drop that connection first.
"$BIN" daemon --control "$work/control.sock" --nbd-socket "$work/nbd.sock" \
	--nbd-listen 127.0.0.1:0 --nbd-handshake-timeout 30 </dev/null >/dev/null 2>"$work/daemon.log" &
dpid=$!
port=
for _ in $(seq 200); do
	port=$(sed -n 's/.* ready: .* and tcp 127\.0\.0\.1:\([0-9]*\).*/\1/p' "$work/daemon.log")
	[ -n "$port" ] && break
	kill -0 "$dpid" 2>/dev/null || break
	sleep 0.1
done
[ -n "$port" ] || { echo "test-nbd: daemon not ready" >&2; cat "$work/daemon.log" >&2; exit 1; }

hc -S -d "$work/cache.img" -i 1 -c wb >/dev/null
hc -A -i 1 -d "$work/core.img" >/dev/null
echo "test-nbd: daemon on 127.0.0.1:$port, cache 1 (wb, 256 MiB), core cas1-1 (2 GiB)" >&2

set +e
"$ROOT/scripts/guest/run.sh" -t "${GUEST_TIMEOUT:-300}" -f "127.0.0.1:$port" \
	"${GUEST_SCRIPT:-$ROOT/scripts/guest/nbd-guest.sh}" "$conns" | grep -E '(nbd-guest|guest): '
rc=${PIPESTATUS[0]}
set -e

if ! kill -0 "$dpid" 2>/dev/null; then
	echo "test-nbd: the daemon died during the run" >&2
	rc=1
fi
if grep -q "panicked" "$work/daemon.log"; then
	echo "test-nbd: the daemon panicked" >&2
	rc=1
fi
# What the cache saw, for the log.
hc -P -i 1 -o csv 2>/dev/null | awk -F, '
	NR == 1 { for (i = 1; i <= NF; i++) col[$i] = i; next }
	NR == 2 { printf "test-nbd: cache 1 saw %s blocks written and %s read by clients; %s dirty\n",
		$col["Writes to exported object(s) [4KiB Blocks]"],
		$col["Reads from exported object(s) [4KiB Blocks]"], $col["Dirty [4KiB Blocks]"] }' >&2 || true
if [ "$rc" != 0 ]; then
	echo "---- daemon log ----" >&2
	cat "$work/daemon.log" >&2
fi
exit "$rc"
