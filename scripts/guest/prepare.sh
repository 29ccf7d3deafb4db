#!/bin/bash
# Prepares everything a guest run needs (docs/guest.md), from Debian packages, cached under
# target/guest/ so that reruns take well under a second:
#   - host tools: qemu-system-x86 (10, from bookworm-backports, next to the machine's qemu-utils 10),
#     busybox-static, nbd-client, fio, e2fsprogs, socat -- installed with apt only when missing;
#   - the guest kernel: bookworm-backports' 6.12 cloud kernel (bookworm's own 6.1 kernels lack
#     ublk), fetched with `apt-get download` through a private apt state, so the system's apt
#     sources are left alone;
#   - the base initramfs: busybox, the kernel modules (nbd, ublk_drv, virtio_blk, virtio_net),
#     nbd-client, mke2fs/e2fsck, fio and their shared libraries, and the /init that runs a test.
# Prints nothing but progress on stderr; safe to run again at any time.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
HERE=$ROOT/scripts/guest
G=${GUEST_DIR:-$ROOT/target/guest}
APT=$G/apt
KDIR=$G/kernel

log() { echo "guest/prepare: $*" >&2; }

as_root() {
	if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi
}

# A private apt configuration: bookworm plus bookworm-backports, lists and downloads under
# target/guest/apt. The dpkg status stays the system's, so an install through it is an ordinary
# install; only the package lists are private.
APT_OPTS=(-o "Dir::Etc::SourceList=$APT/sources.list" -o "Dir::Etc::SourceParts=$APT/sources.d"
	-o "Dir::State::Lists=$APT/lists" -o "Dir::Cache=$APT/cache" -o "APT::Get::List-Cleanup=0"
	-o "APT::Sandbox::User=root")
apt_ready=
private_apt_update() {
	[ -n "$apt_ready" ] && return 0
	mkdir -p "$APT/lists/partial" "$APT/cache/archives/partial" "$APT/sources.d"
	local key=/usr/share/keyrings/debian-archive-keyring.gpg
	local mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
	cat >"$APT/sources.list" <<-EOF
		deb [signed-by=$key] $mirror bookworm main
		deb [signed-by=$key] $mirror bookworm-updates main
		deb [signed-by=$key] ${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security} bookworm-security main
		deb [signed-by=$key] $mirror bookworm-backports main
	EOF
	log "apt-get update (private lists in $APT)"
	as_root apt-get "${APT_OPTS[@]}" update -qq
	apt_ready=1
}

# ---- host tools ----------------------------------------------------------------------------
qemu_major() {
	# No qemu at all (a new machine) is an empty answer, not a failure: with pipefail the
	# missing command's 127 would end the script before it installs qemu.
	{ qemu-system-x86_64 --version 2>/dev/null || true; } |
		sed -n 's/^QEMU emulator version \([0-9]*\)\..*/\1/p'
}
need=()
[ -x /bin/busybox ] || need+=(busybox-static)
command -v nbd-client >/dev/null || [ -x /usr/sbin/nbd-client ] || need+=(nbd-client)
command -v fio >/dev/null || need+=(fio)
[ -x /usr/sbin/mke2fs ] && [ -x /usr/sbin/e2fsck ] || need+=(e2fsprogs)
command -v socat >/dev/null || need+=(socat)
# qemu 7.2 (bookworm) crashes this kernel under TCG unless cx16 is off, and installing it can
# replace a newer qemu-utils; take the whole qemu-system set from backports instead.
major=$(qemu_major)
if [ -z "$major" ] || [ "$major" -lt 8 ]; then
	need+=(qemu-system-x86/bookworm-backports qemu-system-common/bookworm-backports
		qemu-system-data/bookworm-backports seabios/bookworm-backports)
fi
if [ ${#need[@]} -gt 0 ]; then
	private_apt_update
	log "installing ${need[*]}"
	as_root env DEBIAN_FRONTEND=noninteractive apt-get "${APT_OPTS[@]}" install -y -qq \
		--no-install-recommends "${need[@]}" >&2
fi

# ---- guest kernel --------------------------------------------------------------------------
# Modules the guest loads, in load order (failover before net_failover before virtio_net).
MODULES=(failover net_failover virtio_net virtio_blk nbd ublk_drv)
if [ ! -f "$KDIR/vmlinuz" ] || [ ! -f "$KDIR/modules/ublk_drv.ko" ]; then
	private_apt_update
	pkg=$(apt-cache "${APT_OPTS[@]}" pkgnames linux-image-6.12. |
		grep -E '^linux-image-6\.12\.[0-9.]+\+deb12-cloud-amd64-unsigned$' | sort -V | tail -1)
	[ -n "$pkg" ] || { log "no linux-image-6.12.*-cloud-amd64-unsigned in bookworm-backports"; exit 1; }
	log "downloading $pkg"
	rm -rf "$KDIR" "$G/kroot" && mkdir -p "$KDIR/modules" "$G/debs" "$G/kroot"
	(cd "$G/debs" && rm -f linux-image-*.deb && apt-get "${APT_OPTS[@]}" download -qq "$pkg" >&2)
	dpkg-deb -x "$G"/debs/linux-image-*.deb "$G/kroot"
	cp "$G"/kroot/boot/vmlinuz-* "$KDIR/vmlinuz"
	cp "$G"/kroot/boot/config-* "$KDIR/config"
	for m in "${MODULES[@]}"; do
		f=$(find "$G/kroot/lib/modules" -name "$m.ko.xz" | head -1)
		[ -n "$f" ] || { log "module $m missing from $pkg"; exit 1; }
		# Decompressed here: busybox's insmod does not read .ko.xz.
		xz -dc "$f" >"$KDIR/modules/$m.ko"
	done
	printf '%s\n' "${MODULES[@]}" >"$KDIR/modules/order"
	echo "$pkg" >"$KDIR/package"
	rm -rf "$G/kroot" "$G/debs"
fi

# ---- base initramfs ------------------------------------------------------------------------
NBD_CLIENT=$(command -v nbd-client || echo /usr/sbin/nbd-client)
FIO=$(command -v fio)
BINARIES=("$NBD_CLIENT" "$FIO" /usr/sbin/mke2fs /usr/sbin/e2fsck)

# Rebuilt only when an input changed: the manifest lists every input with its size and mtime.
manifest=$(
	for f in /bin/busybox "${BINARIES[@]}" "$HERE/init" "$HERE/prepare.sh" "$HERE/lib.sh" "$KDIR"/modules/*; do
		stat -L -c '%n %s %Y' "$f"
	done
)
if [ -f "$G/base.cpio" ] && [ "$(cat "$G/base.manifest" 2>/dev/null)" = "$manifest" ]; then
	exit 0
fi
log "building the base initramfs"
# shellcheck source=lib.sh
. "$HERE/lib.sh"
stage=$(mktemp -d "$G/stage.XXXXXX")
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage"/{bin,sbin,usr/bin,usr/sbin,proc,sys,dev,tmp,mnt,run,etc,lib/modules,root}
stage_binary "$stage" /bin/busybox
cp "$HERE/init" "$stage/init" && chmod 755 "$stage/init"
cp "$KDIR"/modules/*.ko "$KDIR/modules/order" "$stage/lib/modules/"
for b in "${BINARIES[@]}"; do stage_binary "$stage" "$b"; done
[ -f /etc/mke2fs.conf ] && cp /etc/mke2fs.conf "$stage/etc/"
echo "root:x:0:0:root:/root:/bin/sh" >"$stage/etc/passwd"
echo "root:x:0:" >"$stage/etc/group"
# Uncompressed: the guest's emulated CPU would spend seconds inflating ~100 MB of gzip.
make_cpio "$stage" "$G/base.cpio.tmp"
mv "$G/base.cpio.tmp" "$G/base.cpio"
echo "$manifest" >"$G/base.manifest"
log "base initramfs: $(du -h "$G/base.cpio" | cut -f1)"
