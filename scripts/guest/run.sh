#!/bin/bash
# Boots a qemu guest (TCG) whose /init runs one test script, and exits with that script's status.
#
#   run.sh [options] SCRIPT [ARGS...]
#     -a FILE[:GUEST_PATH]  put FILE into the guest (with its shared libraries); repeatable
#     -f ADDR:PORT          forward to the host's ADDR:PORT from two guest addresses:
#                           10.0.2.100:10809 through qemu's chardev (one connection at a time,
#                           the fast one) and 10.0.2.101:10809 through socat (one host connection
#                           per guest connection, for nbd-client -C N; see docs/guest.md)
#     -t SECONDS            hard timeout for the whole run (default 240)
#     -m MIB                guest memory (default 1024)
#     -s CPUS               guest CPUs (default 2)
#     -l FILE               keep the console log in FILE (default: a temporary file, printed on failure)
#     -q                    do not copy the console to stdout while it runs
#
# The guest sees SCRIPT as /test/run.sh, run with ARGS, in /test. Exit status: the script's, or
# 124 on timeout, or 125 when the guest stopped without a verdict (crash, panic). Everything the
# run made (qemu, temporary files) is gone when this returns, whatever happened.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
HERE=$ROOT/scripts/guest
G=${GUEST_DIR:-$ROOT/target/guest}
# shellcheck source=lib.sh
. "$HERE/lib.sh"

timeout=240 mem=1024 cpus=2 fwd= keep_log= quiet= adds=()
while getopts "a:f:t:m:s:l:q" opt; do
	case $opt in
	a) adds+=("$OPTARG") ;;
	f) fwd=$OPTARG ;;
	t) timeout=$OPTARG ;;
	m) mem=$OPTARG ;;
	s) cpus=$OPTARG ;;
	l) keep_log=$OPTARG ;;
	q) quiet=1 ;;
	*) sed -n '2,18s/^# \{0,1\}//p' "$0" >&2; exit 2 ;;
	esac
done
shift $((OPTIND - 1))
[ $# -ge 1 ] || { echo "usage: run.sh [options] SCRIPT [ARGS...]" >&2; exit 2; }
script=$1
shift

"$HERE/prepare.sh"

mkdir -p "$G/tmp"
work=$(mktemp -d "$G/tmp/run.XXXXXX")
qpid= tpid=
cleanup() {
	[ -n "$tpid" ] && kill "$tpid" 2>/dev/null || true
	if [ -n "$qpid" ] && kill -0 "$qpid" 2>/dev/null; then
		kill -TERM "$qpid" 2>/dev/null || true
		sleep 0.5
		kill -KILL "$qpid" 2>/dev/null || true
	fi
	[ -n "$qpid" ] && wait "$qpid" 2>/dev/null || true
	rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# The per-run part of the initramfs, appended to the cached base (the kernel unpacks both).
stage=$work/stage
mkdir -p "$stage/test"
cp "$script" "$stage/test/run.sh"
printf '%s ' "$@" >"$stage/test/args"
for a in "${adds[@]}"; do
	src=${a%%:*} dst=${a#*:}
	[ "$dst" = "$a" ] && dst=$src
	stage_binary "$stage" "$src" "$dst"
done
make_cpio "$stage" "$work/test.cpio"
cat "$G/base.cpio" "$work/test.cpio" >"$work/initrd"

token=$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \n')
log=${keep_log:-$work/console.log}
: >"$log"

net=(-nic none)
if [ -n "$fwd" ]; then
	# restrict=on: the guest reaches nothing but the forwards. TCP_NODELAY on the host side of
	# the chardev forward matters (about 4x IOPS). The socat forward is slower for small writes
	# whatever socat does: libslirp talks to the command over a loopback TCP pair of its own
	# without TCP_NODELAY, so a request split into several segments waits for delayed ACKs.
	net=(-netdev "user,id=n0,restrict=on,guestfwd=tcp:10.0.2.100:10809-tcp:$fwd,,nodelay=on,guestfwd=tcp:10.0.2.101:10809-cmd:socat STDIO TCP:$fwd,,nodelay"
		-device virtio-net-pci,netdev=n0,romfile=)
fi

cpu=max
major=$(qemu-system-x86_64 --version | sed -n 's/^QEMU emulator version \([0-9]*\)\..*/\1/p')
# qemu 7.2's TCG cmpxchg16b crashes this kernel (SLUB corruption); later versions are fine.
[ "${major:-0}" -lt 8 ] && cpu=max,cx16=off

start=$(date +%s.%N)
qemu-system-x86_64 -accel tcg -cpu "$cpu" -smp "$cpus" -m "$mem" -nodefaults -no-user-config \
	-display none -monitor none -serial "file:$log" -no-reboot \
	-kernel "$G/kernel/vmlinuz" -initrd "$work/initrd" \
	-append "console=ttyS0 quiet panic=-1 oops=panic hc.token=$token" \
	"${net[@]}" </dev/null >"$work/qemu.out" 2>&1 &
qpid=$!
if [ -z "$quiet" ]; then
	tail -n +1 -F --pid="$qpid" "$log" 2>/dev/null &
	tpid=$!
fi

rc=
deadline=$(($(date +%s) + timeout))
while kill -0 "$qpid" 2>/dev/null; do
	now=$(date +%s)
	if [ "$now" -ge "$deadline" ]; then
		echo "guest: timeout after ${timeout} s" >&2
		rc=124
		break
	fi
	# Once the verdict is out, the guest gets a little time to power off, no more.
	if grep -q "GUEST-VERDICT-$token: " "$log" && [ "$deadline" -gt $((now + 15)) ]; then
		deadline=$((now + 15))
	fi
	sleep 0.2
done
[ -n "$tpid" ] && { sleep 0.3; kill "$tpid" 2>/dev/null || true; tpid=; }
elapsed=$(echo "$(date +%s.%N) $start" | awk '{printf "%.1f", $1 - $2}')

if [ -z "$rc" ]; then
	verdict=$(sed -n "s/.*GUEST-VERDICT-$token: \([0-9]*\).*/\1/p" "$log" | tail -1)
	if [ -n "$verdict" ]; then
		rc=$verdict
	else
		echo "guest: stopped without a verdict (crash or panic?)" >&2
		cat "$work/qemu.out" >&2
		rc=125
	fi
fi
if [ "$rc" != 0 ] && [ -n "$quiet" ]; then
	echo "---- guest console ----" >&2
	cat "$log" >&2
fi
echo "guest: $(basename "$script") exited $rc after $elapsed s (qemu included)" >&2
exit "$rc"
