#!/usr/bin/python3
"""Plots tokens/s versus batch size from vroll_engine_bench's throughput.csv."""
import csv
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

src, dst = sys.argv[1], sys.argv[2]
series = defaultdict(list)
with open(src) as f:
    for row in csv.DictReader(f):
        series[row["model"]].append((int(row["batch"]), float(row["tokens_per_s"])))
fig, ax = plt.subplots(figsize=(6, 4))
for model, points in series.items():
    points.sort()
    ax.plot([b for b, _ in points], [t for _, t in points], marker="o", label=model)
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("batch size (sequences)")
ax.set_ylabel("generated tokens/s")
ax.set_title("vroll decode throughput vs batch size")
ax.grid(True, which="both", alpha=0.3)
ax.legend()
fig.tight_layout()
fig.savefig(dst, dpi=120)
print(f"wrote {dst}")
