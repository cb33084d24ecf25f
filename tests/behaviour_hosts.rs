//! The behaviour suite's graph shapes with their actors spread over three hosts (separate
//! process trees on loopback), so that the edges between them are TCP channels, and over a
//! mix of hosts, worker processes and threads of the driver's host.
mod common;

use adag::cluster::{ClusterOptions, HostInfo, LocalHosts};
use adag::{ActorHandle, CompileOptions, Dag, Error, Placement, RefSet, Runtime};
use common::{Worker, with_watchdog};
use std::time::Duration;

const SECRET: &str = "behaviour-hosts";

struct Cluster {
    rt: Runtime,
    _hosts: LocalHosts,
    hosts: Vec<HostInfo>,
    next: std::cell::Cell<usize>,
}

impl Cluster {
    fn start() -> Cluster {
        let rt = Runtime::new().unwrap();
        let addr = rt.listen(ClusterOptions::new(SECRET)).unwrap();
        let hosts = LocalHosts::start(3, addr, SECRET).unwrap();
        let mut joined = rt.wait_for_hosts(3, Duration::from_secs(60)).unwrap();
        joined.sort_by(|a, b| a.name.cmp(&b.name));
        Cluster {
            rt,
            _hosts: hosts,
            hosts: joined,
            next: std::cell::Cell::new(0),
        }
    }

    /// A `Worker(k)` on the next host, round robin.
    fn worker(&self, k: u64) -> ActorHandle<Worker> {
        let i = self.next.get();
        self.next.set(i + 1);
        let h = &self.hosts[i % self.hosts.len()];
        self.rt
            .spawn::<Worker>(Placement::Host(h.id), k)
            .unwrap_or_else(|e| panic!("spawn Worker({k}) on {}: {e}", h.name))
    }
}

fn opts() -> CompileOptions {
    CompileOptions::default().get_timeout(Duration::from_secs(60))
}

fn run(name: &str, body: impl FnOnce(&Cluster) + Send + 'static) {
    with_watchdog(name, 120, move || body(&Cluster::start()));
}

#[test]
fn input_parts_and_constants() {
    run("input_parts_and_constants", |c| {
        let (a, b) = (c.worker(1000), c.worker(0));
        let dag = Dag::<(u64, u64, u64)>::new();
        let input = dag.input();
        let y = a.add3(input.arg::<0>(), input.arg::<1>(), input.arg::<2>());
        let z = b.add(&y, 5u64);
        let g = dag.compile(z, opts()).unwrap();
        assert_eq!(g.execute((1, 2, 3)).unwrap().get().unwrap(), 1128);
        assert_eq!(g.execute((3, 2, 1)).unwrap().get().unwrap(), 1326);
    });
}

#[test]
fn chain_fan_out_fan_in_and_diamond() {
    run("chain_fan_out_fan_in_and_diamond", |c| {
        let (a, b, d, e) = (c.worker(1), c.worker(10), c.worker(100), c.worker(0));
        let dag = Dag::<u64>::new();
        let x = a.echo(dag.input());
        // Diamond: x read on two hosts, joined on a third (order-sensitive).
        let top = b.echo(&x);
        let bottom = d.echo(&x);
        let joined = e.combine(&top, &bottom);
        let g = dag.compile((x, joined), opts()).unwrap();
        for i in 0..30u64 {
            let (x, j) = RefSet::get(g.execute(i).unwrap()).unwrap();
            assert_eq!(x, i + 1);
            assert_eq!(j, 1000 * (i + 11) + (i + 101));
        }
    });
}

#[test]
fn same_actor_several_times_and_its_own_intermediates() {
    run("same_actor_several_times", |c| {
        let (a, b) = (c.worker(1), c.worker(10));
        let dag = Dag::<u64>::new();
        let x = a.echo(dag.input());
        let y = a.echo(&x); // a reads its own value (the in-actor slot)
        let z = b.add(&x, &y); // and b reads both across hosts
        let g = dag.compile((x, y, z), opts()).unwrap();
        let (x, y, z) = RefSet::get(g.execute(5).unwrap()).unwrap();
        assert_eq!((x, y, z), (6, 7, 23));
    });
}

#[test]
fn multi_output_split_and_the_same_node_twice() {
    run("multi_output_split", |c| {
        let (a, b) = (c.worker(1), c.worker(0));
        let dag = Dag::<u64>::new();
        let (n, s) = a.pair(dag.input()).split();
        let len = b.strlen(&s);
        let outs = vec![n.clone(), len, n];
        let g = dag.compile(outs, opts()).unwrap();
        assert_eq!(RefSet::get(g.execute(7).unwrap()).unwrap(), vec![8, 2, 8]);
        assert_eq!(
            RefSet::get(g.execute(123).unwrap()).unwrap(),
            vec![124, 4, 124]
        );
    });
}

#[test]
fn task_errors_and_panics_cross_hosts_and_the_graph_goes_on() {
    run("task_errors_cross_hosts", |c| {
        let (a, b, d) = (c.worker(1), c.worker(1), c.worker(0));
        let dag = Dag::<u64>::new();
        let checked = a.checked(dag.input());
        let boomed = b.boom(&checked);
        let out = d.combine(&checked, &boomed);
        let g = dag.compile(out, opts()).unwrap();
        assert_eq!(g.execute(1).unwrap().get().unwrap(), 2000 + 3);
        match g.execute(3).unwrap().get() {
            Err(Error::Task { actor, message, .. }) => {
                assert_eq!(actor, a.name());
                assert!(message.contains("bad input 3"), "{message}");
            }
            other => panic!("expected the task error of {}: {other:?}", a.name()),
        }
        match g.execute(12).unwrap().get() {
            Err(Error::Task { actor, message, .. }) => {
                assert_eq!(actor, b.name());
                assert!(message.contains("boom at 13"), "{message}");
            }
            other => panic!("expected the panic of {}: {other:?}", b.name()),
        }
        assert_eq!(g.execute(4).unwrap().get().unwrap(), 5000 + 6);
    });
}

#[test]
fn pipelined_executions_in_order_across_hosts_and_placements() {
    run("pipelined_mixed", |c| {
        let a = c.worker(1);
        let b = c.rt.spawn::<Worker>(Placement::Process, 10).unwrap();
        let d = c.worker(100);
        let e = c.rt.spawn::<Worker>(Placement::Thread, 1000).unwrap();
        let dag = Dag::<u64>::new();
        let out = e.echo(d.echo(b.echo(a.echo(dag.input()))));
        let g = dag.compile(out, opts().max_inflight_executions(8)).unwrap();
        let mut next = 0u64;
        let mut pending = std::collections::VecDeque::new();
        for i in 0..2_000u64 {
            if pending.len() == 8 {
                let r: adag::CompiledRef<u64> = pending.pop_front().unwrap();
                assert_eq!(r.get().unwrap(), next + 1111);
                next += 1;
            }
            pending.push_back(g.execute(i).unwrap());
        }
        for r in pending {
            assert_eq!(r.get().unwrap(), next + 1111);
            next += 1;
        }
    });
}

#[test]
fn messages_larger_than_a_slot_grow_and_the_ceiling_is_a_clear_error() {
    run("large_messages", |c| {
        let (a, b) = (c.worker(0), c.worker(0));
        let dag = Dag::<String>::new();
        let out = b.shout(a.shout(dag.input()));
        let g = dag
            .compile(
                out,
                opts().buffer_size_bytes(1024).max_message_bytes(4 << 20),
            )
            .unwrap();
        for n in [10usize, 5_000, 1 << 20] {
            let s = "x".repeat(n);
            assert_eq!(g.execute(s.clone()).unwrap().get().unwrap(), s + "!!");
        }
        let err = g
            .execute("y".repeat(5 << 20))
            .and_then(|r| r.get())
            .unwrap_err();
        assert!(
            matches!(err, Error::MessageTooLarge { .. }),
            "a message over the ceiling: {err:?}"
        );
    });
}

#[test]
fn execute_and_get_from_several_threads() {
    run("several_threads", |c| {
        let (a, b) = (c.worker(1), c.worker(2));
        let dag = Dag::<u64>::new();
        let g = std::sync::Arc::new(
            dag.compile(
                b.echo(a.echo(dag.input())),
                opts().max_inflight_executions(16),
            )
            .unwrap(),
        );
        let threads: Vec<_> = (0..4u64)
            .map(|t| {
                let g = g.clone();
                std::thread::spawn(move || {
                    for i in 0..200u64 {
                        let x = t * 1000 + i;
                        assert_eq!(g.execute(x).unwrap().get().unwrap(), x + 3);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
    });
}
