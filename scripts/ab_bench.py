#!/usr/bin/env python3
"""Time two (or more) builds of adag-bench against each other, alternating.

    python3 scripts/ab_bench.py echo/ 6 old=/tmp/old-target/release/adag-bench \
        new=target/release/adag-bench

Each round runs `adag-bench --filter FILTER --iters ITERS --json ..` of every build in turn
(so a host that drifts between two speeds drifts under all of them), prints the round's p50s,
and at the end the median p50 per row and build. Build the old one from a worktree:
`git worktree add /tmp/old REV && (cd /tmp/old && CARGO_TARGET_DIR=/tmp/old-target cargo
build --release -p adag-bench)`.
"""
import argparse
import json
import os
import statistics
import subprocess
import tempfile


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("filter", help="adag-bench --filter (a substring of `workload/placement`)")
    p.add_argument("rounds", type=int, help="alternating rounds")
    p.add_argument("builds", nargs="+", help="NAME=PATH of an adag-bench binary")
    p.add_argument("--iters", default="300000", help="adag-bench --iters (default 300000)")
    args = p.parse_args()
    builds = [b.split("=", 1) for b in args.builds]
    p50s = {name: {} for name, _ in builds}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "round.json")
        for _ in range(args.rounds):
            line = []
            for name, binary in builds:
                subprocess.run(
                    [binary, "--filter", args.filter, "--iters", args.iters, "--json", out],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True,
                )
                rows = json.load(open(out))["results"]
                for row in rows:
                    p50s[name].setdefault(row["key"], []).append(row["p50_us"])
                line.append(name + " " + " ".join(f"{r['key']}={r['p50_us']:.3f}" for r in rows))
            print(" | ".join(line), flush=True)
    for name, _ in builds:
        medians = {key: round(statistics.median(v), 3) for key, v in p50s[name].items()}
        print(name, "median p50 µs:", medians)


if __name__ == "__main__":
    main()
