# Helpers shared by prepare.sh and run.sh (sourced, not run).

# stage_binary ROOT FILE [GUEST_PATH]: copy FILE into ROOT (at GUEST_PATH, default its own path)
# with every shared library ldd names, at the library's own path, so the guest's dynamic loader
# finds them without any configuration.
stage_binary() {
	local root=$1 file=$2 dest=${3:-$2} lib
	mkdir -p "$root/$(dirname "$dest")"
	cp -L "$file" "$root/$dest"
	# A static binary makes ldd fail ("not a dynamic executable"): nothing more to copy.
	for lib in $(ldd "$file" 2>/dev/null | grep -o '/[^ ]*' || true); do
		[ -e "$root/$lib" ] && continue
		mkdir -p "$root/$(dirname "$lib")"
		cp -L "$lib" "$root/$lib"
	done
}

# make_cpio DIR OUT: an uncompressed newc archive of DIR, everything owned by root.
make_cpio() {
	(cd "$1" && find . | LC_ALL=C sort | busybox cpio -o -H newc -R 0:0 >"$2" 2>/dev/null)
}
