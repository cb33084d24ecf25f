//! Criterion benchmarks: one synchronous `execute` + `get` round trip per iteration.
//!
//! ```text
//! cargo bench -p adag-bench --bench graphs
//! cargo bench -p adag-bench --bench graphs -- chain3_process     # one group
//! ```
//!
//! Process actors re-start this same executable in worker mode; adag's start-up hook runs
//! before criterion's `main`, so worker processes never reach criterion.

use adag::{CompileOptions, Placement, Runtime};
use adag_bench::{chain, fanout, spawn_stages};
use criterion::{Criterion, criterion_group, criterion_main};
use std::hint::black_box;
use std::time::Duration;

fn group(c: &mut Criterion, name: &str, placement: Placement, actors: usize, fan_out: bool) {
    let rt = Runtime::new().expect("runtime");
    let stages = spawn_stages(&rt, placement, actors).expect("spawn actors");
    let mut g = c.benchmark_group(name);
    g.warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    if fan_out {
        let graph = fanout(&stages, CompileOptions::default()).expect("compile");
        let mut i = 0u64;
        g.bench_function("execute_get", |b| {
            b.iter(|| {
                i += 1;
                let out = graph.execute(black_box(i)).expect("execute");
                let v = adag::get_all(out).expect("get");
                assert_eq!(v[3], i + 1);
                v
            })
        });
        graph.teardown().expect("teardown");
    } else {
        let graph = chain(&stages, CompileOptions::default()).expect("compile");
        let mut i = 0u64;
        g.bench_function("execute_get", |b| {
            b.iter(|| {
                i += 1;
                let v = graph
                    .execute(black_box(i))
                    .expect("execute")
                    .get()
                    .expect("get");
                assert_eq!(v, i + actors as u64);
                v
            })
        });
        graph.teardown().expect("teardown");
    }
    g.finish();
}

fn echo_thread(c: &mut Criterion) {
    group(c, "echo_thread", Placement::Thread, 1, false);
}

fn echo_process(c: &mut Criterion) {
    group(c, "echo_process", Placement::Process, 1, false);
}

fn chain3_thread(c: &mut Criterion) {
    group(c, "chain3_thread", Placement::Thread, 3, false);
}

fn chain3_process(c: &mut Criterion) {
    group(c, "chain3_process", Placement::Process, 3, false);
}

fn fanout4_process(c: &mut Criterion) {
    group(c, "fanout4_process", Placement::Process, 4, true);
}

criterion_group!(
    benches,
    echo_thread,
    echo_process,
    chain3_thread,
    chain3_process,
    fanout4_process
);
criterion_main!(benches);
