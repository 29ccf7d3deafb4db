#!/usr/bin/python3
"""Draws docs/charts/tail-rule-p9999.png, docs/charts/readahead.png and
docs/charts/offload-nhit.png from the tables of
docs/bench.md ("What the studies found, reproduced"), so the charts always show the figures the
text gives. Change a table, then run (Debian's python3 has matplotlib):

    /usr/bin/python3 docs/studies/charts.py
"""
import math
import os
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import LogNorm  # noqa: E402

DOCS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(DOCS, "bench.md")
OUT = os.path.join(DOCS, "charts")


def table_after(lines, marker):
    """The rows (lists of cells) of the first markdown table after the line that starts with
    `marker`; the header row first, the |---| row dropped."""
    start = next((i for i, l in enumerate(lines) if l.startswith(marker)), None)
    if start is None:
        sys.exit(f"docs/bench.md: no line starts with {marker!r}")
    rows = []
    for l in lines[start:]:
        if l.startswith("|"):
            cells = [c.strip() for c in l.strip().strip("|").split("|")]
            if not all(re.fullmatch(r":?-+:?", c) for c in cells):
                rows.append(cells)
        elif rows:
            break
    return rows


def num(cell):
    """'1,495' -> 1495.0, '2.11x' -> 2.11, '15.3' -> 15.3, '83.8k (79.5-98.1k)' -> 83800.0."""
    cell = cell.split(" (")[0].replace(",", "").rstrip("x")
    return float(cell[:-1]) * 1000 if cell.endswith("k") else float(cell)


def tail_rule(lines):
    mixes = [("randrw70", "70/30 read/write"), ("randrw30", "30/70 read/write")]
    grids = []
    for pat, _ in mixes:
        rows = table_after(lines, f"**{pat}, writes p99.99 ms**")
        header, ratio = rows[0], next(r for r in rows if r[0] == "wb / wt")
        cols = [tuple(int(x) for x in h.split("/")) for h in header[1:]]
        jobs = sorted({j for j, _ in cols})
        depths = sorted({d for _, d in cols})
        grid = [[math.nan] * len(depths) for _ in jobs]
        for (j, d), v in zip(cols, ratio[1:]):
            grid[jobs.index(j)][depths.index(d)] = num(v)
        grids.append((jobs, depths, grid))

    fig, axes = plt.subplots(1, 2, figsize=(8, 3.4), dpi=100, constrained_layout=True)
    # A log scale centred on 1: write-back better is blue, worse is red, 10x at the ends.
    norm = LogNorm(vmin=0.1, vmax=10)
    for ax, (pat, title), (jobs, depths, grid) in zip(axes, mixes, grids):
        im = ax.imshow(grid, cmap="RdBu_r", norm=norm, origin="lower")
        ax.set_xticks(range(len(depths)), [str(d) for d in depths])
        ax.set_yticks(range(len(jobs)), [str(j) for j in jobs])
        ax.set_xlabel("iodepth per job")
        ax.set_ylabel("jobs")
        ax.set_title(title, fontsize=10)
        for y, row in enumerate(grid):
            for x, v in enumerate(row):
                if not math.isnan(v):
                    # White on the dark ends of the scale, black in the pale middle.
                    dark = abs(math.log10(v)) > 0.6
                    ax.text(x, y, f"{v:.2f}x", ha="center", va="center", fontsize=9,
                            color="white" if dark else "black")
    cb = fig.colorbar(im, ax=axes, shrink=0.9)
    cb.set_label("write p99.99, wb / wt")
    fig.suptitle("Write-back's write tail against write-through, SSD array core "
                 "(> 1: wb worse)", fontsize=10)
    path = os.path.join(OUT, "tail-rule-p9999.png")
    fig.savefig(path)
    return path


def readahead(lines):
    rows = table_after(lines, "| pattern | nj/qd | core MB/s |")[1:]
    labels = [f"{'sequential' if r[0] == 'read' else 'random'}\nqd {r[1].split('/')[1]}"
              for r in rows]
    # The depth-8 pairs measured after the stream detector's fix, as their medians; those runs
    # had no core-alone cell, so that group has no core bar.
    fixed = table_after(lines, "| run | no read-ahead, MB/s |")[1:]
    med = lambda col: sorted(num(r[col]) for r in fixed)[len(fixed) // 2]  # noqa: E731
    rows.insert(2, ["read", "1/8", "nan", f"{med(1)}", f"{med(2)}"])
    labels.insert(2, "sequential\nqd 8, after\nthe fix")
    series = [("core alone", 2, "#888888"), ("cache, no read-ahead", 3, "#4878a8"),
              ("cache, read-ahead", 4, "#e07b39")]
    fig, ax = plt.subplots(figsize=(7, 3.4), dpi=100, constrained_layout=True)
    width = 0.27
    for i, (name, col, color) in enumerate(series):
        xs = [k + (i - 1) * width for k in range(len(rows))]
        vals = [num(r[col]) for r in rows]
        ax.bar(xs, vals, width, label=name, color=color)
        for x, v in zip(xs, vals):
            if not math.isnan(v):
                ax.text(x, v * 1.08, f"{v:g}", ha="center", va="bottom", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylim(top=ax.get_ylim()[1] * 2)
    ax.set_xticks(range(len(rows)), labels)
    ax.set_ylabel("MB/s (log)")
    ax.set_title("4 KiB reads from the emulated RAID 60, 256 MiB RAM cache", fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    path = os.path.join(OUT, "readahead.png")
    fig.savefig(path)
    return path


def offload_nhit(lines):
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6), dpi=100, constrained_layout=True)

    # Offload: IOPS per configuration, the RAM cache as it is and the capped one.
    ram = table_after(lines, "**The RAM cache as it is.**")[1:]
    capped = table_after(lines, "**The study's premise made true.**")[1:]
    groups = [("RAM cache", ram, [("offload off", "#4878a8"), ("on: 50%, threshold 1", "#e07b39"),
                                  ("fixed: 25%, threshold 0", "#b04040")]),
              ("capped at 15k IOPS", capped, [("offload off", "#4878a8"),
                                               ("on: 50%, threshold 1", "#e07b39")])]
    ticks, labels, seen = [], [], set()
    x = 0.0
    for title, rows, confs in groups:
        for pat in ("randread", "randrw70"):
            for i, (conf, color) in enumerate(confs):
                row = next(r for r in rows if r[0] == pat and r[1] == conf)
                v = num(row[3]) / 1000
                label = conf if conf not in seen else None
                seen.add(conf)
                left.bar(x + i * 0.8 / len(confs), v, 0.8 / len(confs), color=color, label=label,
                         align="edge")
                left.text(x + (i + 0.5) * 0.8 / len(confs), v + 1, f"{v:.0f}", ha="center",
                          va="bottom", fontsize=7)
            ticks.append(x + 0.4)
            labels.append(f"{pat}\n{title}")
            x += 1.2
    left.set_ylim(top=left.get_ylim()[1] * 1.08)
    left.set_xticks(ticks, labels, fontsize=7)
    left.set_ylabel("IOPS, thousands (median)")
    left.set_title("Offload, SSD array core, 4 jobs x depth 32", fontsize=10)
    left.legend(fontsize=7, loc="upper right")

    # nhit: always against nhit 2 at each skew, and with the capped cache device.
    cases = [("zipf 1.2", "### nhit threshold 2 against always"), ("zipf 0.8", "**zipf 0.8.**"),
             ("zipf 0.8, capped", "That is measured with the cache device capped")]
    for k, (name, marker) in enumerate(cases):
        rows = table_after(lines, marker)[1:]
        for i, (policy, color) in enumerate([("always", "#4878a8"),
                                             ("nhit, threshold 2", "#e07b39")]):
            v = num(next(r for r in rows if r[0] == policy)[1]) / 1000
            right.bar(k + (i - 0.5) * 0.38, v, 0.38, color=color, label=policy if k == 0 else None)
            right.text(k + (i - 0.5) * 0.38, v + 0.4, f"{v:.1f}", ha="center", va="bottom",
                       fontsize=7)
    right.set_ylim(top=right.get_ylim()[1] * 1.12)
    right.set_xticks(range(len(cases)), [c[0] for c in cases], fontsize=8)
    right.set_ylabel("IOPS, thousands (median)")
    right.set_title("nhit 2 against always, random reads, depth 16", fontsize=10)
    right.legend(fontsize=7, loc="upper right")
    path = os.path.join(OUT, "offload-nhit.png")
    fig.savefig(path)
    return path


if __name__ == "__main__":
    with open(BENCH) as f:
        lines = f.read().splitlines()
    for p in (tail_rule(lines), readahead(lines), offload_nhit(lines)):
        print(f"{p}: {os.path.getsize(p) // 1024} KiB")
