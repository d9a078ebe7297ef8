#!/usr/bin/python3
"""Plots tokens/s versus batch size from vroll_engine_bench's throughput.csv."""
import csv
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator, ScalarFormatter  # noqa: E402

src, dst = sys.argv[1], sys.argv[2]
series = defaultdict(list)
with open(src) as f:
    for row in csv.DictReader(f):
        decode = row.get("decode_tokens_per_s")  # absent from CSVs of older builds
        series[row["model"]].append((int(row["batch"]), float(row["tokens_per_s"]),
                                     float(decode) if decode else None))
fig, ax = plt.subplots(figsize=(6.5, 4.5))
for model, points in series.items():
    points.sort()
    line, = ax.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                    label=f"{model}: whole run")
    if all(p[2] is not None for p in points):
        ax.plot([p[0] for p in points], [p[2] for p in points], marker="x", linestyle="--",
                color=line.get_color(), label=f"{model}: decode steps only")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xticks(sorted({p[0] for points in series.values() for p in points}))  # the batch sizes run
ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
ax.xaxis.set_minor_locator(NullLocator())
# Every 1-2-5 value labelled: a log axis labels only powers of 10 by default.
ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
ax.yaxis.set_major_formatter(ScalarFormatter())
ax.yaxis.set_minor_formatter(plt.NullFormatter())
ax.set_xlabel("batch size (sequences)")
ax.set_ylabel("generated tokens/s")
ax.set_title("vroll throughput vs batch size")
ax.grid(True, which="both", alpha=0.3)
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(dst, dpi=120)
print(f"wrote {dst}")
