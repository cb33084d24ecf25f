#!/usr/bin/env python3
"""The standard workloads of adag-bench, written against Ray Compiled Graphs.

Prints a table and writes JSON with the same workload keys and fields as
`adag-bench --json` (key = "workload/placement"; every Ray actor is a process, so
placement is always "process"), so that scripts/ray/compare.py can put both side by side.

    target/ray-venv/bin/python scripts/ray/workloads.py --json /tmp/ray.json
    target/ray-venv/bin/python scripts/ray/workloads.py --quick --filter chain3
    target/py-venv/bin/python scripts/ray/workloads.py --system adag --json /tmp/adag-py.json

`--system adag` runs the very same code against adag's Python package (`python/`): the port
is the two imports below, `import adag as ray` and adag's `InputNode`/`MultiOutputNode`.

Latency = one synchronous round trip (`execute` + `ray.get`) timed with perf_counter_ns;
p50/p99 are percentiles of those samples. Throughput = executions per second of wall time
over the measured loop. Payload bandwidth = payload size / median round trip of an echo
(the bytes cross twice but count once), the figure Ray's own microbenchmarks report.
"""

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from collections import deque

import numpy as np

# Which system runs the workloads: decided before the imports, which are the whole port.
SYSTEM = "adag" if "--system=adag" in sys.argv or any(
    a == "--system" and sys.argv[i + 1 : i + 2] == ["adag"] for i, a in enumerate(sys.argv)
) else "ray"
if SYSTEM == "adag":
    import adag as ray
    from adag import InputNode, MultiOutputNode
else:
    import ray
    from ray.dag import InputNode, MultiOutputNode

NS = time.perf_counter_ns


@ray.remote(num_cpus=0)
class Stage:
    def __init__(self, k):
        self.k = k

    def add(self, x):
        return x + self.k

    def echo(self, x):
        return x

    def transform(self, x):
        return x ^ 0xA5  # a new array computed from the input

    def transform_lent(self, x):
        # adag only: the result made where it travels (`adag.empty`: the output channel's
        # shared memory), so each byte is written once.
        out = ray.empty(x.shape, x.dtype)
        np.bitwise_xor(x, 0xA5, out=out)
        return out


class Measured:
    def __init__(self):
        self.samples = []
        self.elapsed_s = 0.0

    def row(self, workload, note):
        a = np.asarray(self.samples, dtype=np.float64) / 1e3
        count = len(self.samples)
        return {
            "key": f"{workload}/process",
            "workload": workload,
            "placement": "process",
            "p50_us": float(np.percentile(a, 50)) if count else None,
            "p99_us": float(np.percentile(a, 99)) if count else None,
            "throughput_per_s": count / self.elapsed_s if self.elapsed_s > 0 else None,
            "gb_per_s": None,
            "count": count,
            "note": note,
        }


# The least time a latency row warms up for, whatever its count: the first milliseconds of a
# fresh round trip can run with both ends on one core until the kernel spreads them (seen
# with adag: ~5 us a round trip for the first ~10 ms, then ~1.2 us), which a count of a few
# hundred fast iterations does not outlast. Both systems get the same.
SETTLE_S = 0.25


def warming_up(count, settle_s=SETTLE_S):
    """The indices of a warm-up: at least `count` of them, for at least `settle_s` seconds."""
    end = NS() + int(settle_s * 1e9)
    i = 0
    while i < count or NS() < end:
        yield i
        i += 1


def timed(warmup, iters, f, settle_s=SETTLE_S):
    warmed = 0
    for i in warming_up(warmup, settle_s):
        f(i)
        warmed = i + 1
    m = Measured()
    start = NS()
    for i in range(iters):
        t = NS()
        f(warmed + i)
        m.samples.append(NS() - t)
    m.elapsed_s = (NS() - start) / 1e9
    return m


def pipelined(dag, depth, warmup, iters, check):
    """Keep `depth` executions outstanding; latency per execution = submit -> result."""

    def run(n, m):
        q = deque()
        start = NS()
        for i in range(n):
            if len(q) == depth:
                j, t, r = q.popleft()
                check(j, ray.get(r))
                if m:
                    m.samples.append(NS() - t)
            q.append((i, NS(), dag.execute(i)))
        while q:
            j, t, r = q.popleft()
            check(j, ray.get(r))
            if m:
                m.samples.append(NS() - t)
        if m:
            m.elapsed_s = (NS() - start) / 1e9

    run(warmup, None)
    m = Measured()
    run(iters, m)
    return m


def expect(cond, what):
    """`what`: the message, or a function making it (made only on failure: formatting a
    message in every iteration would be timed with the round trip)."""
    if not cond:
        raise AssertionError(what() if callable(what) else what)


class Bench:
    def __init__(self, args):
        self.filter = args.filter
        q = args.quick
        self.sync = args.iters or (100 if q else 2000)
        self.pipelined_n = self.sync * 2
        self.calls = max(self.sync // 4, 10)
        self.compiles = 2 if q else 5
        self.payload_bytes = (256 << 20) if q else (2 << 30)
        self.rows = []
        self.actors = []

    def warmup(self, n):
        return min(max(n // 10, 3), 500)

    def wants(self, key):
        return self.filter is None or self.filter in key

    def push(self, row):
        print(f"  {row['key']:<24} p50 {fmt(row['p50_us']):>10} µs  p99 {fmt(row['p99_us']):>10} µs  "
              f"{fmt(row['throughput_per_s']):>12} /s  {row['note']}", file=sys.stderr, flush=True)
        self.rows.append(row)

    def spawn(self, n, k=1):
        actors = [Stage.remote(k) for _ in range(n)]
        ray.get([a.add.remote(0) for a in actors])  # started and ready
        self.actors += actors
        return actors

    def chain(self, stages, **kw):
        with InputNode() as inp:
            node = inp
            for s in stages:
                node = s.add.bind(node)
        return node.experimental_compile(**kw)

    def echo(self):
        if not self.wants("echo/process"):
            return
        (a,) = self.spawn(1, 0)
        dag = self.chain([a])
        n = self.sync

        def f(i):
            v = ray.get(dag.execute(i))
            if v != i:
                raise AssertionError(f"echo returned {v} for {i}")

        m = timed(self.warmup(n), n, f)
        dag.teardown()
        self.push(m.row("echo", "execute+ray.get"))

    def call(self):
        if not self.wants("call/process"):
            return
        (a,) = self.spawn(1, 0)
        n = self.calls

        def f(i):
            v = ray.get(a.add.remote(i))
            expect(v == i, lambda: f"call returned {v} for {i}")

        m = timed(self.warmup(n), n, f)
        self.push(m.row("call", "classic actor call (baseline)"))

    def chain3(self):
        keys = ["chain3/process"] + [f"chain3_pipe{d}/process" for d in (1, 4, 16)]
        if not any(self.wants(k) for k in keys):
            return
        stages = self.spawn(3)
        if self.wants(keys[0]):
            dag = self.chain(stages)
            n = self.sync

            def f(i):
                v = ray.get(dag.execute(i))
                expect(v == i + 3, lambda: f"chain returned {v} for {i}")

            m = timed(self.warmup(n), n, f)
            dag.teardown()
            self.push(m.row("chain3", "execute+ray.get"))
        for d, key in zip((1, 4, 16), keys[1:]):
            if not self.wants(key):
                continue
            dag = self.chain(stages, _max_inflight_executions=d)
            n = self.pipelined_n

            def check(i, v):
                expect(v == i + 3, lambda: f"chain returned {v} for {i}")

            m = pipelined(dag, d, self.warmup(n), n, check)
            dag.teardown()
            self.push(m.row(f"chain3_pipe{d}", f"{d} in flight; latency = submit→result"))

    def fanout4(self):
        depth = 10
        keys = ["fanout4/process", f"fanout4_pipe{depth}/process"]
        if not any(self.wants(k) for k in keys):
            return
        stages = self.spawn(4)

        def compile_(**kw):
            with InputNode() as inp:
                out = MultiOutputNode([s.add.bind(inp) for s in stages])
            return out.experimental_compile(**kw)

        def check(i, v):
            expect(len(v) == 4 and all(x == i + 1 for x in v), lambda: f"fan-out returned {v} for {i}")

        if self.wants(keys[0]):
            dag = compile_()
            n = self.sync
            m = timed(self.warmup(n), n, lambda i: check(i, ray.get(dag.execute(i))))
            dag.teardown()
            self.push(m.row("fanout4", "execute+ray.get of 4 outputs"))
        if self.wants(keys[1]):
            dag = compile_(_max_inflight_executions=depth)
            n = self.pipelined_n
            m = pipelined(dag, depth, self.warmup(n), n, check)
            dag.teardown()
            self.push(m.row(f"fanout4_pipe{depth}", f"{depth} in flight"))

    def payloads(self):
        sizes = [("1KiB", 1 << 10), ("64KiB", 64 << 10), ("1MiB", 1 << 20), ("16MiB", 16 << 20), ("100MiB", 100 << 20)]
        keys = [f"payload_{n}/process" for n, _ in sizes]
        if not any(self.wants(k) for k in keys):
            return
        (a,) = self.spawn(1, 0)
        for (name, size), key in zip(sizes, keys):
            if not self.wants(key):
                continue
            with InputNode() as inp:
                out = a.echo.bind(inp)
            # Room for Ray's serialization header; two buffers suffice for synchronous use.
            dag = out.experimental_compile(_buffer_size_bytes=size + (1 << 16), _max_inflight_executions=2)
            arr = np.full(size, 0xA5, dtype=np.uint8)
            n = min(self.sync, max(self.payload_bytes // size, 3))

            def f(i):
                v = ray.get(dag.execute(arr))
                expect(v.nbytes == size, lambda: f"echo of {size} bytes returned {v.nbytes}")
                del v  # a zero-copy result pins its channel buffer until released

            m = timed(min(self.warmup(n), n), n, f, settle_s=0)
            dag.teardown()
            row = m.row(f"payload_{name}", "")
            gbps = size / (row["p50_us"] * 1e-6) / 1e9
            row["gb_per_s"] = gbps
            row["note"] = f"{gbps:.2f} GB/s (size / p50 round trip)"
            self.push(row)

    def transforms(self):
        """A new array computed from the input (every byte XOR 0xA5) by one actor, 16 and 100
        MiB: `transform_*` the plain way (a numpy expression); with adag also
        `transform_lent_*`, the result made in the output channel's memory (`adag.empty`)."""
        sizes = [("16MiB", 16 << 20), ("100MiB", 100 << 20)]
        methods = [("transform", "numpy expression, a new array")]
        if SYSTEM == "adag":
            methods.append(("transform_lent", "result made in output channel memory (adag.empty)"))
        keys = [f"{m}_{n}/process" for m, _ in methods for n, _ in sizes]
        if not any(self.wants(k) for k in keys):
            return
        (a,) = self.spawn(1, 0)
        for name, size in sizes:
            arr = np.full(size, 0x5A, dtype=np.uint8)
            n = min(self.sync, max(self.payload_bytes // size, 3))
            for method, note in methods:
                if not self.wants(f"{method}_{name}/process"):
                    continue
                with InputNode() as inp:
                    out = getattr(a, method).bind(inp)
                dag = out.experimental_compile(_buffer_size_bytes=size + (1 << 16), _max_inflight_executions=2)

                def f(i):
                    v = ray.get(dag.execute(arr))
                    expect(v.nbytes == size and v[0] == 0x5A ^ 0xA5, lambda: f"transform of {size} bytes went wrong")
                    del v

                m = timed(min(self.warmup(n), n), n, f, settle_s=0)
                dag.teardown()
                row = m.row(f"{method}_{name}", "")
                gbps = size / (row["p50_us"] * 1e-6) / 1e9
                row["gb_per_s"] = gbps
                row["note"] = f"{gbps:.2f} GB/s: {note}"
                self.push(row)

    def tensors(self):
        """torch CPU tensors echoed by one actor: `torch_echo_100MiB` (one 100 MiB float32
        tensor) and `intermediate_tensors` (a tuple of two 16 MiB float32 tensors, vLLM's
        pipeline hand-off), each plain and with `with_tensor_transport()` on both edges
        (`_transport`); `intermediate_numpy` is the same tuple of numpy arrays, for
        comparison (`payload_100MiB` is the numpy counterpart of the first)."""
        cases = [
            ("torch_echo_100MiB", 100 << 20, 1, "torch"),
            ("intermediate_tensors", 32 << 20, 2, "torch"),
            ("intermediate_numpy", 32 << 20, 2, "numpy"),
        ]
        variants = [(name, size, parts, lib, False) for name, size, parts, lib in cases]
        variants += [(name + "_transport", size, parts, lib, True)
                     for name, size, parts, lib in cases if lib == "torch"]
        keys = [f"{v[0]}/process" for v in variants]
        if not any(self.wants(k) for k in keys):
            return
        try:
            import torch
        except ImportError:
            torch = None
        (a,) = self.spawn(1, 0)
        for (name, size, parts, lib, annotated), key in zip(variants, keys):
            if not self.wants(key):
                continue
            if lib == "torch" and torch is None:
                self.push(Measured().row(name, "n/a: torch is not installed"))
                continue
            n = size // parts // 4
            if lib == "torch":
                items = [torch.full((n,), float(i + 1)) for i in range(parts)]
            else:
                items = [np.full(n, float(i + 1), dtype=np.float32) for i in range(parts)]
            value = items[0] if parts == 1 else tuple(items)
            with InputNode() as inp:
                src = inp.with_tensor_transport() if annotated else inp
                out = a.echo.bind(src)
                if annotated:
                    out = out.with_tensor_transport()
            # One slot holds the whole value (every buffer then read in place), as in payloads.
            dag = out.experimental_compile(_buffer_size_bytes=size + (1 << 16), _max_inflight_executions=2)
            count = min(self.sync, max(self.payload_bytes // size, 3))

            def f(i):
                v = ray.get(dag.execute(value))
                got = [v] if parts == 1 else list(v)
                expect(len(got) == parts and all(g.shape == (n,) and float(g[-1]) == k + 1 for k, g in enumerate(got)),
                       lambda: f"{name} returned {type(v).__name__}")
                del v, got  # a zero-copy result pins its channel buffer until released

            try:
                m = timed(min(self.warmup(count), count), count, f, settle_s=0)
            except Exception as e:  # a system that cannot run it gets a row that says why
                dag.teardown()
                self.push(Measured().row(name, f"n/a: {type(e).__name__}: {str(e).splitlines()[0][:80]}"))
                continue
            dag.teardown()
            row = m.row(name, "")
            gbps = size / (row["p50_us"] * 1e-6) / 1e9
            row["gb_per_s"] = gbps
            what = f"{parts} x {size // parts >> 20} MiB {lib}" + (", with_tensor_transport()" if annotated else "")
            row["note"] = f"{gbps:.2f} GB/s: {what}"
            self.push(row)

    def async_echo(self):
        if not self.wants("async_echo/process"):
            return
        (a,) = self.spawn(1, 0)
        n = self.sync

        async def main():
            # Compiled inside the running loop: Ray hangs if an asyncio graph compiled outside
            # the loop is awaited later.
            with InputNode() as inp:
                out = a.add.bind(inp)
            dag = out.experimental_compile(enable_asyncio=True)
            for i in warming_up(self.warmup(n)):
                await (await dag.execute_async(i))
            m = Measured()
            start = NS()
            for i in range(n):
                t = NS()
                v = await (await dag.execute_async(i))
                m.samples.append(NS() - t)
                if v != i:
                    raise AssertionError(f"async echo returned {v} for {i}")
            m.elapsed_s = (NS() - start) / 1e9
            dag.teardown()
            return m

        m = asyncio.run(main())
        self.push(m.row("async_echo", "await execute_async() + await ref"))

    def compile(self):
        for n_actors in (1, 4, 8):
            kc, kt = f"compile_chain{n_actors}/process", f"teardown_chain{n_actors}/process"
            if not (self.wants(kc) or self.wants(kt)):
                continue
            stages = self.spawn(n_actors)
            mc, mt = Measured(), Measured()
            for i in range(self.compiles + 1):  # the first cycle is untimed
                t = NS()
                dag = self.chain(stages)
                dc = NS() - t
                v = ray.get(dag.execute(7))
                expect(v == 7 + n_actors, lambda: f"compiled chain returned {v}")
                t = NS()
                dag.teardown()
                dt = NS() - t
                del dag
                if i > 0:
                    mc.samples.append(dc)
                    mt.samples.append(dt)
                    mc.elapsed_s += dc / 1e9
                    mt.elapsed_s += dt / 1e9
            if self.wants(kc):
                self.push(mc.row(f"compile_chain{n_actors}", "experimental_compile()"))
            if self.wants(kt):
                self.push(mt.row(f"teardown_chain{n_actors}", "teardown()"))

    def free_actors(self):
        for a in self.actors:
            ray.kill(a)
        self.actors = []


def fmt(v):
    if v is None:
        return "-"
    if v >= 10_000:
        return f"{v:.0f}"
    if v >= 100:
        return f"{v:.1f}"
    return f"{v:.2f}"


def print_table(rows):
    header = ["workload", "placement", "p50 µs", "p99 µs", "throughput /s", "note"]
    cells = [[r["workload"], r["placement"], fmt(r["p50_us"]), fmt(r["p99_us"]), fmt(r["throughput_per_s"]), r["note"]]
             for r in rows]
    width = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]

    def line(c):
        return "|" + "|".join(f" {s:>{w}} " if 2 <= i < 5 else f" {s:<{w}} " for i, (s, w) in enumerate(zip(c, width))) + "|"

    print(line(header))
    print("|" + "|".join("-" * (w + 1) + ":" if 2 <= i < 5 else "-" * (w + 2) for i, w in enumerate(width)) + "|")
    for c in cells:
        print(line(c))


def shm_files():
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("sem.")}
    except OSError:
        return set()


def machine():
    model = ""
    try:
        for l in open("/proc/cpuinfo"):
            if l.startswith("model name"):
                model = l.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "cpu_model": model, "kernel": platform.release()}


def runner_args(doc):
    """The options every runner of these workloads takes (this one and hosts.py)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny counts (smoke run)")
    p.add_argument("--iters", type=int, help="measured round trips of the small-message workloads")
    p.add_argument("--filter", help="run only workloads whose key contains this substring")
    p.add_argument("--json", help="also write the results as JSON to this file")
    return p


def main():
    p = runner_args(__doc__)
    p.add_argument("--system", choices=("ray", "adag"), default="ray",
                   help="run against Ray Compiled Graphs (default) or adag's Python package")
    p.add_argument("--keep-shm", action="store_true",
                   help="leave the sem.* files Ray leaves in /dev/shm (by default they are counted, then removed)")
    args = p.parse_args()
    shm_before = shm_files()

    started = time.time()
    load_before = list(os.getloadavg())
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
             logging_level="ERROR", configure_logging=True)
    print(f"{SYSTEM} {ray.__version__}: {os.cpu_count()} CPU(s)", file=sys.stderr, flush=True)
    b = Bench(args)
    try:
        for step in (b.echo, b.call, b.chain3, b.fanout4, b.payloads, b.transforms, b.tensors, b.async_echo,
                     b.compile):
            step()
            b.free_actors()  # keep at most the current workload's actors alive on 2 cores
    finally:
        ray.shutdown()
    load_after = list(os.getloadavg())
    # Ray leaves a POSIX semaphore pair (sem.hdr*/sem.obj*) in /dev/shm per channel it made.
    leaked = sorted(shm_files() - shm_before)
    if leaked:
        print(f"Ray left {len(leaked)} files in /dev/shm after ray.shutdown()"
              + ("" if args.keep_shm else "; removing them"), file=sys.stderr)
        if not args.keep_shm:
            for name in leaked:
                try:
                    os.unlink(os.path.join("/dev/shm", name))
                except OSError:
                    pass
    if not b.rows:
        sys.exit(f"no workload matches --filter {args.filter!r}")
    print_table(b.rows)
    if args.json:
        report = {"system": SYSTEM, "version": ray.__version__, "quick": args.quick, "machine": machine(),
                  "load_before": load_before, "load_after": load_after,
                  "leaked_dev_shm_files": len(leaked), "results": b.rows}
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
            fh.write("\n")
        print(f"wrote {args.json}", file=sys.stderr)
    print(f"done in {time.time() - started:.1f} s; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after",
          file=sys.stderr)


if __name__ == "__main__":
    main()
