//! The main demo: a three-stage pipeline of actors in worker processes, compiled once and
//! executed many times, beside the same work done with one-off calls.
//!
//! Run: `cargo run --release --example demo`; with `ADAG_TIMELINE=demo.json` it also writes
//! the timeline of every operation (open it in <https://ui.perfetto.dev>, or draw it with
//! `scripts/timeline_png.py`), and with `RUST_LOG`-style tracing set up by the caller the
//! workers' events reach the driver (see `docs/observability.md`).
use adag::{CompileOptions, Dag, Placement, Runtime};
use std::time::{Duration, Instant};

/// A stage that scales a vector and counts what it has seen.
pub struct Stage {
    scale: f32,
    seen: u64,
}

#[adag::actor]
impl Stage {
    pub fn new(scale: f32) -> Self {
        Stage { scale, seen: 0 }
    }

    pub fn forward(&mut self, x: Vec<f32>) -> Vec<f32> {
        self.seen += 1;
        x.into_iter().map(|v| v * self.scale).collect()
    }

    pub fn seen(&self) -> u64 {
        self.seen
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p) as usize]
}

/// Print the graph's statistics: how long each stage computed of the time the graph ran, and
/// what each edge carried.
fn where_the_time_went(stats: &adag::GraphStats, wall: Duration) {
    println!(
        "where the time went ({} executions in {wall:.2?}):",
        stats.executions_submitted
    );
    let mut most = 0.0f64;
    for a in &stats.actors {
        most = most.max(a.busy.as_secs_f64() / wall.as_secs_f64());
        println!(
            "  {:<10} pid {:>7}: {:>6} executions, computing {:>9.2?} ({:>4.1}% of the time, {:.2?} per execution)",
            a.actor,
            a.pid.map_or_else(|| "-".into(), |p| p.to_string()),
            a.executions,
            a.busy,
            100.0 * a.busy.as_secs_f64() / wall.as_secs_f64(),
            a.busy / a.executions.max(1) as u32,
        );
    }
    for e in &stats.edges {
        println!(
            "  edge {:<16} {:>6} messages, {:>6.1} MB through shared memory, grew {} times",
            e.label,
            e.messages,
            e.bytes as f64 / 1e6,
            e.growths
        );
    }
    println!(
        "  the busiest stage computed {:.1}% of the time: the rest went to moving values between processes and waiting for them",
        100.0 * most
    );
}

fn main() -> anyhow::Result<()> {
    adag::init();
    let rt = Runtime::new()?;
    let stages = [
        rt.spawn::<Stage>(Placement::Process, 2.0)?,
        rt.spawn::<Stage>(Placement::Process, 0.5)?,
        rt.spawn::<Stage>(Placement::Process, 3.0)?,
    ];
    println!(
        "spawned 3 worker processes: pids {:?}",
        stages
            .iter()
            .map(|s| s.pid().unwrap_or(0))
            .collect::<Vec<_>>()
    );

    let dag = Dag::<Vec<f32>>::new();
    let x = dag.input();
    let y = stages[2].forward(stages[1].forward(stages[0].forward(x)));
    let t = Instant::now();
    let graph = dag.compile(y, CompileOptions::default().max_inflight_executions(16))?;
    println!(
        "compiled a 3-stage pipeline across processes in {:?}",
        t.elapsed()
    );

    let input = vec![1.0f32; 256];
    let started = Instant::now();
    let out = graph.execute(input.clone())?.get()?;
    assert!(out.iter().all(|v| (*v - 3.0).abs() < 1e-6));
    println!("one execution: [1.0; 256] -> [{}; 256]", out[0]);

    // Synchronous round trips.
    let n = 20_000;
    let mut lat = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        graph.execute(input.clone())?.get()?;
        lat.push(t.elapsed());
    }
    lat.sort();
    println!(
        "compiled graph, sync:      p50 {:>8.1?}  p99 {:>8.1?}  ({n} executions)",
        percentile(&lat, 0.5),
        percentile(&lat, 0.99)
    );

    // Pipelined: keep 8 executions in flight.
    let t = Instant::now();
    let mut pending = std::collections::VecDeque::new();
    for _ in 0..n {
        if pending.len() == 8 {
            let r: adag::CompiledRef<Vec<f32>> = pending.pop_front().expect("non-empty");
            r.get()?;
        }
        pending.push_back(graph.execute(input.clone())?);
    }
    for r in pending {
        r.get()?;
    }
    let secs = t.elapsed().as_secs_f64();
    println!(
        "compiled graph, pipelined: {:>8.0} executions/s (8 in flight)",
        n as f64 / secs
    );
    let ran = started.elapsed();
    graph.teardown()?;
    where_the_time_went(&graph.stats(), ran);

    // The baseline: the same three calls made one by one.
    let m = 2_000;
    let mut lat = Vec::with_capacity(m);
    for _ in 0..m {
        let t = Instant::now();
        let a = stages[0].call().forward(input.clone())?;
        let b = stages[1].call().forward(a)?;
        stages[2].call().forward(b)?;
        lat.push(t.elapsed());
    }
    lat.sort();
    println!(
        "one-off calls, sync:       p50 {:>8.1?}  p99 {:>8.1?}  ({m} round trips of 3 calls)",
        percentile(&lat, 0.5),
        percentile(&lat, 0.99)
    );
    println!("stage 0 saw {} inputs", stages[0].call().seen()?);
    Ok(())
}
