//! Async execution (`enable_asyncio`): futures, many tasks, capacity, cancellation,
//! teardown and actor death, for thread and process actors.
mod common;
use adag::{Capacity, CompileOptions, Dag, Error, Placement, Runtime};
use common::{
    done, each_placement, go, named_worker, process_actors_available, scratch_dir, worker,
};
use std::time::{Duration, Instant};

fn tokio_rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

fn async_opts() -> CompileOptions {
    CompileOptions::default().enable_asyncio(true)
}

#[test]
fn compiled_outside_the_runtime_then_awaited() {
    each_placement("compiled_outside_the_runtime_then_awaited", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 1);
        let dag = Dag::<u64>::new();
        let g = dag.compile(a.echo(dag.input()), async_opts()).unwrap();
        // The runtime is created only now, after compile.
        let value = tokio_rt()
            .block_on(async { g.execute_async(41).await?.await })
            .unwrap();
        assert_eq!(value, 42);
    });
}

#[test]
fn sync_and_async_apis_refuse_the_other_mode() {
    each_placement("sync_and_async_apis_refuse_the_other_mode", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 1);
        let dag = Dag::<u64>::new();
        let g = dag.compile(a.echo(dag.input()), async_opts()).unwrap();
        assert!(matches!(g.execute(1), Err(Error::WrongMode { .. })));
        let r = tokio_rt().block_on(g.execute_async(1)).unwrap();
        assert!(matches!(r.clone().get(), Err(Error::WrongMode { .. })));
        assert_eq!(tokio_rt().block_on(r.into_future_value()).unwrap(), 2);
        g.teardown().unwrap();

        let dag = Dag::<u64>::new();
        let g = dag
            .compile(a.echo(dag.input()), CompileOptions::default())
            .unwrap();
        assert!(matches!(
            tokio_rt().block_on(g.execute_async(1)),
            Err(Error::WrongMode { .. })
        ));
        let r = g.execute(1).unwrap();
        assert!(matches!(
            tokio_rt().block_on(async { r.clone().await }),
            Err(Error::WrongMode { .. })
        ));
        assert_eq!(r.get().unwrap(), 2);
    });
}

trait IntoFutureValue<T> {
    fn into_future_value(self) -> adag::exec::RefFuture<T>;
}
impl<T: adag::Value> IntoFutureValue<T> for adag::CompiledRef<T> {
    fn into_future_value(self) -> adag::exec::RefFuture<T> {
        std::future::IntoFuture::into_future(self)
    }
}

#[test]
fn many_tasks_many_executions_in_order_per_ref() {
    each_placement("many_tasks_many_executions_in_order_per_ref", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 1);
        let b = worker(&rt, p, 10);
        let dag = Dag::<u64>::new();
        let g = std::sync::Arc::new(
            dag.compile(
                b.echo(a.echo(dag.input())),
                async_opts()
                    .max_inflight_executions(64)
                    .max_buffered_results(64),
            )
            .unwrap(),
        );
        tokio_rt().block_on(async {
            let mut tasks = Vec::new();
            for t in 0..16u64 {
                let g = g.clone();
                tasks.push(tokio::spawn(async move {
                    for i in 0..50u64 {
                        let x = t * 1000 + i;
                        // Other tasks may fill the graph for a moment: retry on capacity.
                        let r = loop {
                            match g.execute_async(x).await {
                                Ok(r) => break r,
                                Err(Error::CapacityExceeded { .. }) => {
                                    tokio::task::yield_now().await
                                }
                                Err(e) => panic!("{e}"),
                            }
                        };
                        assert_eq!(r.await.unwrap(), x + 11);
                    }
                }));
            }
            for t in tasks {
                t.await.unwrap();
            }
        });
    });
}

#[test]
fn inflight_and_buffered_limits_hold() {
    each_placement("inflight_and_buffered_limits_hold", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 0);
        let dag = Dag::<u64>::new();
        let g = dag
            .compile(
                a.echo(dag.input()),
                async_opts()
                    .max_inflight_executions(3)
                    .max_buffered_results(2),
            )
            .unwrap();
        tokio_rt().block_on(async {
            let mut refs = Vec::new();
            let mut refused = false;
            for i in 0..20 {
                match g.execute_async(i).await {
                    Ok(r) => refs.push(r),
                    Err(Error::CapacityExceeded { capacity, .. }) => {
                        assert_eq!(capacity, Capacity::InflightExecutions);
                        refused = true;
                        break;
                    }
                    Err(e) => panic!("{e}"),
                }
                // Let the pump buffer what it can.
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            assert!(refused, "20 unclaimed executions never hit the limits");
            // 2 buffered + 3 in flight at most.
            assert!(refs.len() <= 5, "{} executions accepted", refs.len());
            for (i, r) in refs.into_iter().enumerate() {
                assert_eq!(r.await.unwrap(), i as u64);
            }
            assert_eq!(g.execute_async(7).await.unwrap().await.unwrap(), 7);
        });
    });
}

#[test]
fn dropped_future_loses_nothing_for_the_others() {
    each_placement("dropped_future_loses_nothing_for_the_others", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 0);
        let dag = Dag::<u64>::new();
        let g = dag
            .compile(
                a.slow(dag.input(), 30u64),
                async_opts().max_inflight_executions(2),
            )
            .unwrap();
        tokio_rt().block_on(async {
            let first = g.execute_async(1).await.unwrap();
            let second = g.execute_async(2).await.unwrap();
            // Cancel the first while it is pending.
            let timed_out =
                tokio::time::timeout(Duration::from_millis(1), first.into_future_value()).await;
            assert!(
                timed_out.is_err(),
                "the first result came too fast to test cancellation"
            );
            assert_eq!(second.await.unwrap(), 2);
            // Its slot is free again: two more fit.
            let c = g.execute_async(3).await.unwrap();
            let d = g.execute_async(4).await.unwrap();
            assert_eq!((c.await.unwrap(), d.await.unwrap()), (3, 4));
        });
    });
}

#[test]
fn teardown_wakes_every_pending_future() {
    each_placement("teardown_wakes_every_pending_future", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 0);
        let dag = Dag::<u64>::new();
        let g = std::sync::Arc::new(
            dag.compile(
                a.slow(dag.input(), 2_000u64),
                async_opts().teardown_timeout(Duration::from_secs(5)),
            )
            .unwrap(),
        );
        tokio_rt().block_on(async {
            let mut waiting = Vec::new();
            for i in 0..3 {
                let r = g.execute_async(i).await.unwrap();
                waiting.push(tokio::spawn(async move { r.await }));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            let g2 = g.clone();
            std::thread::spawn(move || g2.teardown())
                .join()
                .unwrap()
                .ok();
            for w in waiting {
                let r = tokio::time::timeout(Duration::from_secs(10), w)
                    .await
                    .expect("future never woke")
                    .unwrap();
                assert!(
                    r.is_err(),
                    "a pending future resolved with a value after teardown"
                );
            }
        });
    });
}

#[test]
fn worker_death_resolves_pending_futures_with_actor_died() {
    let rt = Runtime::new().unwrap();
    let a = worker(&rt, Placement::Process, 0);
    let dag = Dag::<u64>::new();
    let g = dag
        .compile(a.slow(dag.input(), 5_000u64), async_opts())
        .unwrap();
    tokio_rt().block_on(async {
        let r = g.execute_async(1).await.unwrap();
        let pending = tokio::spawn(async move { r.await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        a.kill().unwrap();
        let got = tokio::time::timeout(Duration::from_secs(5), pending)
            .await
            .expect("future never woke")
            .unwrap();
        match got {
            Err(Error::ActorDied { actor, .. }) => assert_eq!(actor, a.name()),
            other => panic!("expected ActorDied, got {other:?}"),
        }
        assert!(matches!(
            g.execute_async(2).await,
            Err(Error::ActorDied { .. })
        ));
    });
}

/// The task error of `checked` for input `x`, or a failure.
#[track_caller]
fn assert_checked_failed(r: adag::Result<u64>, x: u64, what: &str, p: Placement) {
    match r {
        Err(Error::Task {
            method, message, ..
        }) => {
            assert_eq!(method, "checked", "[{p:?}] {what}");
            assert!(
                message.contains(&format!("bad input {x}")),
                "[{p:?}] {what}: {message}"
            );
        }
        other => panic!("[{p:?}] {what}: expected the task error of checked({x}), got {other:?}"),
    }
}

/// Fast fail, async: with outputs `[a method that waits, a method that fails at once]`, every
/// future of the execution resolves to the error while the slow method still runs (it ends
/// only when the test says so, after the errors arrived); later executions get their own
/// values. `wait_first_async` sees the failed execution at once too.
#[test]
fn fast_fail_resolves_every_future_before_the_slow_output_finishes() {
    each_placement(
        "fast_fail_resolves_every_future_before_the_slow_output_finishes",
        |p| {
            let rt = Runtime::new().unwrap();
            let a = worker(&rt, p, 100);
            let b = worker(&rt, p, 0);
            let dir = scratch_dir("fastfail-async");
            let dag = Dag::<u64>::new();
            let x = dag.input();
            let g = dag
                .compile(
                    (
                        a.wait_file(&x, dir.to_string_lossy().into_owned()),
                        b.checked(&x),
                    ),
                    async_opts(),
                )
                .unwrap();
            let long = Duration::from_secs(20);
            tokio_rt().block_on(async {
                let (slow, fail) = g.execute_async(3).await.unwrap();
                // The slow output first: it fails with its sibling's error, at once.
                let r = tokio::time::timeout(long, slow)
                    .await
                    .expect("slow future hangs");
                assert_checked_failed(r, 3, "slow output", p);
                assert!(
                    !done(&dir, 3),
                    "[{p:?}] the error waited for the slow method"
                );
                assert_checked_failed(fail.await, 3, "failing output", p);
                // wait_first_async over the refs of another failing execution.
                let (slow13, fail13) = g.execute_async(13).await.unwrap();
                let first =
                    tokio::time::timeout(long, adag::wait_first_async(vec![slow13, fail13]))
                        .await
                        .expect("wait_first_async hangs")
                        .unwrap();
                assert_checked_failed(first.result, 13, "wait_first_async", p);
                assert!(!done(&dir, 13), "[{p:?}] wait_first_async waited");
                go(&dir, 3);
                go(&dir, 13);
                for i in [4u64, 5] {
                    go(&dir, i);
                    let (ra, rb) = g.execute_async(i).await.unwrap();
                    assert_eq!(
                        (ra.await.unwrap(), rb.await.unwrap()),
                        (i + 100, i),
                        "[{p:?}]"
                    );
                }
            });
            g.teardown().unwrap();
            let _ = std::fs::remove_dir_all(&dir);
        },
    );
}

/// Dropping unawaited futures frees their places as deterministically as in sync mode: round
/// after round, `max_inflight_executions` refs are dropped (some never polled, some polled
/// once) and as many executions are submitted at once; none is refused.
#[test]
fn dropped_unawaited_futures_free_their_places_every_round() {
    each_placement(
        "dropped_unawaited_futures_free_their_places_every_round",
        |p| {
            let rt = Runtime::new().unwrap();
            let a = worker(&rt, p, 0);
            let dag = Dag::<u64>::new();
            let g = dag
                .compile(
                    a.slow(dag.input(), 1u64),
                    async_opts().max_inflight_executions(4),
                )
                .unwrap();
            tokio_rt().block_on(async {
                for round in 0..30u64 {
                    for i in 0..4u64 {
                        let r = g
                            .execute_async(round * 10 + i)
                            .await
                            .unwrap_or_else(|e| panic!("[{p:?}] round {round}, dropped {i}: {e}"));
                        if i % 2 == 0 {
                            drop(r);
                        } else {
                            // Polled once (pending), then dropped.
                            let _ =
                                tokio::time::timeout(Duration::ZERO, r.into_future_value()).await;
                        }
                    }
                    let mut kept = Vec::new();
                    for i in 4..8u64 {
                        let x = round * 10 + i;
                        let r = g
                            .execute_async(x)
                            .await
                            .unwrap_or_else(|e| panic!("[{p:?}] round {round}, kept {i}: {e}"));
                        kept.push((x, r));
                    }
                    for (x, r) in kept {
                        assert_eq!(r.await.unwrap(), x, "[{p:?}] round {round}");
                    }
                }
            });
        },
    );
}

/// A wait for the place that dropped futures free ends, after `submit_timeout`, in a timeout
/// that names that option (not in `CapacityExceeded`, which means "nothing will free a place
/// without a claim"); the graph goes on once the slow results arrived.
#[test]
fn a_wait_for_room_past_the_submit_timeout_names_it() {
    each_placement("a_wait_for_room_past_the_submit_timeout_names_it", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 0);
        let dag = Dag::<u64>::new();
        let g = dag
            .compile(
                a.slow(dag.input(), 300u64),
                async_opts()
                    .max_inflight_executions(2)
                    .submit_timeout(Duration::from_millis(100)),
            )
            .unwrap();
        tokio_rt().block_on(async {
            for i in 0..2u64 {
                drop(g.execute_async(i).await.unwrap());
            }
            let t = Instant::now();
            let e = g.execute_async(2).await.map(|_| ()).unwrap_err();
            let waited = t.elapsed();
            match &e {
                Error::Timeout { hint, what, .. } => {
                    assert!(hint.contains("submit_timeout"), "[{p:?}] {e}");
                    assert!(what.contains("max_inflight_executions = 2"), "[{p:?}] {e}");
                }
                other => panic!("[{p:?}] expected a timeout, got {other:?}"),
            }
            assert!(
                waited >= Duration::from_millis(100),
                "[{p:?}] gave up after {waited:?}, before the submit timeout"
            );
            // The dropped executions finish (≤ 600 ms of work); then there is room again.
            let deadline = Instant::now() + Duration::from_secs(30);
            let r = loop {
                match g.execute_async(3).await {
                    Ok(r) => break r,
                    Err(Error::Timeout { .. }) if Instant::now() < deadline => {}
                    Err(e) => panic!("[{p:?}] after the slow results: {e}"),
                }
            };
            assert_eq!(r.await.unwrap(), 3, "[{p:?}]");
        });
    });
}

/// Recovery after a death, async: once an awaited ref resolved to `ActorDied`, the survivors
/// answer one-off calls and compile into a new graph at once, and the dead actor answers
/// `ActorDied`.
#[test]
fn recovery_after_a_death_async() {
    each_placement("recovery_after_a_death_async", |p| {
        if !process_actors_available() {
            return;
        }
        let rt = Runtime::new().unwrap();
        let s = worker(&rt, p, 10);
        for round in 0..3 {
            let victim = named_worker(&rt, Placement::Process, &format!("avictim{round}"), 1);
            let dag = Dag::<u64>::new();
            let g = dag
                .compile(s.echo(victim.slow(dag.input(), 3000u64)), async_opts())
                .unwrap();
            tokio_rt().block_on(async {
                let r = g.execute_async(1).await.unwrap();
                victim.kill().unwrap();
                let e = tokio::time::timeout(Duration::from_secs(20), r)
                    .await
                    .expect("future hangs")
                    .expect_err("ActorDied");
                assert!(matches!(e, Error::ActorDied { .. }), "[{p:?}] {e:?}");
            });
            assert_eq!(s.call().echo(1).unwrap(), 11, "[{p:?}] round {round}");
            let e = victim.call().echo(1).expect_err("dead actor");
            assert!(matches!(e, Error::ActorDied { .. }), "[{p:?}] {e:?}");
            let dag = Dag::<u64>::new();
            let g2 = dag.compile(s.echo(dag.input()), async_opts()).unwrap();
            let v = tokio_rt().block_on(async { g2.execute_async(1).await?.await });
            assert_eq!(v.unwrap(), 11, "[{p:?}]");
        }
    });
}

/// Polls `fut` with `poll_reading` (the result read on this thread, spinning up to 50 µs a
/// poll) until it resolves; a hang becomes a failure after 20 s.
fn read_here<T: adag::Value>(fut: &mut adag::RefFuture<T>, what: &str) -> adag::Result<T> {
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    let end = Instant::now() + Duration::from_secs(20);
    loop {
        if let std::task::Poll::Ready(v) =
            std::pin::Pin::new(&mut *fut).poll_reading(&mut cx, Duration::from_micros(50))
        {
            return v;
        }
        assert!(Instant::now() < end, "{what}: no result after 20 s");
    }
}

/// Futures read on the awaiting thread (`poll_reading`) and futures woken by the result pump
/// mix: a direct read of a later execution buffers the earlier ones for their own awaits;
/// an execution nobody read directly still reaches its plain `.await` (the pump, standing
/// aside for the direct readers, reads for a registered waker); concurrent direct readers and
/// pump-woken tasks each get their own value, in order, none lost or duplicated.
#[test]
fn direct_reads_and_the_pump_deliver_every_result_once() {
    each_placement("direct_reads_and_the_pump_deliver_every_result_once", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 1);
        let dag = Dag::<u64>::new();
        let g = std::sync::Arc::new(
            dag.compile(a.echo(dag.input()), async_opts().max_inflight_executions(8))
                .unwrap(),
        );
        let tokio = tokio_rt();
        for round in 0..100u64 {
            let x = |i: u64| round * 10 + i;
            let refs: Vec<_> = (0..4)
                .map(|i| tokio.block_on(g.execute_async(x(i))).unwrap())
                .collect();
            let mut futs: Vec<_> = refs.into_iter().map(|r| r.into_future_value()).collect();
            // The third, read here: the first two are read on the way and kept.
            assert_eq!(
                read_here(&mut futs[2], "third").unwrap(),
                x(2) + 1,
                "[{p:?}]"
            );
            let last = futs.pop().unwrap();
            let third = futs.pop().unwrap();
            drop(third);
            // The fourth through the pump, right after a direct read (the pump stands aside).
            assert_eq!(
                tokio.block_on(last).unwrap(),
                x(3) + 1,
                "[{p:?}] round {round}"
            );
            for (i, f) in futs.into_iter().enumerate() {
                assert_eq!(tokio.block_on(f).unwrap(), x(i as u64) + 1, "[{p:?}]");
            }
        }
        // Two threads: one reads directly, the other awaits through the pump, interleaved.
        let g2 = g.clone();
        let pumped = std::thread::spawn(move || {
            let tokio = tokio_rt();
            for i in 0..300u64 {
                let r = tokio.block_on(g2.execute_async(1_000_000 + i)).unwrap();
                assert_eq!(
                    tokio.block_on(r.into_future_value()).unwrap(),
                    1_000_001 + i
                );
            }
        });
        for i in 0..300u64 {
            let r = loop {
                match tokio.block_on(g.execute_async(2_000_000 + i)) {
                    Ok(r) => break r,
                    Err(Error::CapacityExceeded { .. }) => std::thread::yield_now(),
                    Err(e) => panic!("[{p:?}] {e}"),
                }
            };
            let mut f = r.into_future_value();
            assert_eq!(
                read_here(&mut f, "direct").unwrap(),
                2_000_001 + i,
                "[{p:?}]"
            );
        }
        pumped.join().unwrap();
        // Read directly, then fill the graph with futures dropped unawaited: the places they
        // hold come free for the next submissions (the pump, standing aside, is called back).
        let mut f = tokio
            .block_on(g.execute_async(7))
            .unwrap()
            .into_future_value();
        assert_eq!(read_here(&mut f, "before the drops").unwrap(), 8);
        for round in 0..20u64 {
            for i in 0..8u64 {
                drop(tokio.block_on(g.execute_async(round * 8 + i)).unwrap());
            }
            let mut f = tokio
                .block_on(g.execute_async(99))
                .unwrap()
                .into_future_value();
            assert_eq!(
                read_here(&mut f, "after the drops").unwrap(),
                100,
                "[{p:?}]"
            );
        }
        // Teardown ends a direct read with the graph's error, not a hang.
        let r = tokio.block_on(g.execute_async(5)).unwrap();
        g.teardown().unwrap();
        let mut f = r.into_future_value();
        assert!(read_here(&mut f, "after teardown").is_err(), "[{p:?}]");
    });
}
