# Runs inside the guest (scripts/guest/test-nbd.sh): the Linux nbd driver against the host
# daemon's TCP export cas1-1, through qemu's guestfwd (scripts/guest/run.sh -f):
# 10.0.2.100:10809 carries one connection (the fast path), 10.0.2.101:10809 any number.
#   nbd-guest.sh CONNECTIONS
# 1. one connection: ext4 on /dev/nbd0, files with checksums, fio with crc32c verification, and
#    a few fio figures (for information);
# 2. CONNECTIONS connections (nbd-client -C, the export advertises CAN_MULTI_CONN): the checksums
#    and fio's crc32c again (the data now comes from the daemon, not the guest's page cache), one
#    more file written across the connections, e2fsck -fn;
# 3. one connection again: that file's checksum, and e2fsck -fn once more.
# Any failure ends the script with a non-zero status.
set -eu
conns=${1:-1}
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
step() { echo "nbd-guest: [$(cut -d' ' -f1 /proc/uptime) s] $*"; }
# connect ADDRESS CONNECTIONS
connect() {
	nbd-client "$1" 10809 /dev/nbd0 -N cas1-1 -C "$2" -b 4096
	size=$(blockdev --getsize64 /dev/nbd0)
	[ "$size" -gt 0 ]
	step "connected to $1 with $2 connection(s): $size bytes"
}
verify_job() {
	fio --name=verify --filename=/mnt/vol/fio.dat --size=48M --rw=randwrite --bsrange=4k-64k \
		--ioengine=libaio --direct=1 --iodepth=16 --verify=crc32c --verify_fatal=1 \
		--eta=never "$@"
}

# The chardev forward connects to the daemon when qemu starts, and the daemon drops a
# connection whose handshake has not finished within its handshake timeout (10 s by default;
# test-nbd.sh starts it with --nbd-handshake-timeout 30 for this): on a slow boot nbd-client
# would then wait for ever for the greeting. It gets 15 s; after that the socat forward serves this
# connection too (the host's clock, not the guest's uptime, decides, so no heuristic is used).
if ! timeout 15 nbd-client 10.0.2.100 10809 /dev/nbd0 -N cas1-1 -C 1 -b 4096; then
	step "the chardev forward's connection is gone (slow boot?): using the socat forward"
	nbd-client -d /dev/nbd0 2>/dev/null || true
	nbd-client 10.0.2.101 10809 /dev/nbd0 -N cas1-1 -C 1 -b 4096
fi
step "connected: $(blockdev --getsize64 /dev/nbd0) bytes"
/usr/sbin/mke2fs -q -t ext4 -F /dev/nbd0
mkdir -p /mnt/vol
mount -t ext4 /dev/nbd0 /mnt/vol
step "mkfs.ext4 and mount done"

# Files of several sizes; checksums kept in the guest's tmpfs, away from the volume.
i=0
for kib in 4 60 512 3000 16384; do
	i=$((i + 1))
	dd if=/dev/urandom of=/mnt/vol/file$i bs=1024 count=$kib 2>/dev/null
done
mkdir -p /mnt/vol/dir
dd if=/dev/urandom of=/mnt/vol/dir/nested bs=4096 count=257 2>/dev/null
(cd /mnt/vol && sha256sum file* dir/nested) >/tmp/sums
step "files written"

# Every block fio writes carries a crc32c and its offset; they are read back after the write
# phase, and --verify_fatal stops at the first bad one.
verify_job --do_verify=1 --output=/tmp/fio-verify.txt
grep -E "IOPS=" /tmp/fio-verify.txt
grep -q " err= 0" /tmp/fio-verify.txt
step "fio verify done"

# For information only (emulated CPU: compare ratios, not numbers). A file of its own, so that
# fio.dat keeps its verification headers.
for spec in randwrite:1 randwrite:32 randread:1 randread:32; do
	rw=${spec%:*} qd=${spec#*:}
	fio --name="$rw-qd$qd" --filename=/mnt/vol/perf.dat --size=32M --rw="$rw" --bs=4k \
		--ioengine=libaio --direct=1 --iodepth="$qd" --time_based --runtime=3 \
		--eta=never --output=/tmp/fio-perf.txt
	step "figure: $rw 4k qd$qd $(grep -o 'IOPS=[^,]*' /tmp/fio-perf.txt | head -1)"
done
umount /mnt/vol
nbd-client -d /dev/nbd0
step "disconnected"

connect 10.0.2.101 "$conns"
mount -t ext4 /dev/nbd0 /mnt/vol
(cd /mnt/vol && sha256sum -c /tmp/sums)
verify_job --verify_only=1 --output=/tmp/fio-reverify.txt
grep -q " err= 0" /tmp/fio-reverify.txt
step "checksums and fio's crc32c right over $conns connections"
dd if=/dev/urandom of=/mnt/vol/multi bs=4096 count=1000 2>/dev/null
(cd /mnt/vol && sha256sum multi) >/tmp/sums2
umount /mnt/vol
/usr/sbin/e2fsck -fn /dev/nbd0
nbd-client -d /dev/nbd0
step "e2fsck -fn clean"

connect 10.0.2.101 1
mount -t ext4 -o ro /dev/nbd0 /mnt/vol
(cd /mnt/vol && sha256sum -c /tmp/sums2 && sha256sum -c /tmp/sums)
umount /mnt/vol
/usr/sbin/e2fsck -fn /dev/nbd0
nbd-client -d /dev/nbd0
step "all done"
