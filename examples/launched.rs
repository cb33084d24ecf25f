//! A driver that a launcher configures: it listens where `ADAG_LISTEN` says (with the secret
//! of `ADAG_TOKEN`) without a line of its own about it, waits for the hosts the launcher
//! started, runs a chain with one stage on each, and prints what it did. The same binary,
//! started with `ADAG_JOIN` instead, is a host's agent. The recipes of `deploy/` start it:
//!
//! ```sh
//! deploy/ssh/launch.sh --listen 10.0.0.1:7070 node1 node2 -- ./target/release/examples/launched 2
//! ```
//!
//! Run alone (no hosts): `ADAG_LISTEN=127.0.0.1:7070 ADAG_TOKEN=s3cret cargo run --release
//! --example launched 0`
use adag::{CompileOptions, Dag, Placement, Runtime};
use std::time::{Duration, Instant};

pub struct Stage {
    add: u64,
}

#[adag::actor]
impl Stage {
    pub fn new(add: u64) -> Self {
        Stage { add }
    }
    pub fn step(&mut self, x: u64) -> u64 {
        x + self.add
    }
}

fn main() -> anyhow::Result<()> {
    let expected: usize = std::env::args()
        .nth(1)
        .map(|n| n.parse())
        .transpose()?
        .unwrap_or(2);
    // ADAG_LISTEN and ADAG_TOKEN come from the launcher: Runtime::new listens there.
    let rt = Runtime::new()?;
    let start = Instant::now();
    let hosts = rt.wait_for_hosts(expected, Duration::from_secs(300))?;
    println!(
        "{} hosts joined in {:.1?}: {}",
        hosts.len(),
        start.elapsed(),
        hosts
            .iter()
            .map(|h| format!("{} (id {}, from {})", h.name, h.id, h.address))
            .collect::<Vec<_>>()
            .join(", ")
    );
    // The chain starts on the driver's host (so it has a stage without hosts too).
    let first = rt.spawn::<Stage>(Placement::Process, 0)?;
    let mut stages = Vec::new();
    for (i, h) in hosts.iter().enumerate() {
        stages.push(rt.spawn::<Stage>(Placement::Host(h.id), 10u64.pow(i as u32))?);
    }
    let dag = Dag::<u64>::new();
    let mut node = first.step(dag.input());
    for s in &stages {
        node = s.step(node);
    }
    let graph = dag.compile(node, CompileOptions::default())?;
    let runs = 1_000u64;
    let t = Instant::now();
    let mut last = 0;
    for i in 0..runs {
        last = graph.execute(i)?.get()?;
    }
    let each = t.elapsed() / runs as u32;
    let expected_sum: u64 = (0..hosts.len()).map(|i| 10u64.pow(i as u32)).sum();
    anyhow::ensure!(
        last == runs - 1 + expected_sum,
        "the chain answered {last}, not {}",
        runs - 1 + expected_sum
    );
    println!(
        "a chain over {} hosts and this one: {runs} executions, {each:.1?} each; last answer {last} (correct)",
        hosts.len()
    );
    for (s, h) in stages.iter().zip(&hosts) {
        println!("  stage on {}: worker pid {:?}", h.name, s.pid());
    }
    graph.teardown()?;
    Ok(())
}
