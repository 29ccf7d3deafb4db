# hybridcache: the two commands a new machine needs are `make demo` and `make test`.
SHELL := /bin/bash
CARGO ?= cargo
# man-db: the install test renders the man pages with `man -l`.
# libclang-dev: libublk's bindgen (crates/ublk). xfsprogs ... bcache-tools: the signature tests make
# each file system and volume signature with its own tool. prometheus: the metrics test. tmux: top.
# jq, socat: the docs' examples, which the doc test (crates/cli/tests/docs.rs) runs. libnbd-bin
# (nbdinfo, nbdcopy, nbdfuse), fuse3 (fusermount3), e2fsprogs (mkfs.ext4, e2fsck) and mount
# (losetup, mount): ext4 on an export (crates/cli/tests/ext4_fuse.rs). zsh, fish: the completion
# test runs each shell's script (crates/cli/tests/completions.rs). Every tool a test needs is
# here: `make test` runs the tests with HC_REQUIRE_TOOLS=1, so a missing one fails the test
# (common::need) instead of skipping it.
DEB_PACKAGES := man-db fio nbdkit libnbd-bin qemu-utils fuse3 python3-libnbd prometheus tmux libclang-dev \
	xfsprogs btrfs-progs lvm2 fdisk bcache-tools jq socat e2fsprogs mount zsh fish
STAMP := target/.deps-installed

.PHONY: all build deps ceph-deps test test-rust test-guest test-ceph ceph-demo ceph-ops lint fmt bench \
	demo clean install deb

all: build

# Install the system tools the tests drive (real NBD clients); only what is missing.
deps: $(STAMP)
$(STAMP):
	@missing=""; for p in $(DEB_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		echo "installing:$$missing"; \
		if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
		else sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; fi; \
	fi
	@mkdir -p target && touch $(STAMP)

build:
	$(CARGO) build --release --workspace

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

# Every test: unit, model-based, concurrency, crash, and real-client tests. Benches are built
# (so they keep compiling) but not run: speed is measured by `make bench`, never by tests.
# HC_REQUIRE_TOOLS=1: deps has installed every tool, so no test may skip for want of one.
test: deps lint
	$(CARGO) build --workspace --all-targets
	HC_REQUIRE_TOOLS=1 $(CARGO) test --workspace
	$(MAKE) test-guest
	$(MAKE) test-ceph

# Kernel clients in a qemu guest (docs/guest.md): the Linux nbd driver against the daemon's TCP
# export, and the ublk driver against crates/ublk's RAM disk example and against the daemon's
# --frontend ublk, killed with SIGKILL under a mounted ext4 and fio and recovered (ext4, fio
# verify, e2fsck, zero I/O errors).
# scripts/guest/prepare.sh fetches the guest kernel and, when missing, qemu 10, busybox-static,
# nbd-client and socat; cached in target/guest/.
test-guest: deps
	$(CARGO) build -p hybridcache
	$(CARGO) build -p hybridcache-ublk --examples
	scripts/guest/test-nbd.sh
	scripts/guest/test-ublk.sh

# Ceph OSDs on hybridcache (docs/ceph.md, scripts/ceph/): Debian's Ceph 16.2 daemons, and
# matplotlib for the demo's chart. Kept apart from DEB_PACKAGES: only the Ceph targets need them.
CEPH_PACKAGES := ceph-mon ceph-mgr ceph-osd ceph-common python3-matplotlib
CEPH_STAMP := target/.ceph-deps-installed
ceph-deps: $(CEPH_STAMP)
$(CEPH_STAMP):
	@missing=""; for p in $(CEPH_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		echo "installing:$$missing"; \
		if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
		else sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; fi; \
	fi
	@mkdir -p target && touch $(CEPH_STAMP)

# The short functional check (about a minute): a cluster on three caches, fio rbd with crc32c
# verify while an OSD is killed and restarted, HEALTH_OK, everything torn down.
test-ceph: deps ceph-deps
	$(CARGO) build -p hybridcache
	HC=$(CURDIR)/target/debug/hybridcache CEPH_DIR=$(CURDIR)/target/ceph-test scripts/ceph/test.sh

# The study's comparison (a few minutes): the cluster on bare emulated HDDs, then on hybridcache
# caches in front of them; the table against the study's gains, in ceph-out/.
ceph-demo: deps ceph-deps
	$(CARGO) build --release -p hybridcache
	scripts/ceph/demo.sh

# kill -9 of an OSD and of the hybridcache daemon under fio --verify (a few minutes).
ceph-ops: deps ceph-deps
	$(CARGO) build --release -p hybridcache
	scripts/ceph/ops.sh

# Speed (docs/bench.md): the engine's micro-benchmarks, the emulated RAID 60 next to the study's
# no-cache table, and a steady-state fio matrix (random 4 KiB writes, iodepth 1..32) against the
# core alone, hybridcache and nbdkit's cache filter over the very same emulated RAID, written to
# bench-out/ (report.md, results.json, charts). BENCH_ARGS adds or overrides flags of `bench run`.
BENCH_OUT ?= bench-out
bench: deps
	$(CARGO) bench -p hybridcache-engine
	$(CARGO) build --release -p hybridcache
	target/release/hybridcache bench calibration
	rm -rf $(BENCH_OUT)
	target/release/hybridcache bench run --out $(BENCH_OUT) \
		--core 'raid:preset=study60,disk_size=64G,nodata' --cache ram:256M \
		--pattern randwrite --bs 4K --iodepth 1,4,8,16,32 \
		--configs core,cache,nbdkit-cache --protocol steady --settle 10 --runtime 10 --size 4G \
		$(BENCH_ARGS)

# A cache in front of an emulated HDD RAID 60, measured with and without it (scripts/demo.sh):
# about a minute after the build; leaves demo-data/ for inspection.
demo: deps
	$(CARGO) build --release -p hybridcache
	scripts/demo.sh

# Install (docs/cli.md, "Install"): the binary in $(PREFIX)/bin (bin, not sbin: the CLI is run by
# operators as casadm is, and the unit's ExecStart names it), the systemd unit in
# $(PREFIX)/lib/systemd/system (with PREFIX=/usr that is /usr/lib/systemd/system, where Debian's
# usr-merged systemd packages put units; with /usr/local systemd reads /usr/local/lib/systemd/system),
# man pages and completions made by the binary itself (`hybridcache gen`), the docs and the example
# IO class file when packaging/ has one. BIN= installs another build (the install test uses the
# debug binary to skip a release build).
PREFIX ?= /usr/local
DESTDIR ?=
BIN ?= target/release/hybridcache
BINDIR ?= $(PREFIX)/bin
UNITDIR ?= $(PREFIX)/lib/systemd/system
MANDIR ?= $(PREFIX)/share/man
DATADIR ?= $(PREFIX)/share
DOCDIR ?= $(DATADIR)/doc/hybridcache
install:
	@if [ "$(BIN)" = target/release/hybridcache ]; then $(CARGO) build --release -p hybridcache; fi
	set -e; gen=$$(mktemp -d); trap 'rm -rf "$$gen"' EXIT; \
	"$(BIN)" gen man "$$gen/man"; "$(BIN)" gen completions "$$gen/completions"; \
	install -Dm755 "$(BIN)" "$(DESTDIR)$(BINDIR)/hybridcache"; \
	install -d "$(DESTDIR)$(UNITDIR)"; \
	sed 's|/usr/bin/hybridcache|$(BINDIR)/hybridcache|' packaging/hybridcache.service \
		> "$(DESTDIR)$(UNITDIR)/hybridcache.service"; \
	chmod 644 "$(DESTDIR)$(UNITDIR)/hybridcache.service"; \
	install -d "$(DESTDIR)$(MANDIR)/man8" "$(DESTDIR)$(MANDIR)/man5"; \
	install -m644 "$$gen"/man/*.8 "$(DESTDIR)$(MANDIR)/man8/"; \
	install -m644 "$$gen"/man/*.5 "$(DESTDIR)$(MANDIR)/man5/"; \
	install -Dm644 "$$gen/completions/hybridcache.bash" \
		"$(DESTDIR)$(DATADIR)/bash-completion/completions/hybridcache"; \
	install -Dm644 "$$gen/completions/_hybridcache" "$(DESTDIR)$(DATADIR)/zsh/site-functions/_hybridcache"; \
	install -Dm644 "$$gen/completions/hybridcache.fish" \
		"$(DESTDIR)$(DATADIR)/fish/vendor_completions.d/hybridcache.fish"; \
	install -d "$(DESTDIR)$(DOCDIR)"; \
	install -m644 README.md docs/*.md "$(DESTDIR)$(DOCDIR)/"; \
	if [ -f packaging/ioclass-config.csv ]; then \
		install -m644 packaging/ioclass-config.csv "$(DESTDIR)$(DOCDIR)/"; fi

# A Debian package from an install tree (PREFIX=/usr): target/hybridcache_VERSION_ARCH.deb
# (DEB_DIR= writes it elsewhere; DEB_COMPRESS=none skips xz, as the install test does). Man pages
# are gzipped, as Debian policy wants. Depends: the packages that own the libraries the binary links.
DEB_DIR ?= target
DEB_COMPRESS ?= xz
deb:
	@if [ "$(BIN)" = target/release/hybridcache ]; then $(CARGO) build --release -p hybridcache; fi
	set -e; root=$$(mktemp -d); trap 'rm -rf "$$root"' EXIT; chmod 755 "$$root"; \
	$(MAKE) --no-print-directory install DESTDIR="$$root" PREFIX=/usr BIN="$(BIN)"; \
	gzip -9n "$$root"/usr/share/man/man[58]/*; \
	version=$$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n1); \
	arch=$$(dpkg --print-architecture); \
	depends=$$(ldd "$(BIN)" | awk '$$3 ~ /^\// {print $$3} $$1 ~ /^\// {print $$1}' \
		| while read -r lib; do dpkg -S "$$(readlink -f "$$lib")" 2>/dev/null || dpkg -S "$$lib" 2>/dev/null || true; done \
		| cut -d: -f1 | sort -u | paste -sd, | sed 's/,/, /g'); \
	size=$$(du -sk "$$root" | cut -f1); \
	mkdir -p "$$root/DEBIAN"; \
	{ echo "Package: hybridcache"; echo "Version: $$version"; echo "Architecture: $$arch"; \
	  echo "Maintainer: hybridcache developers <hybridcache@localhost>"; \
	  echo "Installed-Size: $$size"; echo "Depends: $${depends:-libc6}"; \
	  echo "Suggests: nbd-client, nbdkit"; echo "Section: admin"; echo "Priority: optional"; \
	  echo "Description: user-space hybrid-storage block cache"; \
	  echo " A block cache in front of slow disks (HDDs, RAID, network block devices) on fast"; \
	  echo " ones (SSD, NVMe, RAM), exported over NBD or ublk, with a casadm-style command line"; \
	  echo " (Open CAS habits work), a systemd unit (Type=notify), man pages and completions."; \
	} > "$$root/DEBIAN/control"; \
	mkdir -p "$(DEB_DIR)"; \
	dpkg-deb --root-owner-group -Z$(DEB_COMPRESS) --build "$$root" "$(DEB_DIR)/hybridcache_$${version}_$${arch}.deb"

clean:
	$(CARGO) clean
	rm -rf demo-data
