#!/usr/bin/env python3
"""adag and Ray Compiled Graphs on the same Ray cluster, in the same run, one table.

A local `ray.cluster_utils.Cluster` of a head node (the driver's) and three worker nodes on
this machine, every one bound to 127.0.0.1 (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 keeps Ray
from rewriting it): all traffic stays on loopback. On it:

- Ray Compiled Graphs: one actor per stage, pinned to its node (`NodeAffinitySchedulingStrategy`);
- adag: `adag.init(ray_address=...)` (Ray's connection of this process), an agent per worker
  node started by Ray, the same stages pinned the same way (by Ray node id).

Both systems' actors live side by side for the whole run; each workload runs on Ray, then on
adag, before the next one.

Workloads (those of `hosts.py` / adag-bench `*/hosts`): `echo` (one actor on another node),
`chain3` (one actor on each of the 3 worker nodes, one execution at a time), `chain3_pipe16`
(the same with 16 in flight), `payload_100MiB` (an echo of 100 MiB on another node; GB/s =
size / p50 round trip).

    target/py-venv/bin/python scripts/ray/on_ray.py            # needs ray and adag
    target/py-venv/bin/python scripts/ray/on_ray.py --quick --json /tmp/on-ray.json
"""

import os

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import datetime  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections import deque  # noqa: E402

import numpy as np  # noqa: E402
import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import adag  # noqa: E402
from workloads import Measured, expect, machine, runner_args, shm_files, timed  # noqa: E402

LOOPBACK = "127.0.0.1"
NS = time.perf_counter_ns


class Stage:
    def __init__(self, k):
        self.k = k

    def add(self, x):
        return x + self.k

    def echo(self, x):
        return x


SYSTEMS = {
    "ray": (ray.remote(num_cpus=0)(Stage), ray.dag.InputNode, ray.get),
    "adag": (adag.remote(Stage), adag.InputNode, adag.get),
}


def pipelined(get, dag, depth, warmup, iters, check):
    """Keep `depth` executions outstanding; latency per execution = submit -> result."""

    def run(n, m):
        q = deque()
        start = NS()
        for i in range(n):
            if len(q) == depth:
                j, t, r = q.popleft()
                check(j, get(r))
                if m:
                    m.samples.append(NS() - t)
            q.append((i, NS(), dag.execute(i)))
        while q:
            j, t, r = q.popleft()
            check(j, get(r))
            if m:
                m.samples.append(NS() - t)
        if m:
            m.elapsed_s = (NS() - start) / 1e9

    run(warmup, None)
    m = Measured()
    run(iters, m)
    return m


def main():
    args = runner_args(__doc__).parse_args()
    want = lambda k: args.filter is None or args.filter in k  # noqa: E731
    sync = args.iters or (100 if args.quick else 2000)
    warm = lambda n: min(max(n // 10, 3), 500)  # noqa: E731
    payload_bytes = (256 << 20) if args.quick else (2 << 30)
    rows = []
    shm_before = shm_files()
    started = time.time()
    load_before = list(os.getloadavg())
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "node_ip_address": LOOPBACK, "include_dashboard": False},
    )
    workers = [cluster.add_node(num_cpus=1, node_ip_address=LOOPBACK) for _ in range(3)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR")
    t = time.monotonic()
    adag.init(ray_address="auto")  # takes this process's Ray connection
    print(f"ray {ray.__version__}, adag {adag.__version__}: {len(ray.nodes())} Ray nodes on "
          f"{os.cpu_count()} CPU(s); adag's agents joined in {time.monotonic() - t:.2f} s",
          file=sys.stderr, flush=True)
    nodes = [w.node_id for w in workers]

    def push(system, workload, m, note):
        r = m.row(workload, note)
        r.update(key=f"{workload}/ray-nodes", placement="ray-nodes", system=system)
        if workload.startswith("payload_"):
            size = 100 << 20
            r["gb_per_s"] = size / (r["p50_us"] * 1e-6) / 1e9
            r["note"] = f"{r['gb_per_s']:.2f} GB/s"
        print(f"  {system:<5} {workload:<16} p50 {r['p50_us']:>10.1f} µs  {r['note']}",
              file=sys.stderr, flush=True)
        rows.append(r)

    try:
        def actors(system, ks):
            cls = SYSTEMS[system][0]
            out = []
            for node, k in zip(nodes, ks):
                a = cls.options(
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
                ).remote(k)
                SYSTEMS[system][2](a.add.remote(0))  # started
                out.append(a)
            return out

        def chain(system, stages, **kw):
            with SYSTEMS[system][1]() as inp:
                node = inp
                for s in stages:
                    node = s.add.bind(node)
            return node.experimental_compile(**kw)

        made = {system: (actors(system, [1, 1, 1]), actors(system, [0])[0]) for system in SYSTEMS}

        def echo_rt(system):
            get, (_, echo) = SYSTEMS[system][2], made[system]
            dag = chain(system, [echo])

            def f(i):
                v = get(dag.execute(i))
                expect(v == i, f"{system} echo returned {v} for {i}")

            push(system, "echo", timed(warm(sync), sync, f), "actor on another node")
            dag.teardown()

        def chain3(system):
            get, (stages, _) = SYSTEMS[system][2], made[system]
            dag = chain(system, stages)

            def f(i):
                v = get(dag.execute(i))
                expect(v == i + 3, f"{system} chain returned {v} for {i}")

            push(system, "chain3", timed(warm(sync), sync, f), "one actor on each of 3 nodes")
            dag.teardown()

        def chain3_pipe16(system):
            get, (stages, _) = SYSTEMS[system][2], made[system]
            dag = chain(system, stages, _max_inflight_executions=16)

            def check(i, v):
                expect(v == i + 3, f"{system} chain returned {v} for {i}")

            try:
                m = pipelined(get, dag, 16, warm(2 * sync), 2 * sync, check)
                push(system, "chain3_pipe16", m, "16 in flight over 3 nodes")
            except (ray.exceptions.RayChannelTimeoutError, adag.GetTimeoutError) as e:
                # Seen with Ray here: with 16 in flight across nodes its submit times out.
                print(f"  {system} chain3_pipe16 failed: {type(e).__name__}: {str(e)[:160]}",
                      file=sys.stderr)
                rows.append({"key": "chain3_pipe16/ray-nodes", "system": system,
                             "workload": "chain3_pipe16", "placement": "ray-nodes",
                             "p50_us": None, "p99_us": None, "throughput_per_s": None,
                             "gb_per_s": None, "count": 0,
                             "note": f"failed: {type(e).__name__} (submit timed out)"})
            dag.teardown()

        def payload(system):
            get, (_, echo) = SYSTEMS[system][2], made[system]
            size = 100 << 20
            with SYSTEMS[system][1]() as inp:
                out = echo.echo.bind(inp)
            dag = out.experimental_compile(
                _buffer_size_bytes=size + (1 << 16), _max_inflight_executions=2
            )
            arr = np.full(size, 0xA5, dtype=np.uint8)
            n = min(sync, max(payload_bytes // size, 3))

            def f(i):
                v = get(dag.execute(arr))
                expect(v.nbytes == size, f"{system} echo of {size} bytes returned {v.nbytes}")
                del v

            push(system, "payload_100MiB", timed(min(warm(n), n), n, f), "")
            dag.teardown()

        # Workload by workload, Ray then adag: both see the same background load.
        for name, run in (("echo", echo_rt), ("chain3", chain3), ("chain3_pipe16", chain3_pipe16),
                          ("payload_100MiB", payload)):
            if want(name):
                for system in SYSTEMS:
                    run(system)
    finally:
        adag.shutdown()
        ray.shutdown()
        cluster.shutdown()
    load_after = list(os.getloadavg())
    leaked = sorted(shm_files() - shm_before)
    for name in leaked:  # Ray's semaphores (see workloads.py)
        try:
            os.unlink(os.path.join("/dev/shm", name))
        except OSError:
            pass
    if not rows:
        sys.exit(f"no workload matches --filter {args.filter!r}")
    print_side_by_side(rows)
    if args.json:
        report = {"ray": ray.__version__, "adag": adag.__version__, "quick": args.quick,
                  "date": datetime.date.today().isoformat(), "machine": machine(),
                  "load_before": load_before, "load_after": load_after,
                  "leaked_dev_shm_files": len(leaked), "results": rows}
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
            fh.write("\n")
        print(f"wrote {args.json}", file=sys.stderr)
    print(f"done in {time.time() - started:.1f} s (load {load_before[0]:.2f} -> {load_after[0]:.2f})",
          file=sys.stderr)


def print_side_by_side(rows):
    """One line per workload: Ray's and adag's figures and the ratio of p50 (Ray / adag)."""
    by = {(r["system"], r["workload"]): r for r in rows}
    order = list(dict.fromkeys(r["workload"] for r in rows))

    def f(v, digits=1):
        return "-" if v is None else f"{v:,.{digits}f}"

    print("| workload (Ray nodes on loopback) | Ray CG p50 µs | adag p50 µs | Ray CG p99 µs | adag p99 µs "
          "| Ray CG /s | adag /s | p50 Ray/adag |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for w in order:
        r, a = by.get(("ray", w), {}), by.get(("adag", w), {})
        ratio = (r["p50_us"] / a["p50_us"]) if r.get("p50_us") and a.get("p50_us") else None
        name = w + (f" ({r.get('note') or ''} vs {a.get('note') or ''})" if w.startswith("payload_") else "")
        print(f"| {name} | {f(r.get('p50_us'))} | {f(a.get('p50_us'))} | {f(r.get('p99_us'))} "
              f"| {f(a.get('p99_us'))} | {f(r.get('throughput_per_s'), 0)} "
              f"| {f(a.get('throughput_per_s'), 0)} | {'-' if ratio is None else f'{ratio:.1f}×'} |")


if __name__ == "__main__":
    main()
