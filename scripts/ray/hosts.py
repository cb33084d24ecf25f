#!/usr/bin/env python3
"""The cross-host workloads of adag-bench (`*/hosts` rows), on Ray Compiled Graphs across
Ray nodes: a local `ray.cluster_utils.Cluster` of a head node (the driver's) and three worker
nodes on this machine, each with a custom resource (`host1`..`host3`) that pins one stage to
it, so that every edge between stages crosses nodes as it does between adag's hosts.

    target/ray-venv/bin/python scripts/ray/hosts.py --json /tmp/ray-hosts.json
    target/ray-venv/bin/python scripts/ray/hosts.py --quick --filter chain3

Every node binds 127.0.0.1 (`node_ip_address`), and RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 keeps
Ray from rewriting it to the machine's interface address: all traffic stays on loopback.
Keys, fields and conventions are those of workloads.py (and of adag-bench).
"""

import os

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from ray.dag import InputNode, MultiOutputNode  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workloads import Stage, expect, machine, pipelined, print_table, runner_args, shm_files, timed  # noqa: E402

LOOPBACK = "127.0.0.1"


def row(m, workload, note):
    r = m.row(workload, note)
    r["key"] = f"{workload}/hosts"
    r["placement"] = "hosts"
    return r


def main():
    args = runner_args(__doc__).parse_args()
    want = lambda k: args.filter is None or args.filter in k  # noqa: E731
    sync = args.iters or (100 if args.quick else 2000)
    warm = lambda n: min(max(n // 10, 3), 500)  # noqa: E731
    payload_bytes = (256 << 20) if args.quick else (2 << 30)
    rows = []

    def push(r):
        print(f"  {r['key']:<24} p50 {r['p50_us']:>10.1f} µs  {r['note']}", file=sys.stderr, flush=True)
        rows.append(r)

    shm_before = shm_files()
    started = time.time()
    load_before = list(os.getloadavg())
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "node_ip_address": LOOPBACK, "include_dashboard": False},
    )
    for i in (1, 2, 3):
        cluster.add_node(num_cpus=1, node_ip_address=LOOPBACK, resources={f"host{i}": 4})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR")
    print(f"ray {ray.__version__}: {len(ray.nodes())} nodes on {os.cpu_count()} CPU(s)", file=sys.stderr, flush=True)
    try:
        def on(i, k):
            a = Stage.options(resources={f"host{i}": 1}).remote(k)
            ray.get(a.add.remote(0))
            return a

        stages = [on(1, 1), on(2, 1), on(3, 1)]
        echo = on(1, 0)

        def chain(actors, **kw):
            with InputNode() as inp:
                node = inp
                for s in actors:
                    node = s.add.bind(node)
            return node.experimental_compile(**kw)

        if want("echo/hosts"):
            dag = chain([echo])

            def f(i):
                v = ray.get(dag.execute(i))
                expect(v == i, f"echo returned {v} for {i}")

            m = timed(warm(sync), sync, f)
            dag.teardown()
            push(row(m, "echo", "actor on another node"))
        if want("chain3/hosts"):
            dag = chain(stages)

            def f(i):
                v = ray.get(dag.execute(i))
                expect(v == i + 3, f"chain returned {v} for {i}")

            m = timed(warm(sync), sync, f)
            dag.teardown()
            push(row(m, "chain3", "one actor on each of 3 nodes"))
        if want("chain3_pipe16/hosts"):
            dag = chain(stages, _max_inflight_executions=16)

            def check(i, v):
                expect(v == i + 3, f"chain returned {v} for {i}")

            try:
                m = pipelined(dag, 16, warm(2 * sync), 2 * sync, check)
                push(row(m, "chain3_pipe16", "16 in flight over 3 nodes"))
            except ray.exceptions.RayChannelTimeoutError as e:
                # Seen here: with 16 in flight across nodes Ray's submit waits out its timeout.
                print(f"  chain3_pipe16/hosts failed: {type(e).__name__}: {str(e)[:160]}", file=sys.stderr)
                rows.append({"key": "chain3_pipe16/hosts", "workload": "chain3_pipe16", "placement": "hosts",
                             "p50_us": None, "p99_us": None, "throughput_per_s": None, "gb_per_s": None,
                             "count": 0, "note": f"Ray failed: {type(e).__name__} (submit timed out)"})
            dag.teardown()
        if want("fanout3/hosts"):
            with InputNode() as inp:
                out = MultiOutputNode([s.add.bind(inp) for s in stages])
            dag = out.experimental_compile()

            def f(i):
                v = ray.get(dag.execute(i))
                expect(all(x == i + 1 for x in v), f"fan-out returned {v}")

            m = timed(warm(sync), sync, f)
            dag.teardown()
            push(row(m, "fanout3", "input to an actor on each of 3 nodes"))
        for name, size in (("1MiB", 1 << 20), ("100MiB", 100 << 20)):
            if not want(f"payload_{name}/hosts"):
                continue
            with InputNode() as inp:
                out = echo.echo.bind(inp)
            dag = out.experimental_compile(_buffer_size_bytes=size + (1 << 16), _max_inflight_executions=2)
            arr = np.full(size, 0xA5, dtype=np.uint8)
            n = min(sync, max(payload_bytes // size, 3))

            def f(i):
                v = ray.get(dag.execute(arr))
                expect(v.nbytes == size, f"echo of {size} bytes returned {v.nbytes}")
                del v

            m = timed(min(warm(n), n), n, f)
            dag.teardown()
            r = row(m, f"payload_{name}", "")
            gbps = size / (r["p50_us"] * 1e-6) / 1e9
            r["gb_per_s"] = gbps
            r["note"] = f"{gbps:.2f} GB/s (size / p50 round trip, actor on another node)"
            push(r)
    finally:
        ray.shutdown()
        cluster.shutdown()
    load_after = list(os.getloadavg())
    leaked = sorted(shm_files() - shm_before)
    for name in leaked:
        try:
            os.unlink(os.path.join("/dev/shm", name))
        except OSError:
            pass
    if not rows:
        sys.exit(f"no workload matches --filter {args.filter!r}")
    print_table(rows)
    if args.json:
        report = {"system": "ray", "version": ray.__version__, "quick": args.quick, "machine": machine(),
                  "load_before": load_before, "load_after": load_after,
                  "leaked_dev_shm_files": len(leaked), "results": rows}
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
            fh.write("\n")
        print(f"wrote {args.json}", file=sys.stderr)
    print(f"done in {time.time() - started:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
