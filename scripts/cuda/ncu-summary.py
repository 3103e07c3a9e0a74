#!/usr/bin/env python3
"""Sums the kernel time of an `ncu --metrics gpu__time_duration.sum --print-summary per-kernel`
log by kernel name (average x invocations over every launch shape), largest first.
Usage: scripts/cuda/ncu-summary.py NCU_LOG [DIVISOR]  (DIVISOR: e.g. steps profiled, to print per-step figures)"""
import re
import sys
from collections import defaultdict

text = open(sys.argv[1]).read()
divisor = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
totals, launches = defaultdict(float), defaultdict(int)
pattern = re.compile(r"^  (\S+) \(.*Invocations (\d+)\n(?:.*\n)*?\s+gpu__time_duration\.sum\s+(\w+)\s+\S+\s+\S+\s+(\S+)", re.M)
scale = {"ns": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6}
for name, count, unit, average in pattern.findall(text):
    totals[name] += int(count) * float(average.replace(",", "")) * scale[unit]
    launches[name] += int(count)
grand = sum(totals.values())
print(f"{'kernel':<48} {'ms':>10} {'share':>7} {'launches':>9}")
for name, us in sorted(totals.items(), key=lambda kv: -kv[1]):
    print(f"{name:<48} {us / 1e3 / divisor:>10.3f} {us / grand:>7.1%} {launches[name] / divisor:>9.0f}")
print(f"{'total':<48} {grand / 1e3 / divisor:>10.3f} {'':>7} {sum(launches.values()) / divisor:>9.0f}")
