//! `adag-bench`: the standard workloads of adag, one table, optionally JSON.
//!
//! ```text
//! cargo run --release -p adag-bench                     # full run (20-40 s on 2 vCPUs)
//! cargo run --release -p adag-bench -- --quick          # CI smoke (a few seconds)
//! cargo run --release -p adag-bench -- --filter chain3 --iters 50000 --json out.json
//! ```
//!
//! Every latency is one synchronous round trip (`execute` + `get`, or `call`) timed on the
//! driver with `Instant`, recorded in nanoseconds in an HDR histogram; p50 and p99 are its
//! quantiles. Throughput is executions completed per second of wall time over the measured
//! loop. Payload bandwidth follows Ray's convention: payload size / median round-trip time
//! of an echo (the bytes cross twice, but count once). The workload keys match
//! `scripts/ray/workloads.py`, so `scripts/ray/compare.py` can put both systems side by side.

mod floor;

use adag::Buffer;
use adag::{
    ActorHandle, CompileOptions, CompiledGraph, Dag, IntoOutputs, Placement, RefSet, Runtime,
    Transport,
};
use adag_bench::{
    Shard, Stage, chain, fanout, payload_echo, payload_transform, spawn_stages, xor_into,
};
use anyhow::{Context, Result, bail, ensure};
use clap::Parser;
use hdrhistogram::Histogram;
use serde::Serialize;
use std::collections::VecDeque;
use std::path::PathBuf;
use std::time::{Duration, Instant};

mod hosts;
mod scale;

#[derive(Parser, Debug)]
#[command(
    name = "adag-bench",
    about = "Benchmarks of adag's compiled graphs (one table; --json for a file)"
)]
struct Args {
    /// Tiny counts, for a CI smoke run (whole run well under 20 s).
    #[arg(long)]
    quick: bool,
    /// Measured round trips of the small-message workloads (others scale from it).
    #[arg(long)]
    iters: Option<u64>,
    /// Run only workloads whose key (`workload/placement`, e.g. `chain3_pipe16/process`)
    /// contains this substring.
    #[arg(long)]
    filter: Option<String>,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// `buffer_size_bytes` of the small-message and compile workloads (default: the
    /// library's default, 1,000,000 bytes, the same as Ray's). Payload workloads size their
    /// buffers to the payload.
    #[arg(long)]
    buffer_bytes: Option<usize>,
    /// Run the scale benchmark instead (chains of 4 to 1,024 actors, fan-out, the futex
    /// floor; with --quick the small sizes only). See bench/src/scale.rs.
    #[arg(long)]
    scale: bool,
}

/// How many iterations each kind of workload runs.
struct Counts {
    /// Synchronous small-message round trips.
    sync: u64,
    /// Executions of a pipelined run.
    pipelined: u64,
    /// One-off calls (the slow path).
    calls: u64,
    /// Compile + teardown cycles per chain length.
    compiles: u64,
    /// Bytes moved per payload size at most (caps the count of large payloads).
    payload_bytes: u64,
    /// Warm-up round trips before each measured loop (a fraction of the measured count).
    warmup_div: u64,
}

impl Counts {
    fn new(args: &Args) -> Self {
        let (sync, compiles, payload_bytes) = if args.quick {
            (300, 3, 256 << 20)
        } else {
            (20_000, 20, 4 << 30)
        };
        let sync = args.iters.unwrap_or(sync).max(1);
        Counts {
            sync,
            pipelined: sync * 2,
            calls: (sync / 5).max(1),
            compiles: if args.iters.is_some() {
                (sync / 1000).clamp(2, 100)
            } else {
                compiles
            },
            payload_bytes,
            warmup_div: 10,
        }
    }

    fn warmup(&self, n: u64) -> u64 {
        (n / self.warmup_div).clamp(3, 2_000)
    }

    fn payload(&self, size: usize) -> u64 {
        self.sync.min((self.payload_bytes / size as u64).max(3))
    }
}

/// One line of the table (and of the JSON file).
#[derive(Serialize, Clone, Debug)]
struct Row {
    /// `workload/placement`: the key shared with the Ray runner.
    key: String,
    workload: String,
    placement: String,
    p50_us: Option<f64>,
    p99_us: Option<f64>,
    /// Executions (or calls, or compiles) per second over the measured loop.
    throughput_per_s: Option<f64>,
    /// Payload workloads: payload size / median round trip, in 10^9 bytes per second.
    gb_per_s: Option<f64>,
    /// Measured iterations.
    count: u64,
    note: String,
}

#[derive(Serialize)]
struct Report {
    system: &'static str,
    version: &'static str,
    quick: bool,
    machine: Machine,
    /// 1-, 5- and 15-minute load averages before and after the run (noise on a shared host).
    load_before: [f64; 3],
    load_after: [f64; 3],
    results: Vec<Row>,
}

/// The 1-, 5- and 15-minute load averages of the host.
fn loadavg() -> [f64; 3] {
    let s = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let mut v = s.split_whitespace().map(|x| x.parse().unwrap_or(f64::NAN));
    [(); 3].map(|_| v.next().unwrap_or(f64::NAN))
}

#[derive(Serialize)]
struct Machine {
    cpus: usize,
    cpu_model: String,
    kernel: String,
}

impl Machine {
    fn probe() -> Self {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu_model = cpuinfo
            .lines()
            .find(|l| l.starts_with("model name"))
            .and_then(|l| l.split(':').nth(1))
            .map(|s| s.trim().to_string())
            .unwrap_or_default();
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim()
            .to_string();
        Machine {
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            cpu_model,
            kernel,
        }
    }
}

/// Latencies of one measured loop.
struct Measured {
    hist: Histogram<u64>,
    elapsed: Duration,
    count: u64,
}

impl Measured {
    fn new() -> Self {
        Measured {
            hist: Histogram::new_with_bounds(1, 600_000_000_000, 3)
                .expect("valid histogram bounds"),
            elapsed: Duration::ZERO,
            count: 0,
        }
    }

    fn record(&mut self, d: Duration) {
        self.hist.saturating_record(d.as_nanos().max(1) as u64);
        self.count += 1;
    }

    fn p50_us(&self) -> f64 {
        self.hist.value_at_quantile(0.50) as f64 / 1e3
    }

    fn p99_us(&self) -> f64 {
        self.hist.value_at_quantile(0.99) as f64 / 1e3
    }

    fn throughput(&self) -> f64 {
        self.count as f64 / self.elapsed.as_secs_f64().max(1e-12)
    }

    fn row(&self, workload: &str, placement: &str, note: impl Into<String>) -> Row {
        Row {
            key: format!("{workload}/{placement}"),
            workload: workload.into(),
            placement: placement.into(),
            p50_us: Some(self.p50_us()),
            p99_us: Some(self.p99_us()),
            throughput_per_s: Some(self.throughput()),
            gb_per_s: None,
            count: self.count,
            note: note.into(),
        }
    }
}

/// Time `iters` calls of `f` after `warmup` untimed ones.
fn timed(warmup: u64, iters: u64, mut f: impl FnMut(u64) -> Result<()>) -> Result<Measured> {
    for i in 0..warmup {
        f(i)?;
    }
    let mut m = Measured::new();
    let start = Instant::now();
    for i in 0..iters {
        let t = Instant::now();
        f(warmup + i)?;
        m.record(t.elapsed());
    }
    m.elapsed = start.elapsed();
    Ok(m)
}

/// Keep `depth` executions outstanding: submit until `depth` are in flight, then get the
/// oldest and submit the next. Latency per execution is submit → result.
fn pipelined<O>(
    graph: &CompiledGraph<u64, O>,
    depth: usize,
    warmup: u64,
    iters: u64,
    check: impl Fn(u64, O::Refs) -> Result<()>,
) -> Result<Measured>
where
    O: IntoOutputs,
    O::Refs: RefSet,
{
    let run = |n: u64, m: Option<&mut Measured>| -> Result<()> {
        let mut q: VecDeque<(u64, Instant, O::Refs)> = VecDeque::with_capacity(depth);
        let mut lat = Vec::with_capacity(if m.is_some() { n as usize } else { 0 });
        let start = Instant::now();
        for i in 0..n {
            if q.len() == depth {
                let (j, t, r) = q.pop_front().expect("queue is full");
                check(j, r)?;
                lat.push(t.elapsed());
            }
            q.push_back((i, Instant::now(), graph.execute(i)?));
        }
        while let Some((j, t, r)) = q.pop_front() {
            check(j, r)?;
            lat.push(t.elapsed());
        }
        if let Some(m) = m {
            m.elapsed = start.elapsed();
            for d in lat {
                m.record(d);
            }
        }
        Ok(())
    };
    run(warmup, None)?;
    let mut m = Measured::new();
    run(iters, Some(&mut m))?;
    Ok(m)
}

struct Bench {
    rt: Runtime,
    /// Options of the small-message and compile workloads.
    opts: CompileOptions,
    counts: Counts,
    filter: Option<String>,
    rows: Vec<Row>,
}

impl Bench {
    fn wants(&self, key: &str) -> bool {
        self.filter
            .as_ref()
            .is_none_or(|f| key.contains(f.as_str()))
    }

    fn wants_any(&self, keys: &[String]) -> bool {
        keys.iter().any(|k| self.wants(k))
    }

    fn push(&mut self, row: Row) {
        eprintln!(
            "  {:<24} p50 {:>10} µs  p99 {:>10} µs  {:>12} /s  {}",
            row.key,
            fmt_opt(row.p50_us),
            fmt_opt(row.p99_us),
            fmt_opt(row.throughput_per_s),
            row.note
        );
        self.rows.push(row);
    }

    fn placement_name(p: Placement) -> &'static str {
        match p {
            Placement::Thread => "thread",
            Placement::Process => "process",
            _ => "remote",
        }
    }

    /// Synchronous round trips (`execute` + `get`) through a chain of `stages`, each result
    /// checked against `x + added`; the graph torn down after.
    fn chain_round_trips(&self, stages: &[ActorHandle<Stage>], added: u64) -> Result<Measured> {
        let g = chain(stages, self.opts.clone())?;
        let n = self.counts.sync;
        let m = timed(self.counts.warmup(n), n, |i| {
            let v = g.execute(i)?.get()?;
            ensure!(
                v == i + added,
                "a chain of {} returned {v} for {i}",
                stages.len()
            );
            Ok(())
        })?;
        g.teardown()?;
        Ok(m)
    }

    /// The same chain with `depth` executions kept in flight.
    fn chain_pipelined(
        &self,
        stages: &[ActorHandle<Stage>],
        added: u64,
        depth: usize,
    ) -> Result<Measured> {
        let g = chain(stages, self.opts.clone().max_inflight_executions(depth))?;
        let n = self.counts.pipelined;
        let m = pipelined(&g, depth, self.counts.warmup(n), n, |i, r| {
            let v = r.get()?;
            ensure!(
                v == i + added,
                "a chain of {} returned {v} for {i}",
                stages.len()
            );
            Ok(())
        })?;
        g.teardown()?;
        Ok(m)
    }

    /// One-actor echo (`x + 0` through `Stage::add`): synchronous execute + get.
    fn echo(&mut self, placement: Placement) -> Result<()> {
        let pl = Self::placement_name(placement);
        if !self.wants(&format!("echo/{pl}")) {
            return Ok(());
        }
        let a = self.rt.spawn::<Stage>(placement, 0)?;
        let m = self.chain_round_trips(std::slice::from_ref(&a), 0)?;
        self.push(m.row("echo", pl, "execute+get"));
        Ok(())
    }

    /// The slow path, as a baseline: one-off `handle.call().add(x)` round trips.
    fn call(&mut self, placement: Placement) -> Result<()> {
        let pl = Self::placement_name(placement);
        if !self.wants(&format!("call/{pl}")) {
            return Ok(());
        }
        let a = self.rt.spawn::<Stage>(placement, 0)?;
        let n = self.counts.calls;
        let m = timed(self.counts.warmup(n), n, |i| {
            let v = a.call().add(i)?;
            ensure!(v == i, "call returned {v} for {i}");
            Ok(())
        })?;
        self.push(m.row("call", pl, "one-off call (baseline)"));
        Ok(())
    }

    /// Chain of three: synchronous, then pipelined with 1, 4 and 16 executions in flight.
    fn chain3(&mut self, placement: Placement, pipelined_too: bool) -> Result<()> {
        let pl = Self::placement_name(placement);
        let depths: &[usize] = if pipelined_too { &[1, 4, 16] } else { &[] };
        let mut keys = vec![format!("chain3/{pl}")];
        keys.extend(depths.iter().map(|d| format!("chain3_pipe{d}/{pl}")));
        if !self.wants_any(&keys) {
            return Ok(());
        }
        let stages = spawn_stages(&self.rt, placement, 3)?;
        if self.wants(&keys[0]) {
            let m = self.chain_round_trips(&stages, 3)?;
            self.push(m.row("chain3", pl, "execute+get"));
        }
        for (&d, key) in depths.iter().zip(&keys[1..]) {
            if !self.wants(key) {
                continue;
            }
            let m = self.chain_pipelined(&stages, 3, d)?;
            let name = key.split('/').next().unwrap_or(key);
            self.push(m.row(name, pl, format!("{d} in flight; latency = submit→result")));
        }
        Ok(())
    }

    /// Fan-out of the input to four actors, a multi-output node of their results.
    fn fanout4(&mut self) -> Result<()> {
        const DEPTH: usize = 10;
        let keys = [
            "fanout4/process".to_string(),
            format!("fanout4_pipe{DEPTH}/process"),
        ];
        if !self.wants_any(&keys) {
            return Ok(());
        }
        let stages = spawn_stages(&self.rt, Placement::Process, 4)?;
        let check = |i: u64, v: Vec<u64>| -> Result<()> {
            ensure!(
                v.len() == 4 && v.iter().all(|&x| x == i + 1),
                "fan-out returned {v:?} for {i}"
            );
            Ok(())
        };
        if self.wants(&keys[0]) {
            let g = fanout(&stages, self.opts.clone())?;
            let n = self.counts.sync;
            let m = timed(self.counts.warmup(n), n, |i| check(i, g.execute(i)?.get()?))?;
            g.teardown()?;
            self.push(m.row("fanout4", "process", "execute+get of 4 outputs"));
        }
        if self.wants(&keys[1]) {
            let g = fanout(&stages, self.opts.clone().max_inflight_executions(DEPTH))?;
            let n = self.counts.pipelined;
            let m = pipelined(&g, DEPTH, self.counts.warmup(n), n, |i, r| {
                check(i, r.get()?)
            })?;
            g.teardown()?;
            self.push(m.row(
                &format!("fanout4_pipe{DEPTH}"),
                "process",
                format!("{DEPTH} in flight"),
            ));
        }
        Ok(())
    }

    /// Echo of a byte payload through one process actor: the same heap buffer each time.
    fn payloads(&mut self) -> Result<()> {
        let sizes: [(&str, usize); 5] = [
            ("1KiB", 1 << 10),
            ("64KiB", 64 << 10),
            ("1MiB", 1 << 20),
            ("16MiB", 16 << 20),
            ("100MiB", 100 << 20),
        ];
        let keys: Vec<String> = sizes
            .iter()
            .map(|(n, _)| format!("payload_{n}/process"))
            .collect();
        if !self.wants_any(&keys) {
            return Ok(());
        }
        let a = self.rt.spawn::<Stage>(Placement::Process, 0)?;
        for ((name, size), key) in sizes.iter().zip(&keys) {
            if !self.wants(key) {
                continue;
            }
            // Room for the frame header (64 bytes before an out-of-band payload); two slots are
            // enough for synchronous round trips.
            let opts = CompileOptions::default()
                .buffer_size_bytes(size + 64)
                .max_inflight_executions(2);
            let g = payload_echo(&a, opts)?;
            let n = self.counts.payload(*size);
            // The same buffer on the driver's heap each time (like Ray's array): it is copied
            // into shared memory once per execution, and the actor's result, the buffer it
            // read in place, comes back by reference. (A result sent again would not be
            // copied at all: it already lies in the input channel's memory.)
            let input = Buffer::from(vec![0xa5; *size]);
            let m = timed(self.counts.warmup(n).min(n), n, |_| {
                let out = g.execute(input.clone())?.get()?;
                ensure!(
                    out.len() == *size && out.first() == Some(&0xa5),
                    "echo of {size} bytes returned {}",
                    out.len()
                );
                Ok(())
            })?;
            let mut row = m.row(&format!("payload_{name}"), "process", String::new());
            let gbps = *size as f64 / (m.p50_us() * 1e-6) / 1e9;
            row.gb_per_s = Some(gbps);
            row.note = format!("{gbps:.2} GB/s (size / p50 round trip)");
            self.push(row);
            // The same, built each time in memory lent by the input channel
            // (`input_buffer`): the fill is the payload's only write, and it is timed.
            let key = format!("payload_lent_{name}/process");
            if *size >= 1 << 20 && self.wants(&key) {
                let m = timed(self.counts.warmup(n).min(n), n, |_| {
                    let mut lent = g.input_buffer(*size);
                    lent.fill(0xa5);
                    let out = g.execute(lent.freeze())?.get()?;
                    ensure!(
                        out.len() == *size && out.last() == Some(&0xa5),
                        "echo of {size} lent bytes returned {}",
                        out.len()
                    );
                    Ok(())
                })?;
                let mut row = m.row(&format!("payload_lent_{name}"), "process", String::new());
                let gbps = *size as f64 / (m.p50_us() * 1e-6) / 1e9;
                row.gb_per_s = Some(gbps);
                row.note = format!("{gbps:.2} GB/s (lent input, filled; size / p50)");
                self.push(row);
            }
            g.teardown()?;
        }
        Ok(())
    }

    /// A process actor returns a new payload computed from its input (every byte XOR 0x5a):
    /// `transform_*` the plain way (a heap input, copied into the input channel; a heap
    /// result, copied into the output channel), `transform_lent_*` with every byte written
    /// once (the input built once in lent input memory and sent by reference; the result
    /// built in the memory the output channel lends, `adag::output_buffer`). Beside them
    /// `membw_xor_*`: the same XOR in the driver between two warm heap buffers, one read and
    /// one write of the payload, the memory-bandwidth bound of a transform.
    fn transforms(&mut self) -> Result<()> {
        let sizes: [(&str, usize); 2] = [("16MiB", 16 << 20), ("100MiB", 100 << 20)];
        let wanted = sizes.iter().any(|(n, _)| {
            self.wants(&format!("transform_{n}/process"))
                || self.wants(&format!("transform_lent_{n}/process"))
                || self.wants(&format!("membw_xor_{n}/driver"))
        });
        if !wanted {
            return Ok(());
        }
        let a = self.rt.spawn::<Stage>(Placement::Process, 0)?;
        for (name, size) in sizes {
            let n = self.counts.payload(size);
            let warmup = self.counts.warmup(n).min(n);
            let gbps = |m: &Measured| size as f64 / (m.p50_us() * 1e-6) / 1e9;
            let check = |out: &Buffer, first: u8| -> Result<()> {
                ensure!(
                    out.len() == size && out.first() == Some(&(first ^ 0x5a)),
                    "transform of {size} bytes returned {} bytes",
                    out.len()
                );
                Ok(())
            };
            let opts = CompileOptions::default()
                .buffer_size_bytes(64 << 10)
                .max_inflight_executions(2);
            if self.wants(&format!("membw_xor_{name}/driver")) {
                let src = vec![0xa5u8; size];
                let mut dst = vec![0u8; size];
                xor_into(&mut dst, &src);
                let m = timed(warmup, n, |_| {
                    xor_into(&mut dst, std::hint::black_box(&src));
                    ensure!(dst[size - 1] == 0xa5 ^ 0x5a, "xor went wrong");
                    Ok(())
                })?;
                let mut row = m.row(&format!("membw_xor_{name}"), "driver", String::new());
                row.gb_per_s = Some(gbps(&m));
                row.note = format!(
                    "{:.2} GB/s: one read + one write, warm heap buffers (the bound)",
                    gbps(&m)
                );
                self.push(row);
            }
            if self.wants(&format!("transform_{name}/process")) {
                let g = payload_transform(&a, false, opts.clone())?;
                let input = Buffer::from(vec![0xa5u8; size]);
                let m = timed(warmup, n, |_| {
                    check(&g.execute(input.clone())?.get()?, 0xa5)
                })?;
                g.teardown()?;
                let mut row = m.row(&format!("transform_{name}"), "process", String::new());
                row.gb_per_s = Some(gbps(&m));
                row.note = format!("{:.2} GB/s: heap input and result, copied", gbps(&m));
                self.push(row);
            }
            if self.wants(&format!("transform_lent_{name}/process")) {
                let g = payload_transform(&a, true, opts.clone())?;
                let mut lent = g.input_buffer(size);
                lent.fill(0xa5);
                let input = lent.freeze();
                let m = timed(warmup, n, |_| {
                    check(&g.execute(input.clone())?.get()?, 0xa5)
                })?;
                g.teardown()?;
                let mut row = m.row(&format!("transform_lent_{name}"), "process", String::new());
                row.gb_per_s = Some(gbps(&m));
                row.note = format!(
                    "{:.2} GB/s: lent input sent by reference, result made in lent output memory",
                    gbps(&m)
                );
                self.push(row);
            }
        }
        Ok(())
    }

    /// A 16 MiB f32 tensor edge between two process actors (`Shard::grad`, a tensor it holds,
    /// to `Shard::apply`, which returns one element of it), by the default channel (`shm`:
    /// shared memory, read in place) and by the CPU communicator (`comm`:
    /// `Transport::communicator()`, the metadata on the channel and the data through the
    /// communicator): synchronous round trips, and a pipeline of 4 executions in flight.
    fn tensor_edges(&mut self) -> Result<()> {
        const SIZE: usize = 16 << 20;
        const DEPTH: usize = 4;
        let transports = [("shm", Transport::Shm), ("comm", Transport::communicator())];
        let key = |w: &str, t: &str| format!("tensor_edge_16MiB{w}/{t}");
        let wanted = |b: &Self, t: &str| b.wants(&key("", t)) || b.wants(&key("_pipe4", t));
        if !transports.iter().any(|(t, _)| wanted(self, t)) {
            return Ok(());
        }
        let n = (SIZE / 4) as u64;
        let a = self.rt.spawn::<Shard>(Placement::Process, (0, n))?;
        let b = self.rt.spawn::<Shard>(Placement::Process, (1, 1))?;
        let count = self.counts.payload(SIZE);
        for (name, transport) in transports {
            if !wanted(self, name) {
                continue;
            }
            let dag = Dag::<u64>::new();
            let t = a.grad(dag.input()).with_tensor_transport(transport);
            let opts = CompileOptions::default()
                .buffer_size_bytes(SIZE + (64 << 10))
                .max_inflight_executions(DEPTH);
            let g = dag.compile(b.apply(&t), opts)?;
            let check = |v: f32| -> Result<()> {
                ensure!(v == 1.0, "the tensor edge returned {v}, not 1");
                Ok(())
            };
            if self.wants(&key("", name)) {
                let m = timed(self.counts.warmup(count).min(count), count, |_| {
                    check(g.execute(0)?.get()?)
                })?;
                let mut row = m.row("tensor_edge_16MiB", name, String::new());
                let rate = SIZE as f64 / (m.p50_us() * 1e-6) / 1e9;
                row.gb_per_s = Some(rate);
                row.note = format!("{rate:.2} GB/s (size / p50 round trip)");
                self.push(row);
            }
            if self.wants(&key("_pipe4", name)) {
                let iters = count * 2;
                let m = pipelined(
                    &g,
                    DEPTH,
                    self.counts.warmup(iters).min(iters),
                    iters,
                    |_, r| check(r.get()?),
                )?;
                let rate = SIZE as f64 * m.throughput() / 1e9;
                let mut row = m.row("tensor_edge_16MiB_pipe4", name, String::new());
                row.gb_per_s = Some(rate);
                row.note = format!("{rate:.2} GB/s ({DEPTH} in flight; size × throughput)");
                self.push(row);
            }
            g.teardown()?;
        }
        Ok(())
    }

    /// The floor of a round trip here: a counter handed back and forth through one shared
    /// cache line between two threads, and between two processes (`floor.rs`).
    fn floors(&mut self) -> Result<()> {
        for placement in ["thread", "process"] {
            let key = format!("floor_pingpong/{placement}");
            if !self.wants(&key) {
                continue;
            }
            let n = self.counts.sync;
            let mut m = Measured::new();
            let start = Instant::now();
            let mut skipped = 0u64;
            let warmup = self.counts.warmup(n);
            let record = |d: Duration| {
                if skipped < warmup {
                    skipped += 1;
                } else {
                    m.record(d);
                }
            };
            if placement == "thread" {
                floor::threads(n + warmup, record)?;
            } else {
                floor::processes(n + warmup, record)?;
            }
            m.elapsed = start.elapsed();
            self.push(m.row(
                "floor_pingpong",
                placement,
                "one shared cache line, spin then yield: the least a round trip costs",
            ));
        }
        Ok(())
    }

    /// Async round trip through one process actor: `execute_async(x).await?.await?` on a
    /// current-thread tokio runtime (the refs are runtime-agnostic futures).
    fn async_echo(&mut self) -> Result<()> {
        if !self.wants("async_echo/process") {
            return Ok(());
        }
        let a = self.rt.spawn::<Stage>(Placement::Process, 0)?;
        let g = chain(
            std::slice::from_ref(&a),
            self.opts.clone().enable_asyncio(true),
        )?;
        let tokio_rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let n = self.counts.sync;
        let warmup = self.counts.warmup(n);
        let m = tokio_rt.block_on(async {
            for i in 0..warmup {
                let v = g.execute_async(i).await?.await?;
                ensure!(v == i, "async echo returned {v} for {i}");
            }
            let mut m = Measured::new();
            let start = Instant::now();
            for i in 0..n {
                let t = Instant::now();
                let v = g.execute_async(i).await?.await?;
                m.record(t.elapsed());
                ensure!(v == i, "async echo returned {v} for {i}");
            }
            m.elapsed = start.elapsed();
            anyhow::Ok(m)
        })?;
        g.teardown()?;
        self.push(m.row("async_echo", "process", "execute_async().await + ref.await"));
        Ok(())
    }

    /// Compile and teardown of chains of 1, 4 and 8 process actors (spawned beforehand).
    fn compile(&mut self) -> Result<()> {
        for n_actors in [1usize, 4, 8] {
            let kc = format!("compile_chain{n_actors}/process");
            let kt = format!("teardown_chain{n_actors}/process");
            if !self.wants(&kc) && !self.wants(&kt) {
                continue;
            }
            let stages = spawn_stages(&self.rt, Placement::Process, n_actors)?;
            let mut compile = Measured::new();
            let mut teardown = Measured::new();
            let iters = self.counts.compiles;
            // One untimed cycle first (first-use costs: code paths, page faults).
            for i in 0..iters + 1 {
                let t = Instant::now();
                let g = chain(&stages, self.opts.clone())?;
                let dc = t.elapsed();
                let v = g.execute(7)?.get()?;
                ensure!(v == 7 + n_actors as u64, "compiled chain returned {v}");
                let t = Instant::now();
                g.teardown()?;
                let dt = t.elapsed();
                drop(g);
                if i > 0 {
                    compile.elapsed += dc;
                    teardown.elapsed += dt;
                    compile.record(dc);
                    teardown.record(dt);
                }
            }
            if self.wants(&kc) {
                self.push(compile.row(
                    &format!("compile_chain{n_actors}"),
                    "process",
                    "dag.compile(..)",
                ));
            }
            if self.wants(&kt) {
                self.push(teardown.row(
                    &format!("teardown_chain{n_actors}"),
                    "process",
                    "graph.teardown()",
                ));
            }
        }
        Ok(())
    }
}

fn fmt_opt(v: Option<f64>) -> String {
    match v {
        None => "-".into(),
        Some(v) if v >= 10_000.0 => format!("{v:.0}"),
        Some(v) if v >= 100.0 => format!("{v:.1}"),
        Some(v) => format!("{v:.2}"),
    }
}

fn print_table(rows: &[Row]) {
    let header = [
        "workload",
        "placement",
        "p50 µs",
        "p99 µs",
        "throughput /s",
        "note",
    ];
    let cells: Vec<[String; 6]> = rows
        .iter()
        .map(|r| {
            [
                r.workload.clone(),
                r.placement.clone(),
                fmt_opt(r.p50_us),
                fmt_opt(r.p99_us),
                fmt_opt(r.throughput_per_s),
                r.note.clone(),
            ]
        })
        .collect();
    let mut width = header.map(|h| h.chars().count());
    for c in &cells {
        for (w, s) in width.iter_mut().zip(c) {
            *w = (*w).max(s.chars().count());
        }
    }
    let line = |c: &[String]| {
        let mut s = String::from("|");
        for (i, (cell, w)) in c.iter().zip(width).enumerate() {
            let pad = w - cell.chars().count();
            if (2..5).contains(&i) {
                s += &format!(" {}{} |", " ".repeat(pad), cell);
            } else {
                s += &format!(" {}{} |", cell, " ".repeat(pad));
            }
        }
        s
    };
    println!("{}", line(&header.map(String::from)));
    let mut sep = String::from("|");
    for (i, w) in width.iter().enumerate() {
        sep += &if (2..5).contains(&i) {
            format!("{}:|", "-".repeat(w + 1))
        } else {
            format!("{}|", "-".repeat(w + 2))
        };
    }
    println!("{sep}");
    for c in &cells {
        println!("{}", line(c));
    }
}

/// Child processes of this process still alive (workers that were not reaped).
fn live_children() -> Vec<String> {
    let mut out = Vec::new();
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return out;
    };
    for t in tasks.flatten() {
        if let Ok(s) = std::fs::read_to_string(t.path().join("children")) {
            for pid in s.split_whitespace() {
                let state = std::fs::read_to_string(format!("/proc/{pid}/stat"))
                    .ok()
                    .and_then(|st| {
                        st.rsplit_once(')')
                            .map(|(_, r)| r.trim().chars().next().unwrap_or('?'))
                    })
                    .unwrap_or('?');
                out.push(format!("{pid} ({state})"));
            }
        }
    }
    out
}

fn run(args: &Args) -> Result<Vec<Row>> {
    let mut b = Bench {
        rt: Runtime::new()?,
        opts: match args.buffer_bytes {
            Some(b) => CompileOptions::default().buffer_size_bytes(b),
            None => CompileOptions::default(),
        },
        counts: Counts::new(args),
        filter: args.filter.clone(),
        rows: Vec::new(),
    };
    b.echo(Placement::Thread).context("echo/thread")?;
    b.echo(Placement::Process).context("echo/process")?;
    // The floors right after the rows read against them: a host whose speed drifts during a
    // run (floors of 0.18 and 0.26 µs in two rounds of one compare.py run here) drifts under
    // both, not under the echoes only or the floors only. Not before them: the first threads
    // of a fresh process can start on one CPU (a quick run's thread floor took ~100 µs so).
    b.floors().context("floors")?;
    b.call(Placement::Thread).context("call/thread")?;
    b.call(Placement::Process).context("call/process")?;
    b.chain3(Placement::Thread, false)
        .context("chain3/thread")?;
    b.chain3(Placement::Process, true)
        .context("chain3/process")?;
    b.fanout4().context("fanout4")?;
    b.payloads().context("payloads")?;
    b.transforms().context("transforms")?;
    b.tensor_edges().context("tensor_edges")?;
    b.async_echo().context("async_echo")?;
    b.compile().context("compile")?;
    b.hosts().context("hosts")?;
    Ok(b.rows)
}

fn main() -> Result<()> {
    adag::init();
    let args = Args::parse();
    if args.scale {
        return scale::run(args.quick, args.filter.as_deref(), args.json.as_deref());
    }
    let machine = Machine::probe();
    eprintln!(
        "adag-bench {}: {} CPU(s), {}{}",
        env!("CARGO_PKG_VERSION"),
        machine.cpus,
        machine.cpu_model,
        if args.quick { " (quick)" } else { "" }
    );
    let started = Instant::now();
    let load_before = loadavg();
    let rows = run(&args)?;
    let load_after = loadavg();
    if rows.is_empty() {
        bail!(
            "no workload matches --filter {:?}",
            args.filter.as_deref().unwrap_or("")
        );
    }
    print_table(&rows);
    if let Some(path) = &args.json {
        let report = Report {
            system: "adag",
            version: env!("CARGO_PKG_VERSION"),
            quick: args.quick,
            machine,
            load_before,
            load_after,
            results: rows,
        };
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    // Every graph was torn down and every handle dropped: workers must be gone.
    let deadline = Instant::now() + Duration::from_secs(2);
    let mut left = live_children();
    while !left.is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        left = live_children();
    }
    if !left.is_empty() {
        bail!(
            "worker processes still alive after every handle was dropped: {}",
            left.join(", ")
        );
    }
    eprintln!(
        "done in {:.1} s; load average {:.2} before, {:.2} after",
        started.elapsed().as_secs_f64(),
        load_before[0],
        load_after[0]
    );
    Ok(())
}
