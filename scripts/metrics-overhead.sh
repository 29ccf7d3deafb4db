#!/usr/bin/env bash
# What a Prometheus scraper costs the request path: fio 4 KiB random writes through NBD on a RAM
# cache in front of a null core, each run once with nothing scraping /metrics and once with a
# scrape every second, interleaved (A B A B ...), and the median of the pairwise ratios printed.
# Usage: scripts/metrics-overhead.sh [ROUNDS] [SECONDS]   (needs a release build and fio, curl)
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}
SECS=${2:-8}
BIN=target/release/hybridcache
[ -x "$BIN" ] || { echo "build first: cargo build --release -p hybridcache" >&2; exit 2; }
DIR=$(mktemp -d)
trap 'kill $DAEMON 2>/dev/null || true; kill $SCRAPER 2>/dev/null || true; rm -rf "$DIR"' EXIT
SCRAPER=""
"$BIN" daemon --control "$DIR/ctl" --nbd-socket "$DIR/nbd" --state-dir "$DIR" --metrics-listen 127.0.0.1:0 2>"$DIR/log" &
DAEMON=$!
for _ in $(seq 100); do grep -q "metrics served on" "$DIR/log" 2>/dev/null && break; sleep 0.1; done
URL=$(grep -o 'http://[0-9.:]*/metrics' "$DIR/log" | head -1)
"$BIN" --control "$DIR/ctl" -S -d ram:1G -i 1 -c wb >/dev/null
"$BIN" --control "$DIR/ctl" -A -i 1 -d null:64G >/dev/null
"$BIN" --control "$DIR/ctl" -X -n cleaning -i 1 -p nop
run() {
	fio --name=w --ioengine=nbd --uri="nbd+unix:///cas1-1?socket=$DIR/nbd" --rw=randwrite --bs=4k \
		--size=512m --iodepth=32 --time_based=1 --runtime="$SECS" \
		--output="$DIR/fio.json" --output-format=json >/dev/null
	python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["jobs"][0]["write"]["iops"])' "$DIR/fio.json"
}
ratios=()
for r in $(seq "$ROUNDS"); do
	off=$(run)
	( while :; do curl -s "$URL" >/dev/null; sleep 1; done ) &
	SCRAPER=$!
	on=$(run)
	kill $SCRAPER; wait $SCRAPER 2>/dev/null || true; SCRAPER=""
	ratio=$(python3 -c "print(f'{$on/$off:.3f}')")
	ratios+=("$ratio")
	printf 'round %d: without scraper %.0f IOPS, with scraper %.0f IOPS, ratio %s\n' "$r" "$off" "$on" "$ratio"
done
printf '%s\n' "${ratios[@]}" | sort -n | awk '{a[NR]=$1} END {print "median ratio (scraped / not scraped):", a[int((NR+1)/2)]}'
