//! A compiled graph across hosts: three agents started on this machine as separate process
//! trees (what a cluster launcher does on real hosts, see docs/multi-host.md), one pipeline
//! stage on each, every edge between them a TCP channel; then a host killed and its graph
//! failing with an error that names it.
//!
//! Run: `cargo run --release --example hosts`
use adag::cluster::{ClusterOptions, LocalHosts};
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
    let rt = Runtime::new()?;
    let secret = format!("demo-{}", std::process::id());
    let addr = rt.listen(ClusterOptions::new(secret.clone()))?;
    println!("driver listening on {addr} (loopback)");
    let start = Instant::now();
    let mut hosts = LocalHosts::start(3, addr, &secret)?;
    let mut joined = rt.wait_for_hosts(3, Duration::from_secs(60))?;
    joined.sort_by(|a, b| a.name.cmp(&b.name));
    for h in &joined {
        println!(
            "  host {} {:<8} from {} ({} cores, agent pid {})",
            h.id, h.name, h.address, h.cores, h.pid
        );
    }
    println!("3 hosts joined in {:?}", start.elapsed());

    // One stage per host: driver → local-0 → local-1 → local-2 → driver.
    let stages = joined
        .iter()
        .zip([1u64, 10, 100])
        .map(|(h, add)| rt.spawn::<Stage>(Placement::Host(h.id), add))
        .collect::<adag::Result<Vec<_>>>()?;
    let dag = Dag::<u64>::new();
    let out = stages[2].step(stages[1].step(stages[0].step(dag.input())));
    let graph = dag.compile(out, CompileOptions::default().max_inflight_executions(16))?;
    let n = 20_000u64;
    let t = Instant::now();
    for i in 0..2_000 {
        assert_eq!(graph.execute(i)?.get()?, i + 111);
    }
    let sync = t.elapsed() / 2_000;
    let t = Instant::now();
    let mut pending = std::collections::VecDeque::new();
    for i in 0..n {
        if pending.len() == 16 {
            let (j, r): (u64, adag::CompiledRef<u64>) = pending.pop_front().expect("full");
            assert_eq!(r.get()?, j + 111);
        }
        pending.push_back((i, graph.execute(i)?));
    }
    for (j, r) in pending {
        assert_eq!(r.get()?, j + 111);
    }
    let rate = n as f64 / t.elapsed().as_secs_f64();
    println!(
        "chain over 3 hosts (4 TCP hops): {sync:?} per execution one at a time, {rate:.0} executions/s with 16 in flight"
    );

    // A worker on another host dies: its agent reports it, the graph fails with ActorDied.
    stages[1].kill()?;
    let killed = Instant::now();
    match graph
        .execute(0)
        .and_then(|r| r.get_timeout(Duration::from_secs(30)))
    {
        Err(e) => println!(
            "killed {}'s worker; {:?} later the graph says: {e}",
            joined[1].name,
            killed.elapsed()
        ),
        Ok(v) => anyhow::bail!("the graph still answered {v} without its middle stage"),
    }

    // A whole host is lost: a new graph over the survivors and a new stage fails, naming it.
    let middle = rt.spawn::<Stage>(Placement::Host(joined[1].id), 10)?;
    let dag = Dag::<u64>::new();
    let out = stages[2].step(middle.step(stages[0].step(dag.input())));
    let graph = dag.compile(out, CompileOptions::default())?;
    assert_eq!(graph.execute(1)?.get()?, 112);
    hosts.kill(2)?;
    let killed = Instant::now();
    match graph
        .execute(0)
        .and_then(|r| r.get_timeout(Duration::from_secs(30)))
    {
        Err(e) => println!(
            "killed host {}; {:?} later the graph says: {e}",
            joined[2].name,
            killed.elapsed()
        ),
        Ok(v) => anyhow::bail!(
            "the graph still answered {v} without host {}",
            joined[2].name
        ),
    }
    for h in rt.hosts() {
        match &h.lost {
            None => println!("host {} ({}): alive", h.name, h.id),
            Some(loss) => println!("host {} ({}): lost: {}", h.name, h.id, loss.reason),
        }
    }
    Ok(())
}
