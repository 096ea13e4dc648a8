#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Runs benchmark programs several times, interleaved, and prints the spread of their figures.

The machine is shared and noisy: one run says little, the best run says less. This runs each
program (e.g. a baseline build and this build) `--runs` times, alternating, and prints for every
table row and chosen column the min / median / max over the runs of that run's figure (each
benchmark already prints a median per row).

  bench/spread.py --runs 10 --cols 0 -- old=/tmp/base/build/bench/allreduce_bench new=build/bench/allreduce_bench

A row is a line with '|' whose first field starts with a digit (its key, e.g. " 2    16M"), or a
Markdown table row ("| 16777216 | ... |", the key its first cell); --cols picks numbers after the
key, counted from 0 (e.g. 0 = the first figure).
"""
import argparse
import re
import statistics
import subprocess
import sys

NUM = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?|nan")


def rows(text):
    out = {}
    for line in text.splitlines():
        if "|" not in line:
            continue
        # A Markdown row starts with the separator: its key is the first cell.
        key, _, rest = line.lstrip()[1:].partition("|") if line.lstrip().startswith("|") else line.partition("|")
        key = " ".join(key.split())
        if not key or not key[0].isdigit():
            continue
        out[key] = [float(x) for x in NUM.findall(rest)]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--cols", default="0", help="comma-separated column indices")
    ap.add_argument("--rows", default="", help="comma-separated row keys to keep (default: all)")
    ap.add_argument("programs", nargs="+", help="label=command (command split on spaces)")
    args = ap.parse_args()
    cols = [int(c) for c in args.cols.split(",")]
    keep = [" ".join(r.split()) for r in args.rows.split(",") if r]
    progs = [p.split("=", 1) for p in args.programs]
    figures = {label: {} for label, _ in progs}
    for run in range(args.runs):
        for label, cmd in progs:
            text = subprocess.run(cmd.split(), capture_output=True, text=True, check=True).stdout
            for key, values in rows(text).items():
                if keep and key not in keep:
                    continue
                for c in cols:
                    if c < len(values):
                        figures[label].setdefault((key, c), []).append(values[c])
        print(f"run {run + 1}/{args.runs} done", file=sys.stderr)
    labels = [label for label, _ in progs]
    print(f"{'row':>10} {'col':>4} | " + " | ".join(f"{l + ' min / median / max':>32}" for l in labels)
          + (f" | {'median ' + labels[-1] + '/' + labels[0]:>14}" if len(labels) > 1 else ""))
    for key, c in figures[labels[0]]:
        cells, meds = [], []
        for l in labels:
            v = figures[l].get((key, c), [])
            if not v:
                cells.append(f"{'-':>32}")
                meds.append(float("nan"))
                continue
            meds.append(statistics.median(v))
            cells.append(f"{min(v):>10.2f} / {statistics.median(v):>9.2f} / {max(v):>9.2f}")
        ratio = f" | {meds[-1] / meds[0]:>14.2f}" if len(labels) > 1 and meds[0] else ""
        print(f"{key:>10} {c:>4} | " + " | ".join(cells) + ratio)


if __name__ == "__main__":
    main()
