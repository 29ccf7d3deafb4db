# scripts/ceph/lib.sh: a miniature Ceph cluster whose OSDs sit on hybridcache exports.
# Sourced by demo.sh, test.sh and ops.sh; see docs/ceph.md.
#
# One run directory ($CEPH_DIR) holds everything: the hybridcache daemon (or one bare-core
# `hybridcache serve` per OSD for the baseline), the emulated HDDs' data files, the cache files,
# one nbdfuse mount and one loop device per OSD, and the Ceph cluster (1 mon, 1 mgr, N BlueStore
# OSDs started by hand as Ceph's vstart.sh does, all on 127.0.0.1, auth none).
# `cleanup` (installed as an EXIT trap by `ceph_init`) stops all of it, whatever state it is in.

set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
HC=${HC:-$ROOT/target/release/hybridcache}
CEPH_DIR=${CEPH_DIR:-$ROOT/target/ceph}
OSDS=${OSDS:-3}
# The emulated core: a 10k rpm SAS HDD (the study's disks did about 300 random 4 KiB IOPS at
# queue depth 32 with ~100 ms mean latency; this model does about the same).
CORE_SIZE=${CORE_SIZE:-8G}
CORE_SPEC_KEYS=${CORE_SPEC_KEYS:-rpm=10000,avg_seek_ms=4.5,full_seek_ms=8,rate=200M,ncq=32}
CACHE_SIZE=${CACHE_SIZE:-1G}
# Not 6789, so a real cluster on this host is left alone.
MON_PORT=${MON_PORT:-46789}
# The study's recipe says `always`; `never` shows what cutting off BlueStore's sequential writes
# (its RocksDB WAL among them) costs (docs/ceph.md).
SEQ_CUTOFF=${SEQ_CUTOFF:-always}
# How the cached OSDs reach their caches: nbd (the export through nbdfuse and a loop device, all
# this machine can do) or ublk (/dev/ublkbN, on a kernel with the ublk_drv module). The baseline's
# bare disks are served over NBD either way (`hybridcache serve` has no ublk front-end).
FRONTEND=${FRONTEND:-nbd}
case "$FRONTEND" in nbd | ublk) ;; *) echo "ceph: FRONTEND is nbd or ublk, not $FRONTEND" >&2; exit 2 ;; esac

say() { printf '== %s\n' "$*" >&2; }
die() { echo "ceph: $*" >&2; exit 1; }

need_tools() {
    local t
    for t in ceph ceph-mon ceph-mgr ceph-osd monmaptool rbd fio nbdfuse losetup fusermount3 \
        uuidgen python3; do
        command -v "$t" >/dev/null || die "$t is missing: run 'make ceph-deps'"
    done
    fio --enghelp=rbd >/dev/null 2>&1 || die "this fio has no rbd engine"
    [ -x "$HC" ] || die "$HC is missing: cargo build --release -p hybridcache"
    [ -e /dev/fuse ] || die "no /dev/fuse: FUSE is needed for nbdfuse"
    losetup -f >/dev/null 2>&1 || die "no free loop device (losetup -f failed)"
}

# --- cleanup: everything this run started, in reverse order ----------------------------------
cleanup() {
    local rc=$?
    # A subshell, so `set +e` does not leak into the caller.
    (set +e; cleanup_all)
    return "$rc"
}

cleanup_all() {
    local p
    [ -d "$CEPH_DIR" ] || return 0
    # fio clients first (one in the background would wait for the cluster forever).
    pkill -KILL -f -- "--output=$CEPH_DIR/" 2>/dev/null
    kill_pidfiles "$CEPH_DIR"/run/*.pid
    detach_osd_devices
    kill_pidfiles "$CEPH_DIR"/hc/*.pid
    rm -rf "$CEPH_DIR"/run "$CEPH_DIR"/mon.* "$CEPH_DIR"/mgr.* "$CEPH_DIR"/osd.* "$CEPH_DIR"/hc \
        "$CEPH_DIR"/data
}

# kill_pidfiles FILE...: SIGKILL each process named in a pid file and wait until it is gone (a
# mon still dying would answer the next cluster's OSDs with the old fsid).
kill_pidfiles() {
    local f pid pids=() t
    for f in "$@"; do
        [ -f "$f" ] || continue
        pid=$(cat "$f")
        if [ -n "$pid" ] && kill -KILL "$pid" 2>/dev/null; then pids+=("$pid"); fi
        rm -f "$f"
    done
    for pid in ${pids[@]+"${pids[@]}"}; do
        for t in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
    done
}

# Loop devices first (they hold the FUSE files open), then the FUSE mounts and nbdfuse.
detach_osd_devices() {
    local f mnt
    for f in "$CEPH_DIR"/hc/loop.*; do
        [ -f "$f" ] || continue
        losetup -d "$(cat "$f")" 2>/dev/null || true
        rm -f "$f"
    done
    # Every FUSE mount under the run directory, from the mount table: a mount whose nbdfuse died
    # fails stat ("Transport endpoint is not connected"), so `[ -d ]` would skip it.
    awk -v d="$CEPH_DIR/hc/" 'index($2, d) == 1 { print $2 }' /proc/mounts | while read -r mnt; do
        fusermount3 -u -z "$mnt" 2>/dev/null || umount -l "$mnt" 2>/dev/null || true
    done
    kill_pidfiles "$CEPH_DIR"/hc/nbdfuse.*.pid
    for mnt in "$CEPH_DIR"/hc/fuse.*; do
        [ "$mnt" = "$CEPH_DIR/hc/fuse.*" ] && break
        for _ in $(seq 50); do rmdir "$mnt" 2>/dev/null && break; sleep 0.1; done
    done
    return 0
}

ceph_init() {
    need_tools
    # A previous run killed hard may have left processes or loop devices: clear them first.
    cleanup || true
    mkdir -p "$CEPH_DIR"/{run,log,hc,data}
    trap cleanup EXIT
    trap 'exit 130' INT TERM
}

core_spec() { echo "hdd:size=$CORE_SIZE,$CORE_SPEC_KEYS,file=$CEPH_DIR/data/core.$1.img"; }

# --- hybridcache ----------------------------------------------------------------------------
hc() { "$HC" --control "$CEPH_DIR/hc/control.sock" "$@"; }

start_hc_daemon() {
    local log=$CEPH_DIR/log/hybridcache.log
    "$HC" daemon --control "$CEPH_DIR/hc/control.sock" --nbd-socket "$CEPH_DIR/hc/nbd.sock" \
        --nbd-workers 32 --config "$CEPH_DIR/hc/config.toml" --state-dir "$CEPH_DIR/hc" >>"$log" 2>&1 &
    echo $! >"$CEPH_DIR/hc/daemon.pid"
    disown
    local i
    for i in $(seq 200); do
        [ -S "$CEPH_DIR/hc/control.sock" ] && hc -L >/dev/null 2>&1 && return 0
        kill -0 "$(cat "$CEPH_DIR/hc/daemon.pid")" 2>/dev/null || break
        sleep 0.1
    done
    tail -20 "$log" >&2
    die "the hybridcache daemon did not start"
}

# The study's recipe per OSD, through our CLI as the study ran casadm (only the binary name and
# the device paths differ).
setup_caches() {
    local i id
    # A fresh setup: an empty file, and no run-time setup of an earlier run in the state
    # directory (the daemon brings that back at start).
    : >"$CEPH_DIR/hc/config.toml"
    rm -f "$CEPH_DIR/hc/setup.json"
    start_hc_daemon
    for i in $(seq 0 $((OSDS - 1))); do
        id=$((i + 1))
        truncate -s "$CACHE_SIZE" "$CEPH_DIR/data/cache.$i.img"
        rm -f "$CEPH_DIR/data/core.$i.img"
        hc -S -d "$CEPH_DIR/data/cache.$i.img" -i "$id" -c wb --force >/dev/null
        hc -A -i "$id" -d "$(core_spec "$i")" --frontend "$FRONTEND" >/dev/null
        hc -X -n seq-cutoff -i "$id" -j 1 -p "$SEQ_CUTOFF" -t 16
        hc --io-class --load-config --cache-id "$id" -f "$ROOT/scripts/ceph/ioclass-config.csv"
        hc -X -n cleaning-alru -t 1000 -i "$id"
    done
}

# The baseline: each OSD directly on its emulated HDD, exported bare (no cache).
setup_bare_cores() {
    local i
    for i in $(seq 0 $((OSDS - 1))); do
        rm -f "$CEPH_DIR/data/core.$i.img"
        "$HC" serve --core "$(core_spec "$i")" --socket "$CEPH_DIR/hc/bare.$i.sock" \
            --name "cas$((i + 1))-1" --workers 32 >>"$CEPH_DIR/log/serve.$i.log" 2>&1 &
        echo $! >"$CEPH_DIR/hc/serve.$i.pid"
        disown
    done
    for i in $(seq 0 $((OSDS - 1))); do
        wait_for_socket "$CEPH_DIR/hc/bare.$i.sock"
    done
}

wait_for_socket() {
    local i
    for i in $(seq 200); do [ -S "$1" ] && return 0; sleep 0.1; done
    die "$1 did not appear"
}

# export_uri I: OSD I's export (cache I+1, core 1) on whichever server runs.
export_uri() {
    local i=$1
    if [ -S "$CEPH_DIR/hc/bare.$i.sock" ]; then
        echo "nbd+unix:///cas$((i + 1))-1?socket=$CEPH_DIR/hc/bare.$i.sock"
    else
        echo "nbd+unix:///cas$((i + 1))-1?socket=$CEPH_DIR/hc/nbd.sock"
    fi
}

# ublk_device I: the /dev/ublkbN the daemon serves OSD I's cache (cache I+1, core 1) as.
ublk_device() {
    hc -L -o json | python3 -c '
import json, sys
cache = [c for c in json.load(sys.stdin)["caches"] if c["id"] == int(sys.argv[1])]
print((cache[0]["cores"][0].get("block_device") or "") if cache and cache[0]["cores"] else "")
' "$(($1 + 1))"
}

# attach_osd_device I: export -> nbdfuse file -> loop device; prints the loop device. With
# FRONTEND=ublk a cached OSD's device is the daemon's /dev/ublkbN itself (the kernel takes its
# rotational flag from the device's parameters).
attach_osd_device() {
    local i=$1 mnt=$CEPH_DIR/hc/fuse.$1 pidf=$CEPH_DIR/hc/nbdfuse.$1.pid loopdev t
    if [ "$FRONTEND" = ublk ] && [ ! -S "$CEPH_DIR/hc/bare.$i.sock" ]; then
        loopdev=$(ublk_device "$i")
        [ -b "$loopdev" ] || die "cache $((i + 1)) has no ublk device (is ublk_drv loaded?)"
        ln -sfn "$loopdev" "$CEPH_DIR/hc/osd.$i.block"
        echo "$loopdev"
        return 0
    fi
    mkdir -p "$mnt"
    rm -f "$pidf"
    nbdfuse -P "$pidf" "$mnt/disk" "$(export_uri "$i")" </dev/null >>"$CEPH_DIR/log/nbdfuse.$i.log" 2>&1 &
    disown
    for t in $(seq 200); do [ -s "$pidf" ] && break; sleep 0.1; done
    [ -s "$pidf" ] || die "nbdfuse for OSD $i did not start (log/nbdfuse.$i.log)"
    loopdev=$(losetup -f --show --direct-io=on "$mnt/disk")
    # The kernel's own NBD client (and ublk) sets the device's rotational flag from what the
    # server says; a loop device over a FUSE file is never rotational. BlueStore picks its HDD
    # or SSD defaults from this flag (deferred small writes only on HDDs), so the baseline's
    # emulated HDD must look like the disk it is, and a cache like the SSD it is (Open CAS's
    # exported devices are not rotational either).
    # OSD_ROTATIONAL=0|1 overrides it (an experiment: Open CAS before v24.9 exported its
    # devices as rotational, so OSDs on them ran BlueStore's HDD defaults).
    local rot=${OSD_ROTATIONAL:-}
    if [ -z "$rot" ]; then
        rot=0
        nbdinfo --is rotational "$(export_uri "$i")" && rot=1
    fi
    echo "$rot" >"/sys/block/$(basename "$loopdev")/queue/rotational"
    echo "$loopdev" >"$CEPH_DIR/hc/loop.$i"
    # The OSD opens this link, so a re-attached device may get another loop number.
    ln -sfn "$loopdev" "$CEPH_DIR/hc/osd.$i.block"
    echo "$loopdev"
}

# --- Ceph -------------------------------------------------------------------------------------
write_ceph_conf() {
    local fsid=$1
    cat >"$CEPH_DIR/ceph.conf" <<CONF
[global]
fsid = $fsid
mon_host = v1:127.0.0.1:$MON_PORT
public_addr = 127.0.0.1
cluster_addr = 127.0.0.1
ms_bind_msgr2 = false
auth_cluster_required = none
auth_service_required = none
auth_client_required = none
mon_warn_on_insecure_global_id_reclaim_allowed = false
mon_allow_pool_delete = true
mon_allow_pool_size_one = true
osd_pool_default_size = 2
osd_pool_default_min_size = 1
osd_pool_default_pg_autoscale_mode = off
osd_crush_chooseleaf_type = 0
run_dir = $CEPH_DIR/run
admin_socket = $CEPH_DIR/run/\$name.asok
log_file = $CEPH_DIR/log/\$name.log
pid_file = $CEPH_DIR/run/\$name.pid
[client]
admin_socket = $CEPH_DIR/run/\$name.\$pid.asok
log_file = $CEPH_DIR/log/client.\$pid.log
rbd_cache = false
[mon]
mon_data = $CEPH_DIR/mon.\$id
mon_data_avail_warn = 1
mon_data_avail_crit = 0
[mgr]
mgr_data = $CEPH_DIR/mgr.\$id
[osd]
osd_data = $CEPH_DIR/osd.\$id
osd_objectstore = bluestore
# One fewer command at start (see start_osd); the device class is only a label here.
osd_class_update_on_start = false
bluestore_block_create = false
bluestore_block_path = $CEPH_DIR/hc/osd.\$id.block
bluestore_fsck_on_mount = false
# The OSDs run with little RAM here; without this their buffer cache would serve the hit test
# from memory in both configurations (the study's working sets dwarfed its OSDs' RAM).
bluestore_default_buffered_read = false
osd_memory_target = 939524096
bluestore_cache_autotune = true
osd_op_num_shards = 2
osd_op_num_threads_per_shard = 2
CONF
}

cephc() { ceph -c "$CEPH_DIR/ceph.conf" "$@"; }

# retry_setup CMD...: a setup command that is safe to repeat (`ceph osd new UUID` gives the same
# id again, `rbd pool init` and `ceph osd pool create` are no-ops the second time). A Ceph client
# can meet the race start_osd describes: its first command reaches a mon before the client knows
# the fsid and the mon answers "wrong fsid" (EPERM, "problem getting command descriptions from
# mon"). Seen on a fresh CI machine.
retry_setup() {
    local try out
    for try in 1 2 3 4 5 6 7 8 9 10; do
        if out=$(timeout 30 "$@" 2>>"$CEPH_DIR/log/ceph-cli.log"); then
            [ -z "$out" ] || printf '%s\n' "$out"
            return 0
        fi
        echo "$* failed (attempt $try); trying again" >>"$CEPH_DIR/log/ceph-cli.log"
        sleep 1
    done
    tail -5 "$CEPH_DIR/log/ceph-cli.log" >&2
    tail -20 "$CEPH_DIR/log/mon.a.log" >&2 2>/dev/null || true
    die "$* kept failing (log/ceph-cli.log, log/mon.a.log)"
}

cephc_retry() { retry_setup ceph -c "$CEPH_DIR/ceph.conf" "$@"; }

# rbd_create IMAGE SIZE: a repeat after a lost answer finds the image there.
rbd_create() {
    local conf=$CEPH_DIR/ceph.conf
    retry_setup sh -c "rbd -c '$conf' info 'rbd/$1' >/dev/null 2>&1 ||
        rbd -c '$conf' create --size '$2' --image-feature layering 'rbd/$1'"
}

start_cluster() {
    local fsid i uuid id
    fsid=$(uuidgen)
    write_ceph_conf "$fsid"
    local conf=$CEPH_DIR/ceph.conf
    # --addv: with --add, any port but 6789 means msgr2, which this cluster does not bind.
    monmaptool --create --clobber --fsid "$fsid" --addv a "[v1:127.0.0.1:$MON_PORT]" \
        "$CEPH_DIR/monmap" >/dev/null
    ceph-mon -c "$conf" --mkfs -i a --monmap "$CEPH_DIR/monmap" >>"$CEPH_DIR/log/setup.log" 2>&1
    ceph-mon -c "$conf" -i a
    mkdir -p "$CEPH_DIR/mgr.x"
    ceph-mgr -c "$conf" -i x
    # Wait for the mon to answer (it may still be electing itself) before the first real command.
    cephc_retry mon stat >/dev/null
    for i in $(seq 0 $((OSDS - 1))); do
        uuid=$(uuidgen)
        id=$(cephc_retry osd new "$uuid")
        [ "$id" = "$i" ] || die "ceph gave OSD id $id, expected $i"
        mkdir -p "$CEPH_DIR/osd.$i"
        ceph-osd -c "$conf" -i "$i" --mkfs --osd-uuid "$uuid" >>"$CEPH_DIR/log/setup.log" 2>&1 \
            || die "ceph-osd --mkfs for OSD $i failed (log/setup.log)"
        start_osd "$i"
    done
    wait_health 180
    cephc_retry osd pool create rbd 32 32 >/dev/null
    cephc_retry osd pool set rbd size 2 >/dev/null
    retry_setup rbd -c "$conf" pool init rbd
    wait_health 180
}

# start_osd I: start OSD I (it daemonizes once it is up). Seen here, about one start in five: the
# OSD's first command to the mon leaves before its monitor client knows the fsid, the mon answers
# "wrong fsid" and the OSD exits during init. Nothing is half done then; starting again works.
start_osd() {
    local i=$1 try
    for try in 1 2 3 4 5; do
        ceph-osd -c "$CEPH_DIR/ceph.conf" -i "$i" 2>>"$CEPH_DIR/log/osd-start.log" && return 0
        echo "osd.$i did not start (attempt $try); starting it again" >>"$CEPH_DIR/log/osd-start.log"
        sleep 1
    done
    die "osd.$i did not start (log/osd.$i.log, log/osd-start.log)"
}

# wait_health SECONDS: until HEALTH_OK (every OSD up and in, every PG active+clean).
wait_health() {
    local limit=$1 t=0 h
    while :; do
        h=$(timeout 20 ceph -c "$CEPH_DIR/ceph.conf" health 2>/dev/null || true)
        case "$h" in HEALTH_OK*) return 0 ;; esac
        t=$((t + 2))
        [ "$t" -lt "$limit" ] || { cephc -s >&2 || true; die "no HEALTH_OK after ${limit}s: $h"; }
        sleep 2
    done
}

# start_stack cached|bare: the whole cluster on hybridcache caches, or on bare cores.
start_stack() {
    local kind=$1 i
    case "$kind" in
        cached) setup_caches ;;
        bare) setup_bare_cores ;;
        *) die "start_stack: cached or bare" ;;
    esac
    for i in $(seq 0 $((OSDS - 1))); do attach_osd_device "$i" >/dev/null; done
    start_cluster
}

stop_stack() {
    cleanup || true
    mkdir -p "$CEPH_DIR"/{run,log,hc,data}
}

# --- fio on RBD -------------------------------------------------------------------------------
# rbd_fio NAME IMAGE FIO-ARGS...: fio's rbd engine, JSON output in $CEPH_DIR/NAME.json.
rbd_fio() {
    local name=$1 image=$2
    shift 2
    CEPH_CONF=$CEPH_DIR/ceph.conf fio --output="$CEPH_DIR/$name.json" --output-format=json \
        --ioengine=rbd --clientname=admin --pool=rbd --rbdname="$image" --name="$name" "$@" \
        >/dev/null
}
