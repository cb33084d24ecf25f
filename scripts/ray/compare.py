#!/usr/bin/env python3
"""Measure adag and Ray Compiled Graphs in the same run, side by side.

Runs R rounds (default 3), each round one `adag-bench --json` and one
`scripts/ray/workloads.py --json` (followed by `scripts/ray/hosts.py --json`, the cross-host
rows on a local Ray cluster of four nodes, unless `--no-hosts`), alternating which system goes
first, so that both see the same background load. Takes the median over rounds of every figure of every workload, prints a
table with ratios, and writes docs/benchmarks.json and docs/benchmarks.png.

    bash scripts/ray/setup.sh                                 # once: target/ray-venv
    cargo build --release -p adag-bench
    target/ray-venv/bin/python scripts/ray/compare.py          # 3 rounds
    target/ray-venv/bin/python scripts/ray/compare.py --rounds 1 --quick --out-dir /tmp/cmp

Ratios are adag / Ray. For latency (p50, p99) lower is better, so a ratio below 1 means
adag is faster. For throughput and GB/s higher is better, so a ratio above 1 means adag is
faster. Without Ray (no venv, or `import ray` fails) it measures adag alone and says so.

adag's Python package (`python/`, installed in target/py-venv by `.ci/run` or
`pip install ./python`) runs the same Python workloads (`workloads.py --system adag`) in every
round too, and gets a second table beside Ray (both in Python): `--py-python` names its
interpreter, `--no-py` skips it. The torch rows of that table (`torch_echo_100MiB`,
`intermediate_tensors`, with and without `with_tensor_transport()`) are also printed against
the numpy row of the same bytes, per system.
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
FIELDS = ("p50_us", "p99_us", "throughput_per_s", "gb_per_s")


def run_json(cmd, label, timeout):
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
        path = fh.name
    try:
        print(f"[{label}] {' '.join(cmd)}", file=sys.stderr, flush=True)
        subprocess.run(cmd + ["--json", path], cwd=ROOT, check=True, timeout=timeout, stdout=subprocess.DEVNULL)
        with open(path) as fh:
            return json.load(fh)
    finally:
        os.unlink(path)


def run_ray(cmds, label, timeout):
    """Runs each Ray runner in turn; one report with all their rows."""
    report = None
    for i, cmd in enumerate(cmds):
        rep = run_json(cmd, f"{label} ({i + 1}/{len(cmds)})", timeout)
        if report is None:
            report = rep
        else:
            report["results"] += rep["results"]
    return report


def median_rows(reports):
    """Median over rounds of every numeric field, per workload key; keeps first-seen order."""
    order, by_key = [], {}
    for rep in reports:
        for row in rep["results"]:
            if row["key"] not in by_key:
                order.append(row["key"])
                by_key[row["key"]] = []
            by_key[row["key"]].append(row)
    out = {}
    for key in order:
        rows = by_key[key]
        med = dict(rows[0])
        for f in FIELDS:
            vals = [r[f] for r in rows if r.get(f) is not None]
            med[f] = statistics.median(vals) if vals else None
        med["rounds"] = len(rows)
        out[key] = med
    return out


def ray_available(python):
    if not os.path.exists(python):
        return f"{python} does not exist (run scripts/ray/setup.sh)"
    r = subprocess.run([python, "-c", "import ray, numpy; from ray.dag import InputNode"], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`import ray` failed in {python}: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}"
    return None


def adag_python_available(python):
    if not os.path.exists(python):
        return f"{python} does not exist (pip install ./python into a venv there, as .ci/run does)"
    r = subprocess.run([python, "-c", "import adag._native, numpy"], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`import adag._native` failed in {python}"
    return None


def fmt(v, digits=None):
    if v is None:
        return "-"
    if digits is not None:
        return f"{v:.{digits}f}"
    if v >= 10_000:
        return f"{v:,.0f}"
    if v >= 100:
        return f"{v:.1f}"
    return f"{v:.2f}"


def fmt_ratio(v):
    if v is None:
        return "-"
    return f"{v:.3g}" if v < 1000 else f"{v:,.0f}"


def ratio(a, b):
    if a is None or b is None or b == 0:
        return None
    return a / b


def table(adag, ray, name="adag"):
    keys = list(adag) + [k for k in ray if k not in adag]
    header = ["workload", f"{name} p50 µs", "Ray p50 µs", f"p50 {name}/Ray", f"{name} p99 µs", "Ray p99 µs",
              f"{name} /s", "Ray /s", f"/s {name}/Ray", f"{name} GB/s", "Ray GB/s"]
    rows = []
    for k in keys:
        a, r = adag.get(k, {}), ray.get(k, {})
        na = lambda d: "n/a" if d.get("note", "").startswith("n/a") else "-"  # noqa: E731
        rows.append([
            k,
            fmt(a.get("p50_us")) if a.get("p50_us") is not None else na(a),
            fmt(r.get("p50_us")) if r.get("p50_us") is not None else na(r), fmt_ratio(ratio(a.get("p50_us"), r.get("p50_us"))),
            fmt(a.get("p99_us")), fmt(r.get("p99_us")),
            fmt(a.get("throughput_per_s")), fmt(r.get("throughput_per_s")),
            fmt_ratio(ratio(a.get("throughput_per_s"), r.get("throughput_per_s"))),
            fmt(a.get("gb_per_s")), fmt(r.get("gb_per_s")),
        ])
    width = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    lines = ["| " + " | ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, width))) + " |",
             "|" + "|".join("-" * (w + 2) if i == 0 else "-" * (w + 1) + ":" for i, w in enumerate(width)) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, width))) + " |")
    return "\n".join(lines)


def targets(adag, ray, py):
    """The ratios the speed targets are read from, all from this run: transform of 100 MiB
    (every byte written once) against Ray's and against the memory-bandwidth bound measured
    beside it, echo against the ping-pong floors, Python echo against Ray's."""
    def get(d, key, field):
        return (d.get(key) or {}).get(field)

    def line(what, value, goal, unit="x"):
        if value is None:
            return f"- {what}: not measured"
        ok = "met" if goal(value) else "not met"
        shown = f"{value * 100:.0f}%" if unit == "%" else f"{value:.2f}{unit}"
        return f"- {what}: {shown} ({ok})"

    lent = get(adag, "transform_lent_100MiB/process", "gb_per_s")
    return "\n".join([
        line("transform 100 MiB, adag (made in place) / Ray, GB/s",
             ratio(lent, get(ray, "transform_100MiB/process", "gb_per_s")), lambda v: v >= 2),
        line("transform 100 MiB, adag (made in place) / memory bound (membw_xor_100MiB)",
             ratio(lent, get(adag, "membw_xor_100MiB/driver", "gb_per_s")), lambda v: v >= 0.7, "%"),
        line("echo/thread p50 / floor_pingpong/thread",
             ratio(get(adag, "echo/thread", "p50_us"), get(adag, "floor_pingpong/thread", "p50_us")),
             lambda v: v <= 2),
        line("echo/process p50 / floor_pingpong/process",
             ratio(get(adag, "echo/process", "p50_us"), get(adag, "floor_pingpong/process", "p50_us")),
             lambda v: v <= 2.5),
        line("Python echo: Ray p50 / adag-py p50",
             ratio(get(ray, "echo/process", "p50_us"), get(py, "echo/process", "p50_us")),
             lambda v: v >= 40),
        line("Python asyncio echo: Ray p50 / adag-py p50",
             ratio(get(ray, "async_echo/process", "p50_us"), get(py, "async_echo/process", "p50_us")),
             lambda v: v >= 40),
    ])


#: torch rows of workloads.py and the numpy row of the same bytes each is read against.
TENSOR_ROWS = [
    ("torch_echo_100MiB", "payload_100MiB"),
    ("torch_echo_100MiB_transport", "payload_100MiB"),
    ("intermediate_tensors", "intermediate_numpy"),
    ("intermediate_tensors_transport", "intermediate_numpy"),
]


def tensor_lines(py, ray):
    """torch CPU tensors against numpy arrays of the same size, per system, from this run:
    p50 of the tensor row / p50 of the numpy row (1 = as fast; `_transport`: with
    `with_tensor_transport()`)."""
    lines = []
    for name, rows in (("adag-py", py), ("Ray", ray)):
        for tensor, numpy in TENSOR_ROWS:
            t, n = rows.get(f"{tensor}/process") or {}, rows.get(f"{numpy}/process") or {}
            if not t and not n:
                continue
            r = ratio(t.get("p50_us"), n.get("p50_us"))
            shown = t.get("note", "-") if t.get("p50_us") is None else f"{fmt(t.get('p50_us'))} µs"
            lines.append(f"- {name} {tensor}: {shown} against {numpy} {fmt(n.get('p50_us'))} µs "
                         f"(ratio {fmt_ratio(r)})")
    return "\n".join(lines) if lines else "- not measured"


def plot(adag, ray, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lat_keys = [k for k in adag if adag[k].get("p50_us") is not None or (ray.get(k) or {}).get("p50_us") is not None]
    lat_keys += [k for k in ray if k not in adag and ray[k].get("p50_us") is not None]
    thr_keys = [k for k in lat_keys if "_pipe" in k]
    fig, axes = plt.subplots(2, 1, figsize=(14, 10), gridspec_kw={"height_ratios": [3, 1.4]})
    ax = axes[0]
    w = 0.4
    xs = range(len(lat_keys))
    for off, label, d, color in ((-w / 2, "adag", adag, "tab:blue"), (w / 2, "Ray Compiled Graphs", ray, "tab:orange")):
        p50 = [(d.get(k) or {}).get("p50_us") for k in lat_keys]
        p99 = [(d.get(k) or {}).get("p99_us") for k in lat_keys]
        bx = [x + off for x, v in zip(xs, p50) if v is not None]
        ax.bar(bx, [v for v in p50 if v is not None], w, label=f"{label} p50", color=color)
        px = [x + off for x, v in zip(xs, p99) if v is not None]
        ax.scatter(px, [v for v in p99 if v is not None], marker="_", s=120, color="black", zorder=3,
                   label="p99" if label == "adag" else None)
        for x, k, v in zip(xs, lat_keys, p50):
            if v is None and k in d:
                ax.annotate("n/a", (x + off, 0.02), xycoords=("data", "axes fraction"), ha="center", fontsize=7, rotation=90)
    ax.set_yscale("log")
    ax.set_ylabel("latency per execution, µs (log)")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(lat_keys, rotation=45, ha="right", fontsize=8)
    ax.set_title(title)
    ax.grid(axis="y", which="both", alpha=0.3)
    ax.legend()
    ax = axes[1]
    xs = range(len(thr_keys))
    for off, label, d, color in ((-w / 2, "adag", adag, "tab:blue"), (w / 2, "Ray Compiled Graphs", ray, "tab:orange")):
        vals = [(d.get(k) or {}).get("throughput_per_s") for k in thr_keys]
        if any(v is not None for v in vals):
            ax.bar([x + off for x, v in zip(xs, vals) if v is not None], [v for v in vals if v is not None], w, label=label, color=color)
        for x, k, v in zip(xs, thr_keys, vals):
            if v is None and k in d:
                ax.annotate("n/a", (x + off, 0.02), xycoords=("data", "axes fraction"), ha="center", fontsize=7, rotation=90)
    # A lone bar would otherwise be stretched over the whole axis.
    ax.set_xlim(-0.75, len(thr_keys) - 0.25)
    ax.set_yscale("log")
    ax.set_ylabel("executions/s (log)")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(thr_keys, fontsize=8)
    ax.set_title("pipelined throughput (higher is better)")
    ax.grid(axis="y", which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of each system (default 3)")
    p.add_argument("--quick", action="store_true", help="pass --quick to both runners")
    p.add_argument("--filter", help="pass --filter to both runners")
    p.add_argument("--adag-bin", default=os.path.join(ROOT, "target", "release", "adag-bench"))
    p.add_argument("--adag-args", default="", help="extra arguments of adag-bench (e.g. '--iters 20000')")
    p.add_argument("--ray-python", default=os.path.join(ROOT, "target", "ray-venv", "bin", "python"))
    p.add_argument("--ray-args", default="", help="extra arguments of workloads.py (e.g. '--iters 2000')")
    p.add_argument("--no-ray", action="store_true", help="measure adag only")
    p.add_argument("--no-hosts", action="store_true", help="skip Ray's cross-host runner (scripts/ray/hosts.py)")
    p.add_argument("--py-python", default=os.path.join(ROOT, "target", "py-venv", "bin", "python"),
                   help="the interpreter with adag's Python package (python/)")
    p.add_argument("--no-py", action="store_true", help="do not measure adag's Python package")
    p.add_argument("--out-dir", default=os.path.join(ROOT, "docs"), help="where benchmarks.json/.png go (default docs/)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds one runner may take")
    args = p.parse_args()

    if not os.path.exists(args.adag_bin):
        sys.exit(f"{args.adag_bin} is missing: cargo build --release -p adag-bench")
    ray_missing = "--no-ray given" if args.no_ray else ray_available(args.ray_python)
    if ray_missing:
        print(f"Ray is not measured: {ray_missing}", file=sys.stderr)
    common = (["--quick"] if args.quick else []) + (["--filter", args.filter] if args.filter else [])
    adag_cmd = [args.adag_bin] + common + args.adag_args.split()
    ray_cmd = [args.ray_python, os.path.join(ROOT, "scripts", "ray", "workloads.py")] + common + args.ray_args.split()
    # A filter naming the cross-host rows selects nothing of workloads.py (its rows are all
    # `/process`), and one naming a placement of this host nothing of hosts.py.
    only_hosts = args.filter is not None and "hosts" in args.filter
    ray_cmds = [] if only_hosts else [ray_cmd]
    wants_hosts = not args.no_hosts and (args.filter is None or only_hosts or args.filter in "/hosts")
    if wants_hosts:
        ray_cmds.append([args.ray_python, os.path.join(ROOT, "scripts", "ray", "hosts.py")] + common
                        + args.ray_args.split())

    py_missing = ("--no-py given" if args.no_py else
                  "the cross-host rows have no Python counterpart" if only_hosts else
                  adag_python_available(args.py_python))
    if py_missing:
        print(f"adag's Python package is not measured: {py_missing}", file=sys.stderr)
    py_cmd = [args.py_python, os.path.join(ROOT, "scripts", "ray", "workloads.py"), "--system", "adag"] + common \
        + args.ray_args.split()

    adag_reports, ray_reports, py_reports = [], [], []
    for r in range(args.rounds):
        steps = [("adag", adag_cmd, adag_reports)]
        if not py_missing:
            steps.append(("adag-python", py_cmd, py_reports))
        if not ray_missing:
            steps.append(("ray", ray_cmds, ray_reports))
        if r % 2 == 1:
            steps.reverse()
        for name, cmd, sink in steps:
            label = f"round {r + 1}/{args.rounds} {name}"
            if name == "ray":
                sink.append(run_ray(cmd, label, args.timeout))
            else:
                sink.append(run_json(cmd, label, args.timeout))

    adag = median_rows(adag_reports)
    ray = median_rows(ray_reports) if ray_reports else {}
    py = median_rows(py_reports) if py_reports else {}
    print(table(adag, ray))
    if py:
        print("\nadag's Python package (python/) against Ray, both driven from Python by the same "
              "workloads.py:\n")
        print(table(py, ray, "adag-py"))
    for name, reps in (("adag", adag_reports), ("adag-py", py_reports), ("Ray", ray_reports)):
        loads = ", ".join(f"{r.get('load_before', [float('nan')])[0]:.2f}→{r.get('load_after', [float('nan')])[0]:.2f}" for r in reps)
        if loads:
            print(f"1-min load average per {name} round (before→after): {loads}")
    leaks = [r.get("leaked_dev_shm_files") for r in ray_reports if r.get("leaked_dev_shm_files")]
    if leaks:
        print(f"Ray left {', '.join(map(str, leaks))} sem.* files in /dev/shm per round (workloads.py removed them)")
    print("\nSpeed targets (docs/benchmarks.md), from this run:")
    print(targets(adag, ray, py))
    print("\ntorch CPU tensors against numpy arrays of the same bytes (p50; ratio 1 = as fast):")
    print(tensor_lines(py, ray))
    print("\nratios are adag / Ray: for p50 lower is better (below 1: adag faster); "
          "for /s higher is better (above 1: adag faster). Medians of "
          f"{args.rounds} alternating round(s).")

    machine = adag_reports[0]["machine"]
    os.makedirs(args.out_dir, exist_ok=True)
    out = {
        "generated": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "rounds": args.rounds,
        "quick": args.quick,
        "machine": machine | {"python": platform.python_version()},
        "adag_command": " ".join(adag_cmd),
        "ray_command": None if ray_missing else " && ".join(" ".join(c) for c in ray_cmds),
        "ray_version": ray_reports[0]["version"] if ray_reports else None,
        "ray_missing": ray_missing,
        "ratio_convention": "adag / Ray; latency: lower is better; throughput and GB/s: higher is better",
        "adag": adag,
        "adag_python": py,
        "adag_python_command": None if py_missing else " ".join(py_cmd),
        "ray": ray,
        "ratios": {
            k: {
                "p50": ratio(adag[k].get("p50_us"), ray[k].get("p50_us")),
                "p99": ratio(adag[k].get("p99_us"), ray[k].get("p99_us")),
                "throughput": ratio(adag[k].get("throughput_per_s"), ray[k].get("throughput_per_s")),
            }
            for k in adag
            if k in ray
        },
        "python_ratios": {
            k: {
                "p50": ratio(py[k].get("p50_us"), ray[k].get("p50_us")),
                "p99": ratio(py[k].get("p99_us"), ray[k].get("p99_us")),
                "throughput": ratio(py[k].get("throughput_per_s"), ray[k].get("throughput_per_s")),
                "gb_per_s": ratio(py[k].get("gb_per_s"), ray[k].get("gb_per_s")),
            }
            for k in py
            if k in ray
        },
        "rounds_raw": {"adag": adag_reports, "adag_python": py_reports, "ray": ray_reports},
    }
    json_path = os.path.join(args.out_dir, "benchmarks.json")
    with open(json_path, "w") as fh:
        json.dump(out, fh, indent=2)
        fh.write("\n")
    print(f"wrote {json_path}", file=sys.stderr)
    try:
        png = os.path.join(args.out_dir, "benchmarks.png")
        who = "adag vs Ray Compiled Graphs " + (out["ray_version"] or "") if ray else "adag (Ray not measured)"
        plot(adag, ray, png, f"{who}: p50 bars, p99 ticks, log scale (lower is better); "
                             f"{machine['cpus']} vCPU {machine['cpu_model']}, median of {args.rounds}")
        print(f"wrote {png}", file=sys.stderr)
    except ImportError as e:
        print(f"no plot: {e} (install matplotlib, or use target/ray-venv/bin/python)", file=sys.stderr)


if __name__ == "__main__":
    main()
