#!/usr/bin/env python3
"""scripts/ceph/report.py OUT: the ceph demo's table (stdout and OUT/report.md), OUT/results.json
and, when matplotlib is there, OUT/ceph-gains.png. Reads the fio JSON files demo.sh leaves."""
import json
import os
import sys

# The Open CAS + Ceph study's gains, cached against uncached (issue 17; docs/ceph.md).
STUDY = {
    "randread-4k": ("4K random read (100% hits)", 119.5, "iops"),
    "randwrite-4k": ("4K random write", 86.8, "iops"),
    "randrw70-4k": ("4K random 70/30", None, "iops"),
    "seqread-512k": ("512K sequential read", 1 - 0.028, "bw"),
    "seqwrite-512k": ("512K sequential write", 1 - 0.056, "bw"),
}


def fio(out, config, name):
    path = os.path.join(out, f"{config}-{name}.json")
    with open(path) as f:
        text = f.read()
    # fio may print notes before the JSON object.
    j = json.loads(text[text.index("{"):])["jobs"][0]
    r, w = j["read"], j["write"]
    iops = r["iops"] + w["iops"]
    bw = (r["bw_bytes"] + w["bw_bytes"]) / 1e6
    ios = r["total_ios"] + w["total_ios"]
    mean_us = (
        (r["clat_ns"]["mean"] * r["total_ios"] + w["clat_ns"]["mean"] * w["total_ios"]) / ios / 1e3
        if ios else 0.0
    )
    p99 = max(
        float(d["clat_ns"].get("percentile", {}).get("99.000000", 0)) for d in (r, w)
    ) / 1e3
    errors = j.get("error", 0)
    return {"iops": iops, "mb_s": bw, "mean_us": mean_us, "p99_us": p99, "error": errors,
            "ios": ios}


def cache(out, name):
    rows = []
    i = 1
    while os.path.exists(os.path.join(out, f"cached-{name}.cache{i}.json")):
        with open(os.path.join(out, f"cached-{name}.cache{i}.json")) as f:
            raw = json.load(f)["raw"]
        reads = raw["read_hits"] + raw["read_partial_misses"] + raw["read_full_misses"]
        writes = raw["write_hits"] + raw["write_partial_misses"] + raw["write_full_misses"]
        total = reads + writes + raw["pass_through_reads"] + raw["pass_through_writes"]
        rows.append({
            "dirty_pct": 100.0 * raw["dirty_lines"] / max(raw["total_lines"], 1),
            "read_hit_pct": 100.0 * raw["read_hits"] / reads if reads else None,
            "cut_off_pct": 100.0 * (raw["pass_through_reads"] + raw["pass_through_writes"]) / total
            if total else None,
            # Under the recipe's `always` policy a write is cut off exactly when the detector
            # saw it continue a sequential stream past the threshold.
            "seq_write_pct": 100.0 * raw["pass_through_writes"] / (writes + raw["pass_through_writes"])
            if writes + raw["pass_through_writes"] else None,
        })
        i += 1
    return rows


def perf_delta(out, config, name):
    """The OSDs' own counters over one run (perf dump after minus before, summed over OSDs):
    counters as numbers, latencies as (count, seconds). None when the dumps are missing."""
    total = {}
    i = 0
    while True:
        paths = [os.path.join(out, f"{config}-{name}.osd{i}.perf-{w}.json") for w in ("before", "after")]
        if not all(os.path.exists(p) for p in paths):
            break
        try:
            before, after = (json.load(open(p)) for p in paths)
        except ValueError:
            break
        for section, counters in after.items():
            for key, v in counters.items():
                b = before.get(section, {}).get(key)
                k = f"{section}.{key}"
                if isinstance(v, dict) and "avgcount" in v and isinstance(b, dict):
                    c, t = total.get(k, (0, 0.0))
                    total[k] = (c + v["avgcount"] - b["avgcount"], t + v["sum"] - b["sum"])
                elif isinstance(v, (int, float)) and isinstance(b, (int, float)):
                    total[k] = total.get(k, 0) + v - b
        i += 1
    return total if i else None


def avg_ms(delta, key):
    c, t = delta.get(key, (0, 0.0))
    return f"{1e3 * t / c:.2f}" if c else "-"


def per(delta, key, n, scale=1.0, fmt="{:.2f}"):
    v = delta.get(key)
    return "-" if v is None or not n else fmt.format(v / n / scale)


def rotational(out, config):
    flags = []
    i = 0
    while os.path.exists(os.path.join(out, f"{config}-osd{i}.metadata.json")):
        try:
            with open(os.path.join(out, f"{config}-osd{i}.metadata.json")) as f:
                flags.append(json.load(f).get("bluestore_bdev_rotational", "?"))
        except ValueError:
            flags.append("?")
        i += 1
    return flags


def osd_table(out, results):
    """Per workload and side: what one client request cost inside the OSDs."""
    rows = ["", "The OSDs' own counters per client request (`ceph daemon osd.N perf dump`, after "
            "minus before each run, summed over the OSDs; a client write is two OSD writes at "
            "replica 2). New-extent writes go to space BlueStore allocates for them (copy on "
            "write: its allocator hands such space out in address order, so they reach the "
            "device as a sequential stream); deferred writes are small writes BlueStore first puts in RocksDB's WAL "
            "and applies to the device later; WAL KiB is what BlueFS appended to that log; "
            "kv sync is the wait for one RocksDB commit (WAL write + device flush); "
            "op latency is the OSD's own time per client op:", "",
            "| workload | side | client IOs | new-extent writes / IO | deferred writes / IO "
            "| WAL KiB / IO "
            "| kv sync (ms) | kv flush (ms) | commit (ms) | OSD write op lat (ms) "
            "| OSD read op lat (ms) |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    found = False
    for r in results:
        for side, config in (("baseline", "bare"), ("cached", "cached")):
            d = perf_delta(out, config, r["workload"])
            if d is None:
                continue
            found = True
            n = (r["baseline"] if config == "bare" else r["cached"])["ios"]
            r.setdefault("osd_perf", {})[side] = {k: v for k, v in d.items() if k.startswith(
                ("bluestore.deferred", "bluestore.kv_", "bluestore.bluestore_write", "bluestore.commit_lat", "bluefs.bytes_written",
                 "osd.op_w", "osd.op_r", "osd.subop_w"))}
            rows.append(
                f"| {r['label']} | {side} | {n} "
                f"| {per(d, 'bluestore.bluestore_write_new', n)} "
                f"| {per(d, 'bluestore.deferred_write_ops', n)} "
                f"| {per(d, 'bluefs.bytes_written_wal', n, 1024.0, '{:.1f}')} "
                f"| {avg_ms(d, 'bluestore.kv_sync_lat')} | {avg_ms(d, 'bluestore.kv_flush_lat')} "
                f"| {avg_ms(d, 'bluestore.commit_lat')} | {avg_ms(d, 'osd.op_w_latency')} "
                f"| {avg_ms(d, 'osd.op_r_latency')} |")
    if not found:
        return []
    for side, config in (("baseline", "bare"), ("cached", "cached")):
        flags = rotational(out, config)
        if flags:
            rows.append("")
            rows.append(f"{side}: the OSDs saw their devices as rotational = "
                        f"{', '.join(flags)} (1: BlueStore's HDD defaults, deferred small writes).")
    return rows


def read_int(out, name):
    with open(os.path.join(out, name)) as f:
        return int(f.read())


def cpu_seconds(out, config, name):
    try:
        return read_int(out, f"{config}-{name}.cpu") / read_int(out, "clk_tck")
    except (OSError, ValueError):
        return None


def cpu_share(out, config, name):
    s = cpu_seconds(out, config, name)
    try:
        return None if s is None else 100.0 * s / read_int(out, "runtime") / read_int(out, "nproc")
    except (OSError, ValueError):
        return None


def machine_busy(out, config, name):
    """How busy the whole machine was during a run, in % of all its CPUs (/proc/stat)."""
    try:
        with open(os.path.join(out, f"{config}-{name}.machine")) as f:
            busy, total = (int(v) for v in f.read().split())
        return 100.0 * busy / total if total else None
    except (OSError, ValueError):
        return None


def client_seconds(out, config, name):
    """The fio client's CPU seconds (with librbd) during a run, if the run recorded them."""
    try:
        with open(os.path.join(out, f"{config}-{name}.client")) as f:
            return float(f.read())
    except (OSError, ValueError):
        return None


def cpu_parts_us(out, config, name, ios):
    """CPU µs per IO of the OSDs, hybridcache and nbdfuse apart, if the run recorded them."""
    try:
        with open(os.path.join(out, f"{config}-{name}.cpu-parts")) as f:
            parts = [int(v) for v in f.read().split()]
        tck = read_int(out, "clk_tck")
    except (OSError, ValueError):
        return None
    if len(parts) != 3 or not ios:
        return None
    return [p / tck / ios * 1e6 for p in parts]


def pct(v):
    return "-" if v is None else f"{v:.1f}"


def main():
    out = sys.argv[1]
    results = []
    lines = [
        "| workload | metric | baseline | cached | gain | study's gain | mean lat base/cached (ms) "
        "| p99 base/cached (ms) | OSD+cache CPU base/cached (% of machine) "
        "| machine busy base/cached (%) | CPU per IO cached (µs) | CPU ceiling (IOPS) "
        "| client CPU per IO cached (µs) | ceiling with the client here (IOPS) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, (label, study, metric) in STUDY.items():
        try:
            base, cached = fio(out, "bare", name), fio(out, "cached", name)
        except (OSError, ValueError, KeyError) as e:
            print(f"report: {name}: {e}", file=sys.stderr)
            continue
        key = "iops" if metric == "iops" else "mb_s"
        gain = cached[key] / base[key] if base[key] else float("inf")
        unit = "IOPS" if metric == "iops" else "MB/s"
        study_txt = "-" if study is None else (
            f"{study:.1f}x" if metric == "iops" else f"{(study - 1) * 100:+.1f}%")
        gain_txt = f"{gain:.1f}x" if metric == "iops" else f"{(gain - 1) * 100:+.1f}%"
        cb, cc = cpu_share(out, "bare", name), cpu_share(out, "cached", name)
        mb, mc = machine_busy(out, "bare", name), machine_busy(out, "cached", name)
        # The OSDs' and hybridcache's CPU time per request: with every core of the machine
        # given to them, this is the most IOPS the cached cluster could do here.
        cs = cpu_seconds(out, "cached", name)
        per_io = cs / cached["ios"] * 1e6 if cs and cached["ios"] else None
        try:
            ceiling = read_int(out, "nproc") * 1e6 / per_io if per_io else None
        except (OSError, ValueError):
            ceiling = None
        # The fio client (librbd) runs on this machine too; the study's clients did not. With
        # its CPU counted as well, this is the most IOPS this one machine could do.
        ccs = client_seconds(out, "cached", name)
        client_per_io = ccs / cached["ios"] * 1e6 if ccs is not None and cached["ios"] else None
        try:
            with_client = (read_int(out, "nproc") * 1e6 / (per_io + client_per_io)
                           if per_io and client_per_io is not None else None)
        except (OSError, ValueError):
            with_client = None
        lines.append(
            f"| {label} | {unit} | {base[key]:.0f} | {cached[key]:.0f} | {gain_txt} | {study_txt} "
            f"| {base['mean_us'] / 1e3:.1f} / {cached['mean_us'] / 1e3:.1f} "
            f"| {base['p99_us'] / 1e3:.1f} / {cached['p99_us'] / 1e3:.1f} "
            f"| {pct(cb)} / {pct(cc)} | {pct(mb)} / {pct(mc)} | {pct(per_io)} | "
            f"{'-' if ceiling is None else f'{ceiling:.0f}'} | {pct(client_per_io)} | "
            f"{'-' if with_client is None else f'{with_client:.0f}'} |")
        results.append({"workload": name, "label": label, "metric": unit, "baseline": base,
                        "cached": cached, "gain": gain, "study_gain": study,
                        "cpu_pct": {"baseline": cb, "cached": cc}, "cpu_us_per_io": per_io,
                        "machine_busy_pct": {"baseline": mb, "cached": mc},
                        "client_cpu_us_per_io": client_per_io,
                        "ceiling_with_client_iops": with_client,
                        "cpu_ceiling_iops": ceiling,
                        "cache_stats": cache(out, name)})
    stats = ["", "Cache statistics per OSD during each cached run (dirty % at the end, read hit "
             "ratio, share of requests cut off to the core, share of the OSD device's writes the "
             "sequential detector saw as part of a stream past the cutoff threshold):", "",
             "| workload | OSD | dirty % | read hits % | cut off % | sequential writes % |",
             "|---|---|---|---|---|---|"]
    for r in results:
        for i, c in enumerate(r["cache_stats"]):
            stats.append(f"| {r['label']} | {i} | {pct(c['dirty_pct'])} | "
                         f"{pct(c['read_hit_pct'])} | {pct(c['cut_off_pct'])} | "
                         f"{pct(c.get('seq_write_pct'))} |")
    parts = ["", "CPU per IO by part (µs of CPU time per client IO: the OSDs; hybridcache, the "
             "cache daemon or, on the baseline, the bare-core server; nbdfuse, the device path "
             "this machine needs in place of a kernel NBD or ublk client; the fio client with "
             "librbd):", "",
             "| workload | side | OSDs | hybridcache | nbdfuse | client |",
             "|---|---|---|---|---|---|"]
    any_parts = False
    for r in results:
        for side, config in (("baseline", "bare"), ("cached", "cached")):
            ios = r[side]["ios"]
            p = cpu_parts_us(out, config, r["workload"], ios)
            if p is None:
                continue
            any_parts = True
            c = client_seconds(out, config, r["workload"])
            client = c / ios * 1e6 if c is not None and ios else None
            r.setdefault("cpu_parts_us_per_io", {})[side] = {
                "osds": p[0], "hybridcache": p[1], "nbdfuse": p[2], "client": client}
            parts.append(f"| {r['label']} | {side} | {p[0]:.0f} | {p[1]:.0f} | {p[2]:.0f} | "
                         f"{'-' if client is None else f'{client:.0f}'} |")
    if any_parts:
        stats += parts
    stats += osd_table(out, results)
    try:
        with open(os.path.join(out, "preconditioned")) as f:
            stats += ["", f"Images preconditioned before the workloads on both sides: {f.read().strip()}."]
    except OSError:
        pass
    text = "\n".join(lines + stats) + "\n"
    print(text)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write("# Ceph on hybridcache: the study's workloads, baseline against cached\n\n" + text)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("report: no matplotlib (make ceph-deps installs it): no chart", file=sys.stderr)
        return
    labels = [r["label"] for r in results]
    ours = [r["gain"] for r in results]
    study = [r["study_gain"] or 0 for r in results]
    fig, ax = plt.subplots(figsize=(8, 4))
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], ours, 0.4, label="hybridcache (this run)")
    ax.bar([x + 0.2 for x in xs], study, 0.4, label="Open CAS (the study)")
    ax.set_yscale("log")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("cached / baseline (log)")
    ax.set_title("Ceph OSDs on a cached HDD: gain over the bare HDD")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "ceph-gains.png"), dpi=100)
    print(f"chart: {os.path.join(out, 'ceph-gains.png')}")


if __name__ == "__main__":
    main()
