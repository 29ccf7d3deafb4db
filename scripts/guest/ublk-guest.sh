# Runs inside the guest (scripts/guest/test-ublk.sh): hybridcache-ublk's RAM disk example served
# through the kernel's ublk driver as /dev/ublkbN.
# 1. a 256 MiB device with default settings (one queue per CPU, depth 128): its limits as the
#    kernel sees them, ext4 (mke2fs discards the device and zeroes the journal), files with
#    checksums, fio with crc32c verification, a few fio figures (for information), then the
#    checksums and fio's crc32c again after a remount, e2fsck -fn; SIGTERM deletes the device;
# 2. a device whose every request takes 2 ms, under fio at queue depth 32: the backend must
#    see many requests at once (a queue must not wait for one request before the next).
# Any failure ends the script with a non-zero status.
set -eu
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
step() { echo "ublk-guest: [$(cut -d' ' -f1 /proc/uptime) s] $*"; }
# start_ramdisk LOG ARGS...: sets $pid and $dev
start_ramdisk() {
	log=$1
	shift
	ramdisk "$@" >"$log" 2>&1 &
	pid=$!
	for _ in $(seq 300); do
		grep -q ' ready' "$log" && break
		kill -0 $pid 2>/dev/null || { cat "$log"; return 1; }
		sleep 0.1
	done
	dev=$(sed -n 's|^ramdisk: \(/dev/ublkb[0-9]*\) ready.*|\1|p' "$log")
	[ -b "$dev" ] || { echo "no block device"; cat "$log"; return 1; }
	step "$(cat "$log")"
}
stop_ramdisk() {
	kill -TERM $pid
	wait $pid
	cat "$1"
	[ ! -e "$dev" ] || { echo "$dev still exists after the server stopped"; return 1; }
}
expect() { # expect FILE VALUE
	got=$(cat "$1")
	[ "$got" = "$2" ] || { echo "$1: $got, expected $2"; return 1; }
}

start_ramdisk /tmp/rd.log 256
name=${dev#/dev/}
q=/sys/block/$name/queue
expect /sys/block/$name/size 524288
expect $q/logical_block_size 512
expect $q/physical_block_size 4096
expect $q/discard_granularity 4096
expect $q/write_cache "write back"
expect $q/fua 1
step "queues: $(ls /sys/block/$name/mq | wc -l), depth $(cat $q/nr_requests)"

/usr/sbin/mke2fs -q -t ext4 -F "$dev"
mkdir -p /mnt/vol
mount -t ext4 "$dev" /mnt/vol
step "mkfs.ext4 and mount done"
i=0
for kib in 4 60 512 3000 16384; do
	i=$((i + 1))
	dd if=/dev/urandom of=/mnt/vol/file$i bs=1024 count=$kib 2>/dev/null
done
(cd /mnt/vol && sha256sum file*) >/tmp/sums
verify_job() {
	fio --name=verify --filename=/mnt/vol/fio.dat --size=48M --rw=randwrite --bsrange=4k-64k \
		--ioengine=libaio --direct=1 --iodepth=16 --verify=crc32c --verify_fatal=1 \
		--eta=never "$@"
}
verify_job --do_verify=1 --output=/tmp/fio-verify.txt
grep -q " err= 0" /tmp/fio-verify.txt
step "files and fio verify done"
for spec in randwrite:1 randwrite:32 randread:1 randread:32; do
	rw=${spec%:*} qd=${spec#*:}
	fio --name="$rw-qd$qd" --filename=/mnt/vol/perf.dat --size=32M --rw="$rw" --bs=4k \
		--ioengine=libaio --direct=1 --iodepth="$qd" --time_based --runtime=3 \
		--eta=never --output=/tmp/fio-perf.txt
	step "figure: $rw 4k qd$qd $(grep -o 'IOPS=[^,]*' /tmp/fio-perf.txt | head -1)"
done
umount /mnt/vol
mount -t ext4 "$dev" /mnt/vol
(cd /mnt/vol && sha256sum -c /tmp/sums)
verify_job --verify_only=1 --output=/tmp/fio-reverify.txt
grep -q " err= 0" /tmp/fio-reverify.txt
umount /mnt/vol
/usr/sbin/e2fsck -fn "$dev"
step "checksums, fio's crc32c after a remount, e2fsck -fn clean"
stop_ramdisk /tmp/rd.log
step "device deleted"

start_ramdisk /tmp/slow.log 64 --queues 1 --delay-us 2000
fio --name=deep --filename="$dev" --rw=randread --bs=4k --ioengine=libaio --direct=1 \
	--iodepth=32 --time_based --runtime=2 --eta=never --output=/tmp/fio-deep.txt
step "2 ms per request, iodepth 32: $(grep -o 'IOPS=[^,]*' /tmp/fio-deep.txt | head -1)"
stop_ramdisk /tmp/slow.log
most=$(sed -n 's/.*at most \([0-9]*\) in flight.*/\1/p' /tmp/slow.log)
[ "${most:-0}" -ge 8 ] || { echo "only ${most:-0} requests in the backend at once"; exit 1; }
step "all done"
