# hybridcache: the two commands a new machine needs are `make demo` and `make test`.
SHELL := /bin/bash
CARGO ?= cargo
# libclang-dev: libublk's bindgen (crates/ublk). xfsprogs ... bcache-tools: the signature tests make
# each file system and volume signature with its own tool. prometheus: the metrics test. tmux: top.
DEB_PACKAGES := fio nbdkit libnbd-bin qemu-utils fuse3 python3-libnbd prometheus tmux libclang-dev \
	xfsprogs btrfs-progs lvm2 fdisk bcache-tools
STAMP := target/.deps-installed

.PHONY: all build deps ceph-deps test test-rust test-guest test-ceph ceph-demo ceph-ops lint fmt bench \
	demo clean

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
test: deps lint
	$(CARGO) build --workspace --all-targets
	$(CARGO) test --workspace
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

clean:
	$(CARGO) clean
	rm -rf demo-data
