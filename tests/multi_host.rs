//! Graphs across hosts: hosts are separate process trees on this machine (this test
//! executable started with `ADAG_JOIN`/`ADAG_TOKEN`), so that every edge between actors on
//! different hosts is a real TCP channel on loopback. Every wait is bounded.
use adag::cluster::{ClusterOptions, HostInfo, LocalHosts};
use adag::{Buffer, CompileOptions, Dag, Placement, Runtime};
use std::time::Duration;

const SECRET: &str = "multi-host-secret-9f2";
const JOIN_TIMEOUT: Duration = Duration::from_secs(60);
const GET: Duration = Duration::from_secs(60);

/// A stage of a pipeline on some host.
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
    pub fn echo(&mut self, b: Buffer) -> Buffer {
        b
    }
    pub fn sum(&mut self, a: u64, b: u64) -> u64 {
        a + b + self.add
    }
    pub fn nap(&mut self, x: u64) -> u64 {
        if x == 1 {
            std::thread::sleep(Duration::from_millis(1500));
        }
        x + self.add
    }
    pub fn host_pid(&mut self) -> u32 {
        std::process::id()
    }
}

fn cluster(n: usize) -> (Runtime, LocalHosts, Vec<HostInfo>) {
    let rt = Runtime::new().unwrap();
    let addr = rt
        .listen(
            ClusterOptions::new(SECRET)
                .heartbeat_interval(Duration::from_millis(100))
                .heartbeat_timeout(Duration::from_secs(3)),
        )
        .unwrap();
    let hosts = LocalHosts::start(n, addr, SECRET).unwrap();
    let mut joined = rt.wait_for_hosts(n, JOIN_TIMEOUT).unwrap();
    joined.sort_by(|a, b| a.name.cmp(&b.name));
    (rt, hosts, joined)
}

fn on(rt: &Runtime, h: &HostInfo, add: u64) -> adag::ActorHandle<Stage> {
    rt.spawn::<Stage>(Placement::Host(h.id), add)
        .unwrap_or_else(|e| panic!("spawn on {}: {e}", h.name))
}

/// A chain over three hosts, executed one at a time and pipelined.
#[test]
fn a_chain_over_three_hosts() {
    let (rt, _hosts, h) = cluster(3);
    let a = on(&rt, &h[0], 1);
    let b = on(&rt, &h[1], 10);
    let c = on(&rt, &h[2], 100);
    let dag = Dag::<u64>::new();
    let out = c.step(b.step(a.step(dag.input())));
    let g = dag
        .compile(out, CompileOptions::default().max_inflight_executions(16))
        .unwrap();
    for i in 0..50u64 {
        assert_eq!(g.execute(i).unwrap().get_timeout(GET).unwrap(), i + 111);
    }
    let refs: Vec<_> = (0..16u64).map(|i| g.execute(i).unwrap()).collect();
    for (i, r) in refs.into_iter().enumerate() {
        assert_eq!(r.get_timeout(GET).unwrap(), i as u64 + 111);
    }
    g.teardown().unwrap();
    // The actors are free again: one-off calls, and a second graph.
    assert_eq!(a.call().step(1).unwrap(), 2);
    let dag = Dag::<u64>::new();
    let g = dag
        .compile(a.step(c.step(dag.input())), CompileOptions::default())
        .unwrap();
    assert_eq!(g.execute(5).unwrap().get_timeout(GET).unwrap(), 106);
}
