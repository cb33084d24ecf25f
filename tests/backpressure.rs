//! Back-pressure and pipelining: `execute_wait` / `execute_async_wait` wait for room (up to
//! `submit_timeout`), cancelled waits leave the graph's capacity as it was, and the
//! pipelining helpers yield every result in order with `depth` executions in flight. Sync and
//! async, thread and process actors.
mod common;
use adag::{Capacity, CompileOptions, CompiledRef, Dag, Error, Runtime};
use common::{each_placement, worker};
use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

fn tokio_rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// A minimal executor (no tokio): parks the thread until the future's waker is called, so
/// that a deadline can only fire through the crate's own timer.
fn block_on<F: Future>(f: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    loop {
        match f.as_mut().poll(&mut cx) {
            Poll::Ready(v) => return v,
            Poll::Pending => std::thread::park(),
        }
    }
}

/// Poll a future exactly once with a waker that does nothing.
fn poll_once<F: Future + Unpin>(f: &mut F) -> Poll<F::Output> {
    let mut cx = Context::from_waker(Waker::noop());
    Pin::new(f).poll(&mut cx)
}

fn is_full<T>(r: &adag::Result<T>) -> bool {
    matches!(
        r,
        Err(Error::CapacityExceeded {
            capacity: Capacity::InflightExecutions,
            ..
        })
    )
}

#[track_caller]
fn assert_submit_timeout<T: std::fmt::Debug>(r: adag::Result<T>, timeout: Duration) {
    match r {
        Err(e @ Error::Timeout { .. }) => {
            let Error::Timeout { timeout: t, .. } = &e else {
                unreachable!()
            };
            assert_eq!(*t, timeout);
            let text = e.to_string();
            assert!(text.contains("submit_timeout"), "{text}");
            assert!(text.contains("max_inflight_executions"), "{text}");
        }
        other => panic!("expected a submit timeout, got {other:?}"),
    }
}

// -------------------------------------------------------------------------------------
// Sync: execute_wait
// -------------------------------------------------------------------------------------

#[test]
fn execute_wait_waits_then_succeeds_when_another_thread_claims() {
    each_placement(
        "execute_wait_waits_then_succeeds_when_another_thread_claims",
        |p| {
            let rt = Runtime::new().unwrap();
            let a = worker(&rt, p, 100);
            let dag = Dag::<u64>::new();
            let g = dag
                .compile(
                    a.echo(dag.input()),
                    CompileOptions::default()
                        .max_inflight_executions(2)
                        .submit_timeout(Duration::from_secs(30)),
                )
                .unwrap();
            let r0 = g.execute(0).unwrap();
            let r1 = g.execute(1).unwrap();
            assert!(is_full(&g.execute(2)), "the graph should be full");
            let claimer = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                r0.get()
            });
            let r2 = g.execute_wait(2).unwrap();
            assert_eq!(claimer.join().unwrap().unwrap(), 100);
            assert_eq!(r2.execution(), 2);
            assert_eq!((r1.get().unwrap(), r2.get().unwrap()), (101, 102));
        },
    );
}

#[test]
fn execute_wait_takes_the_room_of_refs_dropped_by_another_thread() {
    each_placement(
        "execute_wait_takes_the_room_of_refs_dropped_by_another_thread",
        |p| {
            let rt = Runtime::new().unwrap();
            let a = worker(&rt, p, 0);
            let dag = Dag::<u64>::new();
            let g = dag
                .compile(
                    a.echo(dag.input()),
                    CompileOptions::default()
                        .max_inflight_executions(2)
                        .submit_timeout(Duration::from_secs(30)),
                )
                .unwrap();
            let refs = vec![g.execute(0).unwrap(), g.execute(1).unwrap()];
            assert!(is_full(&g.execute(2)));
            let dropper = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                drop(refs);
            });
            let r2 = g.execute_wait(2).unwrap();
            let r3 = g.execute_wait(3).unwrap();
            dropper.join().unwrap();
            assert_eq!((r2.get().unwrap(), r3.get().unwrap()), (2, 3));
        },
    );
}

#[test]
fn execute_wait_times_out_at_submit_timeout() {
    each_placement("execute_wait_times_out_at_submit_timeout", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 0);
        let dag = Dag::<u64>::new();
        let timeout = Duration::from_millis(200);
        let g = dag
            .compile(
                a.echo(dag.input()),
                CompileOptions::default()
                    .max_inflight_executions(1)
                    .submit_timeout(timeout),
            )
            .unwrap();
        let r0 = g.execute(0).unwrap();
        assert_submit_timeout(g.execute_wait(1), timeout);
        // Nothing was submitted by the failed wait, and the graph goes on.
        assert_eq!(r0.get().unwrap(), 0);
        let r1 = g.execute_wait(1).unwrap();
        assert_eq!(r1.execution(), 1);
        assert_eq!(r1.get().unwrap(), 1);
    });
}

#[test]
fn waiting_submitters_wake_at_teardown() {
    each_placement("waiting_submitters_wake_at_teardown", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 0);
        let dag = Dag::<u64>::new();
        let g = Arc::new(
            dag.compile(
                a.echo(dag.input()),
                CompileOptions::default()
                    .max_inflight_executions(1)
                    .submit_timeout(Duration::from_secs(60)),
            )
            .unwrap(),
        );
        let _r0 = g.execute(0).unwrap();
        let g2 = g.clone();
        let waiter = std::thread::spawn(move || g2.execute_wait(1).map(|_| ()));
        std::thread::sleep(Duration::from_millis(50));
        g.teardown().unwrap();
        assert!(matches!(
            waiter.join().unwrap(),
            Err(Error::TornDown { .. })
        ));

        // Async: the same for a waiting future.
        let dag = Dag::<u64>::new();
        let g = Arc::new(
            dag.compile(
                a.echo(dag.input()),
                CompileOptions::default()
                    .enable_asyncio(true)
                    .max_inflight_executions(1)
                    .max_buffered_results(1)
                    .submit_timeout(Duration::from_secs(60)),
            )
            .unwrap(),
        );
        let _held = fill_async(&g);
        let g2 = g.clone();
        let waiter = std::thread::spawn(move || block_on(g2.execute_async_wait(1)).map(|_| ()));
        std::thread::sleep(Duration::from_millis(50));
        g.teardown().unwrap();
        assert!(matches!(
            waiter.join().unwrap(),
            Err(Error::TornDown { .. })
        ));
    });
}

// -------------------------------------------------------------------------------------
// Async: execute_async_wait
// -------------------------------------------------------------------------------------

fn async_graph(
    a: &adag::ActorHandle<common::Worker>,
    inflight: usize,
    submit_timeout: Duration,
) -> adag::CompiledGraph<u64, adag::Node<u64>> {
    let dag = Dag::<u64>::new();
    dag.compile(
        a.echo(dag.input()),
        CompileOptions::default()
            .enable_asyncio(true)
            .max_inflight_executions(inflight)
            // The pump buffers at most one result: the graph fills after inflight + 1.
            .max_buffered_results(1)
            .submit_timeout(submit_timeout),
    )
    .unwrap()
}

/// Submit until the graph refuses (the pump has buffered what it can); the refs, in order.
fn fill_async<O>(g: &adag::CompiledGraph<u64, O>) -> Vec<O::Refs>
where
    O: adag::IntoOutputs,
{
    let mut refs = Vec::new();
    let mut refused = false;
    for _ in 0..50 {
        // The values are the executions' indices: 0, 1, 2, ...
        match block_on(g.execute_async(refs.len() as u64)) {
            Ok(r) => {
                refs.push(r);
                refused = false;
            }
            // Full only when a refusal outlasts the time the pump needs to read a result
            // (a slow, loaded machine may take longer than one pause): refused twice in a row.
            Err(Error::CapacityExceeded {
                capacity: Capacity::InflightExecutions,
                ..
            }) if refused => return refs,
            Err(Error::CapacityExceeded {
                capacity: Capacity::InflightExecutions,
                ..
            }) => {
                refused = true;
                std::thread::sleep(Duration::from_millis(300));
                continue;
            }
            Err(e) => panic!("filling the graph: {e}"),
        }
        // Let the pump read what it can.
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("50 unclaimed executions never filled the graph");
}

#[test]
fn execute_async_wait_waits_then_succeeds_when_another_task_claims() {
    each_placement(
        "execute_async_wait_waits_then_succeeds_when_another_task_claims",
        |p| {
            let rt = Runtime::new().unwrap();
            let a = worker(&rt, p, 100);
            let g = Arc::new(async_graph(&a, 2, Duration::from_secs(30)));
            let mut refs = fill_async(&g);
            let n = refs.len() as u64;
            assert!(n >= 2, "only {n} executions fit");
            tokio_rt().block_on(async {
                let first = refs.remove(0);
                let claimer = tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    first.await
                });
                let next = g.execute_async_wait(n).await.unwrap();
                assert_eq!(claimer.await.unwrap().unwrap(), 100);
                assert_eq!(next.execution(), n);
                for (i, r) in refs.into_iter().enumerate() {
                    assert_eq!(r.await.unwrap(), 101 + i as u64);
                }
                assert_eq!(next.await.unwrap(), 100 + n);
            });
        },
    );
}

#[test]
fn execute_async_wait_times_out_at_submit_timeout_on_any_executor() {
    each_placement(
        "execute_async_wait_times_out_at_submit_timeout_on_any_executor",
        |p| {
            let rt = Runtime::new().unwrap();
            let a = worker(&rt, p, 0);
            let timeout = Duration::from_millis(200);
            let g = async_graph(&a, 1, timeout);
            let refs = fill_async(&g);
            let n = refs.len() as u64;
            // A plain executor: only the crate's timer can wake the future at its deadline.
            assert_submit_timeout(block_on(g.execute_async_wait(n)), timeout);
            // And under tokio.
            assert_submit_timeout(tokio_rt().block_on(g.execute_async_wait(n)), timeout);
            // Nothing was submitted; claiming makes room again.
            block_on(async {
                for (i, r) in refs.into_iter().enumerate() {
                    assert_eq!(r.await.unwrap(), i as u64);
                }
                let next = g.execute_async_wait(n).await.unwrap();
                assert_eq!(next.execution(), n);
                assert_eq!(next.await.unwrap(), n);
            });
        },
    );
}

#[test]
fn cancelled_waits_leave_capacity_intact() {
    each_placement("cancelled_waits_leave_capacity_intact", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 0);
        let g = async_graph(&a, 2, Duration::from_secs(30));
        let mut refs: std::collections::VecDeque<CompiledRef<u64>> = fill_async(&g).into();
        let full = refs.len();
        let mut next = full as u64;
        let tokio = tokio_rt();
        for round in 0..60 {
            match round % 3 {
                // Dropped while waiting, never woken.
                0 => {
                    let mut wait = Box::pin(g.execute_async_wait(1_000 + round));
                    assert!(poll_once(&mut wait).is_pending(), "round {round}");
                    drop(wait);
                }
                // Dropped after room freed (woken) but before it was polled again: it
                // submitted nothing, and the room is taken by the next submission.
                1 => {
                    let mut wait = Box::pin(g.execute_async_wait(1_000 + round));
                    assert!(poll_once(&mut wait).is_pending(), "round {round}");
                    let oldest = refs.pop_front().unwrap();
                    assert_eq!(block_on(oldest.into_future()).unwrap(), next - full as u64);
                    drop(wait);
                    let r = tokio.block_on(g.execute_async_wait(next)).unwrap();
                    assert_eq!(r.execution(), next, "round {round}");
                    refs.push_back(r);
                    next += 1;
                }
                // Cancelled by a timeout of the executor.
                _ => {
                    let timed_out = tokio.block_on(async {
                        tokio::time::timeout(
                            Duration::from_millis(5),
                            g.execute_async_wait(1_000 + round),
                        )
                        .await
                    });
                    assert!(timed_out.is_err(), "round {round}: the full graph took it");
                }
            }
            // Still exactly full: nothing was submitted by a cancelled wait.
            assert!(is_full(&block_on(g.execute_async(0))), "round {round}");
        }
        // Every result is the one of its own input, in order.
        block_on(async {
            while let Some(r) = refs.pop_front() {
                let exec = r.execution();
                assert_eq!(r.await.unwrap(), exec);
            }
        });
        // All the room is back.
        let again = fill_async(&g);
        assert_eq!(again.len(), full);
        assert_eq!(again[0].execution(), next);
    });
}

// -------------------------------------------------------------------------------------
// Pipelining
// -------------------------------------------------------------------------------------

const MAX_INFLIGHT: usize = 8;

#[test]
fn pipeline_yields_every_result_in_order_with_depth_in_flight() {
    each_placement(
        "pipeline_yields_every_result_in_order_with_depth_in_flight",
        |p| {
            let rt = Runtime::new().unwrap();
            let a = worker(&rt, p, 1);
            let b = worker(&rt, p, 10);
            let dag = Dag::<u64>::new();
            let x = dag.input();
            // Two outputs, one of which fails for inputs ending in 3.
            let g = dag
                .compile(
                    (a.echo(&x), b.checked(&x)),
                    CompileOptions::default().max_inflight_executions(MAX_INFLIGHT),
                )
                .unwrap();
            for depth in [1, 4, MAX_INFLIGHT] {
                let total = 40u64;
                let mut pipe = g.pipeline(0..total, depth).unwrap();
                assert_eq!(pipe.in_flight(), 0, "nothing before the first item");
                for i in 0..total {
                    let item = pipe.next().expect("an item per input");
                    // Up to `depth` were in flight while this one was claimed.
                    let left = (total - i - 1) as usize;
                    assert_eq!(pipe.in_flight(), left.min(depth - 1), "depth {depth}");
                    if i % 10 == 3 {
                        match item {
                            Err(Error::Task { method, .. }) => assert_eq!(method, "checked"),
                            other => panic!("input {i}: expected a task error, got {other:?}"),
                        }
                    } else {
                        assert_eq!(item.unwrap(), (i + 1, i + 10), "depth {depth}");
                    }
                }
                assert!(pipe.next().is_none());
                assert!(pipe.next().is_none());
            }
            for bad in [0, MAX_INFLIGHT + 1] {
                match g.pipeline(0..1, bad) {
                    Err(Error::InvalidArgument { name, message }) => {
                        assert_eq!(name, "depth");
                        assert!(message.contains("max_inflight_executions"), "{message}");
                    }
                    Err(e) => panic!("depth {bad}: {e}"),
                    Ok(_) => panic!("depth {bad} was accepted"),
                }
            }
            // The graph is free again afterwards.
            assert_eq!(g.execute(5).unwrap().0.get().unwrap(), 6);
        },
    );
}

#[test]
fn pipeline_ends_after_an_input_that_cannot_be_submitted() {
    each_placement(
        "pipeline_ends_after_an_input_that_cannot_be_submitted",
        |p| {
            let rt = Runtime::new().unwrap();
            let a = worker(&rt, p, 0);
            let dag = Dag::<Vec<u64>>::new();
            let g = dag
                .compile(
                    a.echo(dag.input().index(1)),
                    CompileOptions::default().max_inflight_executions(4),
                )
                .unwrap();
            // The third input lacks element 1: an input error, yielded after the results
            // before it, then the pipeline ends (the fourth input is never taken).
            let inputs = vec![vec![0, 1], vec![0, 2], vec![0], vec![0, 4]];
            let items: Vec<_> = g.pipeline(inputs, 4).unwrap().collect();
            assert_eq!(items.len(), 3, "{items:?}");
            assert_eq!(items[0].as_ref().unwrap(), &1);
            assert_eq!(items[1].as_ref().unwrap(), &2);
            assert!(matches!(items[2], Err(Error::Input { .. })), "{items:?}");
        },
    );
}

#[test]
fn async_pipeline_yields_every_result_in_order_with_depth_in_flight() {
    use futures_core::Stream;
    each_placement(
        "async_pipeline_yields_every_result_in_order_with_depth_in_flight",
        |p| {
            let rt = Runtime::new().unwrap();
            let a = worker(&rt, p, 1);
            let b = worker(&rt, p, 10);
            let dag = Dag::<u64>::new();
            let x = dag.input();
            let g = dag
                .compile(
                    vec![a.echo(&x), b.echo(&x)],
                    CompileOptions::default()
                        .enable_asyncio(true)
                        .max_inflight_executions(MAX_INFLIGHT),
                )
                .unwrap();
            let tokio = tokio_rt();
            for depth in [1, 4, MAX_INFLIGHT] {
                let total = 40u64;
                // Through the inherent `next`, under tokio.
                tokio.block_on(async {
                    let mut pipe = g.pipeline_async(0..total, depth).unwrap();
                    for i in 0..total {
                        let item = pipe.next().await.expect("an item per input");
                        assert!(pipe.in_flight() < depth, "depth {depth}");
                        assert_eq!(item.unwrap(), vec![i + 1, i + 10], "depth {depth}");
                    }
                    assert!(pipe.next().await.is_none());
                });
                // Through `Stream::poll_next`, on a plain executor.
                let mut pipe = g.pipeline_async(100..100 + total, depth).unwrap();
                let mut got = Vec::new();
                block_on(std::future::poll_fn(|cx| {
                    loop {
                        match Pin::new(&mut pipe).poll_next(cx) {
                            Poll::Ready(Some(item)) => got.push(item.unwrap()),
                            Poll::Ready(None) => return Poll::Ready(()),
                            Poll::Pending => return Poll::Pending,
                        }
                    }
                }));
                let want: Vec<_> = (100..100 + total).map(|i| vec![i + 1, i + 10]).collect();
                assert_eq!(got, want, "depth {depth}");
            }
            assert!(matches!(
                g.pipeline_async(0..1, MAX_INFLIGHT + 1),
                Err(Error::InvalidArgument { .. })
            ));
            assert!(matches!(g.pipeline(0..1, 1), Err(Error::WrongMode { .. })));
            // Dropping a pipeline part-way frees its executions.
            tokio.block_on(async {
                let mut pipe = g.pipeline_async(0..1_000, MAX_INFLIGHT).unwrap();
                assert_eq!(pipe.next().await.unwrap().unwrap(), vec![1, 10]);
                drop(pipe);
                let mut pipe = g
                    .pipeline_async(0..2 * MAX_INFLIGHT as u64, MAX_INFLIGHT)
                    .unwrap();
                let mut n = 0;
                while let Some(item) = pipe.next().await {
                    assert_eq!(item.unwrap(), vec![n + 1, n + 10]);
                    n += 1;
                }
                assert_eq!(n, 2 * MAX_INFLIGHT as u64);
            });
        },
    );
}

#[test]
fn waiting_variants_refuse_the_other_mode_and_are_send() {
    fn assert_send<T: Send>(_: &T) {}
    let rt = Runtime::new().unwrap();
    let a = worker(&rt, adag::Placement::Thread, 0);
    let g = async_graph(&a, 2, Duration::from_secs(5));
    assert!(matches!(g.execute_wait(1), Err(Error::WrongMode { .. })));
    let wait = g.execute_async_wait(1);
    assert_send(&wait);
    assert_eq!(block_on(async { wait.await?.await }).unwrap(), 1);
    let pipe = g.pipeline_async(0..3, 2).unwrap();
    assert_send(&pipe);
    drop(pipe);
    drop(g);

    let dag = Dag::<u64>::new();
    let g = dag
        .compile(a.echo(dag.input()), CompileOptions::default())
        .unwrap();
    assert!(matches!(
        block_on(g.execute_async_wait(1)),
        Err(Error::WrongMode { .. })
    ));
    assert!(matches!(
        g.pipeline_async(0..1, 1),
        Err(Error::WrongMode { .. })
    ));
    assert_eq!(g.execute_wait(2).unwrap().get().unwrap(), 2);
}
