# Runs inside the guest (scripts/guest/test-ublk.sh): the daemon serving a cached volume as
# /dev/ublkbN (`--frontend ublk`), and its recovery after kill -9.
#  1. cache (write-back) and cores on files in tmpfs; ext4 on the ublk device; files with sha256
#     sums; `-L` must show /dev/ublkbN; `-T` must be refused while the file system is mounted.
#  2. fio writes 96 MiB with crc32c verification; once it is writing, the daemon is killed with SIGKILL; its
#     runtime directory (the sockets) is removed as systemd removes it, the state directory kept; a new
#     daemon loads the cache (`-S --load`) and resumes the same device. fio and the mount must
#     carry on with zero I/O errors (fio's error count, and the kernel log's I/O error lines).
#  3. for information: ublk against nbd, both served by this daemon from the same cache, fio
#     4 KiB random read and write on the raw devices (3 s each), printed as ratios.
#  4. umount, e2fsck -fn clean, checksums right after a remount; `-T` accepted once unmounted,
#     and the ublk devices are gone with it.
#  5. the same through the configuration file: a daemon killed with SIGKILL, its runtime directory
#     removed, and started again with --config resumes the device; a clean stop-daemon deletes it.
#  6. a cache that cannot be loaded after a kill -9: its stale device is deleted, the reason
#     logged.
set -eu
export PATH=/usr/sbin:/usr/bin:/sbin:/bin HYBRIDCACHE_CONTROL=/run/hc/control.sock
# As the unit's StateDirectory= does: the daemon's state directory, given as systemd gives it.
export STATE_DIRECTORY=/var/lib/hc
step() { echo "ublk-daemon: [$(cut -d' ' -f1 /proc/uptime) s] $*"; }
now() { cut -d' ' -f1 /proc/uptime; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.2f", b - a }'; }
fail() { echo "ublk-daemon: FAILED: $*"; echo "--- daemon log"; cat /tmp/daemon.log; exit 1; }
dpid=
start_daemon() {
	hybridcache daemon --control /run/hc/control.sock --nbd-socket /run/hc/nbd.sock \
		--frontend ublk "$@" >>/tmp/daemon.log 2>&1 &
	dpid=$!
	for _ in $(seq 300); do
		hybridcache -L >/dev/null 2>&1 && return 0
		kill -0 $dpid 2>/dev/null || break
		sleep 0.1
	done
	fail "the daemon did not come up"
}
# As systemd does to RuntimeDirectory= when the service stops (a restart after a crash
# included): the sockets' directory goes, the state directory (/var/lib/hc) stays.
remove_runtime_dir() {
	rm -rf /run/hc
	mkdir -p /run/hc
}
io_errors() { dmesg | grep -c -i -E "i/o error|error, dev (ublkb|nbd)|buffer i/o" || true; }

mkdir -p /run/hc /mnt/vol
truncate -s 128M /tmp/cache.img
truncate -s 512M /tmp/core1.img
truncate -s 128M /tmp/core2.img
truncate -s 128M /tmp/core3.img
start_daemon
hybridcache -S -d /tmp/cache.img -i 1 -c wb
hybridcache -A -i 1 -d /tmp/core1.img
hybridcache -A -i 1 -d /tmp/core2.img
hybridcache -A -i 1 -d /tmp/core3.img --frontend nbd
hybridcache -L
dev=$(hybridcache -L -o csv | awk -F, '$1 == "core" && $2 == 1 { print $6 }')
raw=$(hybridcache -L -o csv | awk -F, '$1 == "core" && $2 == 2 { print $6 }')
case $dev in /dev/ublkb*) ;; *) fail "-L shows '$dev' for core 1, not /dev/ublkbN" ;; esac
[ -b "$dev" ] || fail "$dev is not a block device"
# One queue per CPU by default, each with the driver's tags for 128 requests in flight.
queues() { ls "/sys/block/${1#/dev/}/mq" | wc -l; }
tags() { cat "/sys/block/${1#/dev/}/mq/0/nr_tags"; }
[ "$(queues "$dev")" = "$(grep -c ^processor /proc/cpuinfo)" ] || fail "$dev has $(queues "$dev") queues, not one per CPU ($(grep -c ^processor /proc/cpuinfo))"
[ "$(tags "$dev")" = 128 ] || fail "$dev's queues take $(tags "$dev") requests, not 128"
hybridcache -L -o csv | grep -q "core,3,/tmp/core3.img,Active,-,cas1-3," || fail "-L: core 3 is not cas1-3"
step "core 1 is $dev, core 2 is $raw, core 3 is cas1-3 over NBD"

/usr/sbin/mke2fs -q -t ext4 -F "$dev"
mount -t ext4 "$dev" /mnt/vol
for i in 1 2 3 4; do
	dd if=/dev/urandom of=/mnt/vol/file$i bs=64k count=$((i * 16)) 2>/dev/null
done
(cd /mnt/vol && sha256sum file*) >/tmp/sums
sync
hybridcache -L -o csv | grep -q "^core,1,/tmp/core1.img,Active,-,$dev,1\$" ||
	fail "-L does not count the mount as a client: $(hybridcache -L -o csv)"
hybridcache -L -o csv | grep -q "^core,2,/tmp/core2.img,Active,-,$raw,0\$" ||
	fail "-L counts a client on $raw: $(hybridcache -L -o csv)"
if hybridcache -T -i 1 2>/tmp/refused; then fail "-T stopped the cache under a mounted file system"; fi
grep -q "cas1-1 ($dev) has 1 client connected: disconnect them first, or give --disconnect-clients" /tmp/refused ||
	fail "-T was refused for another reason: $(cat /tmp/refused)"
if hybridcache -R -i 1 -j 1 2>/tmp/refused-r; then fail "-R removed a core under a mounted file system"; fi
grep -q "cas1-1 ($dev) has 1 client connected: disconnect them first, or give --disconnect-clients" /tmp/refused-r ||
	fail "-R was refused for another reason: $(cat /tmp/refused-r)"
step "-T and -R refused while mounted: $(cat /tmp/refused)"

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
kill -0 $fio 2>/dev/null || fail "fio ended before the kill: $(cat /tmp/fio.txt)"
kill -9 $dpid
t0=$(now)
wait $dpid 2>/dev/null || true
step "daemon killed with SIGKILL in fio's run"
[ -b "$dev" ] || fail "$dev vanished with the daemon"
remove_runtime_dir
step "runtime directory /run/hc removed, state directory kept"
start_daemon
hybridcache -S -d /tmp/cache.img --load
recovery=$(since "$t0")
step "recovered: cache loaded and $dev resumed $recovery s after the kill"
grep -q "resumed $dev" /tmp/daemon.log || fail "the daemon did not say it resumed $dev"
[ "$(hybridcache -L -o csv | awk -F, '$1 == "core" && $2 == 1 { print $6 }')" = "$dev" ] ||
	fail "core 1 is not on $dev after the restart"
wait $fio || { cat /tmp/fio.txt; fail "fio failed"; }
grep -q " err= 0" /tmp/fio.txt || { cat /tmp/fio.txt; fail "fio counted errors"; }
step "fio finished with err=0, its verification passed"
(cd /mnt/vol && sha256sum -c /tmp/sums) >/dev/null || fail "checksums differ"

iops() {
	rm -f /tmp/t.txt
	fio --name=x --filename="$1" --rw="$2" --bs=4k --ioengine=libaio --direct=1 --iodepth=16 \
		--size=64M --time_based --runtime=3 --eta=never --output-format=terse --output=/tmp/t.txt >/dev/null
	# terse v3: field 8 is read IOPS, field 49 write IOPS.
	awk -F';' -v rw="$2" '{ print (rw == "randread" ? $8 : $49) }' /tmp/t.txt 2>/dev/null
}
nbd-client -u -N cas1-3 -b 4096 /run/hc/nbd.sock /dev/nbd0 >/tmp/nbd.txt 2>&1 || fail "nbd-client: $(cat /tmp/nbd.txt)"
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", (b > 0 ? a / b : 0) }'; }
for rw in randwrite randread; do
	# The device under the cache: a file on the cache file's own file system (tmpfs here).
	r=$(iops /tmp/raw.dat $rw || echo 0)
	u=$(iops "$raw" $rw)
	n=$(iops /dev/nbd0 $rw)
	step "IOPS $rw 4k iodepth 16: raw file $r, ublk $u, nbd $n, ublk/nbd $(ratio "$u" "$n"), ublk/raw $(ratio "$u" "$r")"
done
rm -f /tmp/raw.dat
nbd-client -d /dev/nbd0 >/dev/null 2>&1

umount /mnt/vol
/usr/sbin/e2fsck -fn "$dev" >/tmp/fsck.txt 2>&1 || { cat /tmp/fsck.txt; fail "e2fsck found problems"; }
mount -t ext4 "$dev" /mnt/vol
(cd /mnt/vol && sha256sum -c /tmp/sums) >/dev/null || fail "checksums differ after a remount"
umount /mnt/vol
step "e2fsck -fn clean, checksums right after a remount"
errors=$(io_errors)
step "I/O errors in the kernel log: $errors"
dmesg | grep -i -E "i/o error|error, dev (ublkb|nbd)|buffer i/o" || true
[ "$errors" = 0 ] || fail "the kernel logged I/O errors"
hybridcache -T -i 1 || fail "-T refused after umount"
[ ! -e "$dev" ] || fail "$dev still exists after -T"
[ ! -e "$raw" ] || fail "$raw still exists after -T"
step "-T accepted after umount; $dev and $raw are gone"

# The configuration file's way: a daemon started with --config loads the cache it names and
# resumes the device, as -S --load does.
hybridcache stop-daemon >/dev/null
wait $dpid || fail "the daemon did not stop cleanly"
truncate -s 64M /tmp/cache3.img
truncate -s 128M /tmp/core5.img
printf '[daemon]\nublk_queues = 1\n\n[[cache]]\nid = 3\ndevice = "/tmp/cache3.img"\nmode = "wb"\n\n[[core]]\ncache = 3\nid = 1\ndevice = "/tmp/core5.img"\n' >/tmp/hc.toml
start_daemon --config /tmp/hc.toml
dev3=$(hybridcache -L -o csv | awk -F, '$1 == "core" && $2 == 1 { print $6 }')
[ -b "$dev3" ] || fail "no device for cache 3 from the configuration"
[ "$(queues "$dev3")" = 1 ] || fail "$dev3 has $(queues "$dev3") queues; the configuration asked for 1"
/usr/sbin/mke2fs -q -t ext4 -F "$dev3"
mount -t ext4 "$dev3" /mnt/vol
dd if=/dev/urandom of=/mnt/vol/conf bs=64k count=32 2>/dev/null
sync
(cd /mnt/vol && sha256sum conf) >/tmp/sums3
kill -9 $dpid
wait $dpid 2>/dev/null || true
t0=$(now)
remove_runtime_dir
start_daemon --config /tmp/hc.toml
grep -q "resumed $dev3" /tmp/daemon.log || fail "the configuration did not resume $dev3"
step "configuration file: $dev3 resumed $(since "$t0") s after the restart began"
dd if=/dev/urandom of=/mnt/vol/conf2 bs=64k count=16 conv=fsync 2>/dev/null ||
	fail "writing after the resume failed"
# From the device, not the page cache.
sync
echo 3 >/proc/sys/vm/drop_caches
(cd /mnt/vol && sha256sum -c /tmp/sums3) >/dev/null || fail "checksum differs after the resume"
umount /mnt/vol
/usr/sbin/e2fsck -fn "$dev3" >/tmp/fsck.txt 2>&1 || { cat /tmp/fsck.txt; fail "e2fsck on $dev3"; }
hybridcache stop-daemon >/dev/null
wait $dpid || fail "the daemon did not stop cleanly"
[ ! -e "$dev3" ] || fail "$dev3 still exists after stop-daemon"
[ "$(io_errors)" = 0 ] || fail "the kernel logged I/O errors"
start_daemon

# A cache that cannot be loaded: the device it left is deleted, with the reason in the log.
truncate -s 64M /tmp/cache2.img
truncate -s 64M /tmp/core4.img
hybridcache -S -d /tmp/cache2.img -i 2 -c wb
hybridcache -A -i 2 -d /tmp/core4.img
dev2=$(hybridcache -L -o csv | awk -F, '$1 == "core" && $2 == 1 { print $6 }')
[ -b "$dev2" ] || fail "no device for cache 2"
kill -9 $dpid
wait $dpid 2>/dev/null || true
dd if=/dev/zero of=/tmp/cache2.img bs=1M count=8 conv=notrunc 2>/dev/null
start_daemon
if hybridcache -S -d /tmp/cache2.img --load 2>/tmp/load.txt; then fail "a zeroed cache loaded"; fi
[ ! -e "$dev2" ] || fail "$dev2 was left behind by a cache that cannot be loaded"
grep "deleted $dev2" /tmp/daemon.log || fail "no log line about deleting $dev2"
step "cache 2 cannot be loaded ($(cat /tmp/load.txt)): $dev2 deleted"
hybridcache stop-daemon >/dev/null
wait $dpid || fail "the daemon did not stop cleanly"
grep -q panicked /tmp/daemon.log && fail "the daemon panicked"
step "all done: recovery $recovery s, I/O errors $errors"
