#!/bin/sh
# A casadm user's cache report, written for casadm (Open CAS) and kept unchanged: the test
# casadm_compat.rs runs it with `casadm` on PATH being a link to hybridcache. It sets cache 1's
# cleaning as casadm does, then reads every value back the way such scripts do: CSV columns and
# rows looked up by their names with awk, never by position. Prints KEY=VALUE lines.
#
# Exit 3: the cache engine is not loaded (casadm -V says "Not Loaded").
set -eu

CACHE_ID=${1:-1}
CORE_ID=${2:-1}

# The value of a row named $1 in casadm's two-column CSV (-G, -V) read on stdin.
row() {
	awk -F, -v name="$1" 'NR > 1 && $1 == name { print $2; found = 1 } END { exit !found }'
}

# The value of the column named $1 in the first data line of casadm's CSV (-P) on stdin.
column() {
	awk -F, -v name="$1" '
		NR == 1 { for (i = 1; i <= NF; i++) col[$i] = i; next }
		NR == 2 { if (!(name in col)) exit 1; print $col[name]; exit }'
}

# Is it loaded? casadm prints its module's version or "Not Loaded".
if casadm -V -o csv | grep -q ',Not Loaded$'; then
	echo "cache engine not loaded" >&2
	exit 3
fi
echo "cli_version=$(casadm -V -o csv | awk -F, 'NR > 1 && $1 ~ /CLI Utility$/ { print $2 }')"

# Settings, in casadm's long and short forms.
casadm --set-param --name cleaning --cache-id "$CACHE_ID" --policy alru
casadm --set-param --name cleaning-alru --cache-id "$CACHE_ID" --wake-up 30 --staleness-time 60
casadm -X -n seq-cutoff -i "$CACHE_ID" -j "$CORE_ID" -p never -t 2048

echo "cleaning_policy=$(casadm -G -n cleaning -i "$CACHE_ID" -o csv | row 'Cleaning policy type')"
alru=$(casadm --get-param --name cleaning-alru --cache-id "$CACHE_ID" --output-format csv)
echo "alru_wake_up=$(echo "$alru" | row 'Wake up time [s]')"
echo "alru_staleness=$(echo "$alru" | row 'Stale buffer time [s]')"
echo "alru_dirty_trigger=$(echo "$alru" | row 'Dirty ratio trigger threshold [%]')"
seq=$(casadm -G -n seq-cutoff -i "$CACHE_ID" -j "$CORE_ID" -o csv)
echo "seq_cutoff_policy=$(echo "$seq" | row 'Sequential cutoff policy')"
echo "seq_cutoff_threshold=$(echo "$seq" | row 'Sequential cutoff threshold [KiB]')"
echo "promotion_policy=$(casadm -G -n promotion -i "$CACHE_ID" -o csv | row 'Promotion policy type')"

# The list: the cache's row and its cores', by the header's names.
casadm -L -o csv | awk -F, -v id="$CACHE_ID" '
	NR == 1 { for (i = 1; i <= NF; i++) col[$i] = i; next }
	$col["type"] == "cache" { cur = $col["id"] }
	$col["type"] == "cache" && $col["id"] == id {
		print "status=" $col["status"]
		print "write_policy=" $col["write policy"]
	}
	$col["type"] == "core" && cur == id { cores++ }
	END { print "cores=" cores + 0 }'

# Statistics.
stats=$(casadm -P -i "$CACHE_ID" -o csv)
echo "stats_write_policy=$(echo "$stats" | column 'Write Policy')"
echo "stats_cleaning_policy=$(echo "$stats" | column 'Cleaning Policy')"
echo "occupancy=$(echo "$stats" | column 'Occupancy [4KiB Blocks]')"
echo "dirty=$(echo "$stats" | column 'Dirty [4KiB Blocks]')"
