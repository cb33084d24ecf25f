//! A driver that compiles and tears down graphs for a long time (a service compiling a graph
//! per request or per model reload) holds no more memory after thousands of graphs than
//! after the first few: counted exactly, by a counting global allocator in this binary.
#[path = "common/alloc.rs"]
mod alloc;

use adag::{CompileOptions, Dag, Placement, Runtime};
use alloc::settled_live_bytes;
use std::sync::Mutex;
use std::time::Duration;

const GET: Duration = Duration::from_secs(60);

/// The allocator counts the whole process: the tests of this file take turns.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

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

/// One cycle as a service runs it: (spawn 3 actors when `spawn`), compile a chain, 100
/// executions, teardown, (drop the actors).
fn cycle(rt: &Runtime, placement: Placement, actors: Option<&[adag::ActorHandle<Stage>]>) {
    let spawned;
    let chain = match actors {
        Some(a) => a,
        None => {
            spawned = (1..=3u64)
                .map(|k| rt.spawn::<Stage>(placement, k).unwrap())
                .collect::<Vec<_>>();
            &spawned[..]
        }
    };
    let dag = Dag::<u64>::new();
    let out = chain[2].step(chain[1].step(chain[0].step(dag.input())));
    let g = dag.compile(out, CompileOptions::default()).unwrap();
    for i in 0..100u64 {
        assert_eq!(g.execute(i).unwrap().get_timeout(GET).unwrap(), i + 6);
    }
    g.teardown().unwrap();
}

/// Runs `warm` cycles, reads what the driver holds, runs `cycles` more, reads again, and
/// fails if the driver grew by more than `per_cycle` bytes a cycle on average (a leak of one
/// small record a graph is far above it: the bug this guards against was ~2.2 KiB a graph).
fn assert_flat(name: &str, warm: usize, cycles: usize, per_cycle: isize, mut run: impl FnMut()) {
    for _ in 0..warm {
        run();
    }
    let before = settled_live_bytes();
    let start = std::time::Instant::now();
    for _ in 0..cycles {
        run();
    }
    let took = start.elapsed();
    let after = settled_live_bytes();
    let grew = after - before;
    eprintln!(
        "{name}: {cycles} cycles of {:.2} ms, driver holds {before} B before, {after} B after ({:+.1} B a cycle)",
        took.as_secs_f64() * 1e3 / cycles as f64,
        grew as f64 / cycles as f64
    );
    assert!(
        grew <= per_cycle * cycles as isize,
        "{name}: the driver grew by {grew} B over {cycles} compile+teardown cycles ({} B a cycle); \
         something each graph makes is kept after teardown",
        grew / cycles as isize
    );
}

#[test]
fn thousands_of_graphs_over_thread_actors_leave_nothing_behind() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let rt = Runtime::new().unwrap();
    assert_flat("thread actors, spawned each cycle", 100, 2000, 16, || {
        cycle(&rt, Placement::Thread, None)
    });
    let actors: Vec<_> = (1..=3u64)
        .map(|k| rt.spawn::<Stage>(Placement::Thread, k).unwrap())
        .collect();
    assert_flat("thread actors, kept", 100, 2000, 16, || {
        cycle(&rt, Placement::Thread, Some(&actors))
    });
}

#[test]
fn thousands_of_graphs_over_process_actors_leave_nothing_behind() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let rt = Runtime::new().unwrap();
    let actors: Vec<_> = (1..=3u64)
        .map(|k| rt.spawn::<Stage>(Placement::Process, k).unwrap())
        .collect();
    assert_flat("process actors, kept", 100, 1000, 16, || {
        cycle(&rt, Placement::Process, Some(&actors))
    });
    assert_flat("process actors, spawned each cycle", 20, 100, 64, || {
        cycle(&rt, Placement::Process, None)
    });
}

/// Resident memory of process `pid` in bytes (from /proc; agents are other processes, so
/// the counting allocator of this one does not see them).
fn rss_bytes(pid: u32) -> u64 {
    let statm = std::fs::read_to_string(format!("/proc/{pid}/statm")).unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

/// The same over hosts: three agents (separate process trees on loopback), one actor on
/// each, a chain compiled and torn down again and again. The driver is counted exactly; the
/// agents by their resident memory, which must level off: after a warm-up, 1,000 more graphs
/// may not add more than 256 B a graph to any agent (the driver's leak was ~2.2 KiB a graph).
#[test]
fn thousands_of_graphs_over_hosts_leave_nothing_behind_in_driver_or_agents() {
    use adag::cluster::{ClusterOptions, LocalHosts};
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let secret = "churn-secret-5d1";
    let rt = Runtime::new().unwrap();
    let addr = rt.listen(ClusterOptions::new(secret)).unwrap();
    let hosts = LocalHosts::start(3, addr, secret).unwrap();
    let mut joined = rt.wait_for_hosts(3, GET).unwrap();
    joined.sort_by(|a, b| a.name.cmp(&b.name));
    let actors: Vec<_> = joined
        .iter()
        .zip(1..=3u64)
        .map(|(h, k)| rt.spawn::<Stage>(Placement::Host(h.id), k).unwrap())
        .collect();
    let pids = hosts.pids();
    for _ in 0..300 {
        cycle(&rt, Placement::Thread, Some(&actors));
    }
    let agents_before: Vec<u64> = pids.iter().map(|&p| rss_bytes(p)).collect();
    assert_flat("actors on 3 hosts, kept", 0, 1000, 16, || {
        cycle(&rt, Placement::Thread, Some(&actors))
    });
    let agents_after: Vec<u64> = pids.iter().map(|&p| rss_bytes(p)).collect();
    for (i, (b, a)) in agents_before.iter().zip(&agents_after).enumerate() {
        eprintln!(
            "agent {i} (pid {}): resident {b} B before, {a} B after 1000 graphs",
            pids[i]
        );
        assert!(
            *b > 0 && *a > 0,
            "could not read the resident memory of agent {i}"
        );
        assert!(
            a.saturating_sub(*b) <= 256 * 1000,
            "agent {i} grew by {} B over 1000 graphs: each graph leaves something behind on the host",
            a - b
        );
    }
}
