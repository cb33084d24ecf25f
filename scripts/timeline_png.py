#!/usr/bin/env python3
"""Draw an adag timeline (the Chrome-trace JSON of `CompiledGraph::write_timeline` or
`ADAG_TIMELINE=path`) as a PNG: one row per actor, one bar per operation, coloured by kind
(read, compute, write, comm), with the execution index written on compute bars.

    python3 scripts/timeline_png.py demo.json docs/timeline.png --from-exec 100 --execs 6

A whole run holds far too many operations for one picture: pick a window of executions.
Needs matplotlib (`pip install matplotlib`).
"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

COLOURS = {"read": "#7fb3d5", "compute": "#e67e22", "write": "#82c785", "comm": "#af7ac5"}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json")
    ap.add_argument("png")
    ap.add_argument("--from-exec", type=int, default=None, help="first execution to draw (default: the middle of the run)")
    ap.add_argument("--execs", type=int, default=5, help="how many executions to draw")
    ap.add_argument("--title", default="adag timeline")
    args = ap.parse_args()

    with open(args.json) as f:
        trace = json.load(f)
    events = trace["traceEvents"]
    names = {}
    for e in events:
        if e["ph"] == "M" and e["name"] == "thread_name":
            names[(e["pid"], e["tid"])] = e["args"]["name"]
    slices = [e for e in events if e["ph"] == "X"]
    if not slices:
        raise SystemExit("no operations in the timeline (was it recorded?)")
    last = max(e["args"]["exec"] for e in slices)
    first = args.from_exec if args.from_exec is not None else max(0, last // 2)
    window = [e for e in slices if first <= e["args"]["exec"] < first + args.execs]
    if not window:
        raise SystemExit(f"no operations of executions {first}..{first + args.execs}")
    t0 = min(e["ts"] for e in window)

    # Tracks in the order of their first operation: the pipeline reads top to bottom.
    tracks = []
    for e in sorted(window, key=lambda e: e["ts"]):
        key = (e["pid"], e["tid"])
        if key not in tracks:
            tracks.append(key)
    fig, ax = plt.subplots(figsize=(13, 1.1 + 0.75 * len(tracks)))
    for row, key in enumerate(tracks):
        for e in (e for e in window if (e["pid"], e["tid"]) == key):
            x, w = e["ts"] - t0, max(e["dur"], 0.02)
            ax.barh(row, w, left=x, height=0.6, color=COLOURS.get(e["cat"], "#999999"), edgecolor="black", linewidth=0.3)
            if e["cat"] == "compute":
                ax.text(x + w / 2, row, str(e["args"]["exec"]), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(tracks)))
    ax.set_yticklabels([f"{names.get(k, k[1])}\npid {k[0]}" for k in tracks], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("microseconds (CLOCK_MONOTONIC, one clock for every process)")
    ax.set_title(f"{args.title}: executions {first}..{first + args.execs - 1} (numbers on compute bars)")
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLOURS.items()], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.grid(axis="x", linestyle=":", linewidth=0.5)
    fig.tight_layout()
    fig.savefig(args.png, dpi=130)
    print(f"wrote {args.png}: {len(window)} operations of {len(tracks)} actors")


if __name__ == "__main__":
    main()
