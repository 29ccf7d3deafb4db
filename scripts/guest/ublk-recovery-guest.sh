# Runs inside the guest (scripts/guest/test-ublk.sh): UBLK_F_USER_RECOVERY with hybridcache-ublk.
# The RAM disk example serves a file (so the data outlives the server) with --recovery; ext4 on
# it; fio writes with crc32c verification; the server is killed with SIGKILL in the middle of
# fio's run and a new one takes the device over with --recover. fio and the mount must carry on
# with no I/O error, fio's verification and e2fsck -fn must pass.
set -eu
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
step() { echo "ublk-recovery: [$(cut -d' ' -f1 /proc/uptime) s] $*"; }
wait_ready() {
	for _ in $(seq 300); do
		grep -q ' ready' "$1" && return 0
		kill -0 $2 2>/dev/null || break
		sleep 0.1
	done
	cat "$1"
	return 1
}
ramdisk 256 --file /tmp/disk.img --recovery >/tmp/rd1.log 2>&1 &
pid=$!
wait_ready /tmp/rd1.log $pid
dev=$(sed -n 's|^ramdisk: \(/dev/ublkb[0-9]*\) ready.*|\1|p' /tmp/rd1.log)
id=${dev#/dev/ublkb}
step "$(cat /tmp/rd1.log)"
/usr/sbin/mke2fs -q -t ext4 -F "$dev"
mkdir -p /mnt/vol
mount -t ext4 "$dev" /mnt/vol
dd if=/dev/urandom of=/mnt/vol/before bs=4096 count=1000 2>/dev/null
(cd /mnt/vol && sha256sum before) >/tmp/sums
fio --name=verify --filename=/mnt/vol/fio.dat --size=96M --rw=randwrite --bsrange=4k-64k \
	--ioengine=libaio --direct=1 --iodepth=16 --verify=crc32c --verify_fatal=1 \
	--do_verify=1 --eta=never --output=/tmp/fio.txt &
fio=$!
# Kill once fio is writing (its file laid out), not after a fixed time: under TCG on a
# fast host 32 MiB took less than the 4 s this used to sleep.
for _ in $(seq 100); do
	[ "$(stat -c %s /mnt/vol/fio.dat 2>/dev/null || echo 0)" -ge $((96 << 20)) ] && break
	sleep 0.1
done
sleep 1
kill -0 $fio 2>/dev/null || { echo "fio ended before the kill: $(cat /tmp/fio.txt)"; exit 1; }
kill -9 $pid
t0=$(cut -d' ' -f1 /proc/uptime)
step "server killed with SIGKILL in fio's run"
wait $pid 2>/dev/null || true
[ -b "$dev" ] || { echo "$dev vanished with its server"; exit 1; }
ramdisk 256 --file /tmp/disk.img --recover "$id" >/tmp/rd2.log 2>&1 &
pid=$!
wait_ready /tmp/rd2.log $pid
step "recovered $(cut -d' ' -f1 /proc/uptime | awk -v t0=$t0 '{printf "%.2f", $1 - t0}') s after the kill: $(cat /tmp/rd2.log)"
wait $fio || { cat /tmp/fio.txt; echo "fio failed"; exit 1; }
grep -q " err= 0" /tmp/fio.txt
step "fio finished, its verification passed"
(cd /mnt/vol && sha256sum -c /tmp/sums)
umount /mnt/vol
/usr/sbin/e2fsck -fn "$dev"
errors=$(dmesg | grep -c -i -E "i/o error|error, dev ublkb|buffer i/o" || true)
step "I/O errors in the kernel log: $errors"
dmesg | grep -i -E "i/o error|error, dev ublkb|buffer i/o" || true
kill -TERM $pid
wait $pid || true
cat /tmp/rd2.log
[ "$errors" = 0 ]
[ ! -e "$dev" ] || { echo "$dev still exists after the server stopped"; exit 1; }
step "all done"
