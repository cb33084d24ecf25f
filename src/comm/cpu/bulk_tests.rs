//! Tests of the CPU communicator's single-copy path: point-to-point tensors of at least
//! `BULK_MIN_BYTES` written once into the sender's single-copy area and read in place by the
//! receiver. Threads of one process and real processes; every test runs under a watchdog.
//!
//! A tensor read in place lies in the sender's single-copy area as the receiver maps it, one
//! block header past a page boundary; the tests use that to tell which path a tensor took.
use super::{BLOCK_HEADER, BULK_MIN_BYTES, CpuCommunicator, CpuGroup, CpuGroupOptions, PAGE};
use crate::comm::tests::watchdog;
use crate::comm::{CommError, CommOp, Communicator};
use crate::tensor::{DType, Tensor};
use std::os::fd::AsRawFd;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::thread;
use std::time::{Duration, Instant};

/// Options whose waits go to sleep on the futex at once (no spinning, no yielding), so that
/// a lost wake-up costs a whole sleep slice (100 ms) and shows in the time a test takes.
fn sleepy(bulk_bytes: usize, timeout: Duration) -> CpuGroupOptions {
    CpuGroupOptions {
        chunk_bytes: 64 << 10,
        timeout,
        spin: Duration::ZERO,
        yield_for: Duration::ZERO,
        bulk_bytes,
    }
}

/// Message `i` from rank `from`: `n` u32 whose every element says who, which and where, so a
/// torn or stale read shows in any element.
fn pattern(from: usize, i: usize, n: usize) -> Tensor {
    let base = (from as u32) << 28 | (i as u32) << 16;
    Tensor::from(
        (0..n as u32)
            .map(|k| base ^ k.wrapping_mul(2_654_435_761))
            .map(|v: u32| v as i32)
            .collect::<Vec<i32>>(),
    )
}

/// The size of message `i`: 64 KiB to about 1.6 MiB, so blocks of several sizes are carved,
/// reused and given back.
fn elems(i: usize) -> usize {
    BULK_MIN_BYTES / 4 + (i * 7919) % (400 << 10)
}

fn check(t: &Tensor, from: usize, i: usize) {
    let want = pattern(from, i, t.numel());
    assert!(
        t.as_slice::<i32>().unwrap() == want.as_slice::<i32>().unwrap(),
        "message {i} from rank {from} was torn or overwritten"
    );
}

/// Whether `t`, received by `c` from `peer`, was read in place from `peer`'s single-copy area.
fn in_place(c: &CpuCommunicator, peer: usize, t: &Tensor) -> bool {
    let Some(map) = c.region.arena_maps[peer].get() else {
        return false;
    };
    let (at, start) = (
        t.as_bytes().unwrap().as_ptr() as usize,
        map.as_ptr() as usize,
    );
    (start..start + map.len()).contains(&at) && (at - start) % PAGE == BLOCK_HEADER
}

/// One receiver, its messages checked as they come and again while it keeps a few of them
/// (the sender must never write a block that a kept tensor reads).
fn receive_and_keep(c: &CpuCommunicator, peer: usize, n: usize, keep: usize) {
    let mut kept: Vec<(usize, Tensor)> = Vec::new();
    for i in 0..n {
        let t = c.recv(&[elems(i)], DType::I32, peer).unwrap();
        check(&t, peer, i);
        assert!(
            in_place(c, peer, &t),
            "message {i} from rank {peer} was copied"
        );
        if i % 3 == 0 {
            kept.push((i, t));
        }
        if kept.len() > keep {
            let (j, old) = kept.remove((i * 31) % kept.len());
            check(&old, peer, j);
        }
    }
    for (j, t) in kept {
        check(&t, peer, j);
    }
}

#[test]
fn bulk_tensors_are_read_in_place_and_never_torn_between_threads() {
    watchdog(120, || {
        const N: usize = 300;
        let g =
            CpuGroup::with_options(3, "bulk", &sleepy(256 << 20, Duration::from_secs(30))).unwrap();
        let c: Vec<CpuCommunicator> = (0..3).map(|r| g.communicator(r).unwrap()).collect();
        let t0 = Instant::now();
        thread::scope(|s| {
            // 1 -> 0 and 2 -> 0 (two areas read by one rank), 0 -> 1 (both directions of a
            // pair at once), each sender on its own thread.
            s.spawn(|| receive_and_keep(&c[0], 1, N, 5));
            s.spawn(|| receive_and_keep(&c[0], 2, N, 5));
            s.spawn(|| receive_and_keep(&c[1], 0, N, 2));
            for (from, to) in [(1, 0), (2, 0), (0, 1)] {
                let me = &c[from];
                s.spawn(move || {
                    for i in 0..N {
                        me.send(&pattern(from, i, elems(i)), to).unwrap();
                    }
                });
            }
        });
        // 900 messages whose every wait sleeps on the futex: a lost wake-up costs 100 ms.
        let took = t0.elapsed();
        assert!(
            took < Duration::from_secs(30),
            "took {took:?}: lost wake-ups?"
        );
        // A tensor of a receiver outlives its communicator and the group.
        let t = pattern(0, 7, BULK_MIN_BYTES);
        c[0].send(&t, 2).unwrap();
        let got = c[2].recv(&[BULK_MIN_BYTES], DType::I32, 0).unwrap();
        g.destroy();
        drop(c);
        drop(g);
        check(&got, 0, 7);
    });
}

#[test]
fn a_full_single_copy_area_falls_back_to_the_mailboxes() {
    watchdog(60, || {
        // Room for three blocks of 256 KiB (and their headers).
        let g = CpuGroup::with_options(2, "bulk-full", &sleepy(1 << 20, Duration::from_secs(30)))
            .unwrap();
        let (a, b) = (g.communicator(0).unwrap(), g.communicator(1).unwrap());
        let n = (256 << 10) / 4;
        let mut kept = Vec::new();
        for i in 0..8 {
            a.send(&pattern(0, i, n), 1).unwrap();
            let t = b.recv(&[n], DType::I32, 0).unwrap();
            check(&t, 0, i);
            assert_eq!(in_place(&b, 0, &t), i < 3, "message {i}");
            kept.push(t);
        }
        for (i, t) in kept.iter().enumerate() {
            check(t, 0, i);
        }
        drop(kept);
        // Freed: in place again, in blocks reused or carved anew, of other sizes too.
        for i in 8..40 {
            let n = elems(i).min(200 << 10);
            a.send(&pattern(0, i, n), 1).unwrap();
            let t = b.recv(&[n], DType::I32, 0).unwrap();
            check(&t, 0, i);
            assert!(in_place(&b, 0, &t), "message {i}");
        }
    });
}

#[test]
fn a_mismatched_bulk_recv_frees_the_block_and_keeps_order() {
    watchdog(60, || {
        // Room for one block: a block not freed by the mismatch would send the rest through
        // the mailboxes.
        let g = CpuGroup::with_options(2, "bulk-mm", &sleepy(512 << 10, Duration::from_secs(30)))
            .unwrap();
        let (a, b) = (g.communicator(0).unwrap(), g.communicator(1).unwrap());
        let n = BULK_MIN_BYTES;
        a.send(&pattern(0, 0, n), 1).unwrap();
        let e = b.recv(&[n + 1], DType::I32, 0).unwrap_err();
        match &e {
            CommError::Mismatch {
                peer: 0,
                op: CommOp::Recv,
                ..
            } => {}
            e => panic!("{e}"),
        }
        a.send(&pattern(0, 1, n), 1).unwrap();
        let t = b.recv(&[n], DType::I32, 0).unwrap();
        check(&t, 0, 1);
        assert!(in_place(&b, 0, &t));
        drop(t);
        for i in 2..10 {
            a.send(&pattern(0, i, n), 1).unwrap();
            let t = b.recv(&[n], DType::I32, 0).unwrap();
            check(&t, 0, i);
            assert!(in_place(&b, 0, &t), "message {i}: the block was not freed");
        }
    });
}

#[test]
fn a_rank_opened_again_never_writes_a_block_still_held() {
    watchdog(60, || {
        let g = CpuGroup::create(2, "bulk-reopen").unwrap();
        let b = g.communicator(1).unwrap();
        let n = BULK_MIN_BYTES;
        let a = g.communicator(0).unwrap();
        a.send(&pattern(0, 0, n), 1).unwrap();
        a.send(&pattern(0, 1, n), 1).unwrap();
        let held = b.recv(&[n], DType::I32, 0).unwrap();
        drop(b.recv(&[n], DType::I32, 0).unwrap());
        drop(a);
        // A new holder of rank 0 reads the blocks back from the area: the held one is busy,
        // the other free.
        let a = g.communicator(0).unwrap();
        for i in 2..12 {
            a.send(&pattern(0, i, n), 1).unwrap();
            let t = b.recv(&[n], DType::I32, 0).unwrap();
            check(&t, 0, i);
            assert!(in_place(&b, 0, &t));
            assert_ne!(
                t.as_bytes().unwrap().as_ptr(),
                held.as_bytes().unwrap().as_ptr()
            );
        }
        check(&held, 0, 0);
    });
}

#[test]
fn a_bulk_send_to_a_full_mailbox_times_out_and_the_group_stays_usable() {
    watchdog(60, || {
        let g =
            CpuGroup::with_options(2, "bulk-sto", &sleepy(64 << 20, Duration::from_millis(200)))
                .unwrap();
        let (a, b) = (g.communicator(0).unwrap(), g.communicator(1).unwrap());
        let n = BULK_MIN_BYTES;
        for i in 0..super::DEPTH as usize {
            a.send(&pattern(0, i, n), 1).unwrap();
        }
        let e = a.send(&pattern(0, 99, n), 1).unwrap_err();
        assert!(
            matches!(
                e,
                CommError::Timeout {
                    op: CommOp::Send,
                    ..
                }
            ),
            "{e}"
        );
        assert!(!g.is_destroyed());
        for i in 0..super::DEPTH as usize {
            check(&b.recv(&[n], DType::I32, 0).unwrap(), 0, i);
        }
        a.send(&pattern(0, 100, n), 1).unwrap();
        check(&b.recv(&[n], DType::I32, 0).unwrap(), 0, 100);
        // A receiver waiting for a large tensor is woken by destroy.
        let t0 = Instant::now();
        b.set_timeout(Duration::from_secs(30));
        thread::scope(|s| {
            let waiter = s.spawn(|| b.recv(&[n], DType::I32, 0));
            thread::sleep(Duration::from_millis(50));
            g.destroy();
            let e = waiter.join().unwrap().unwrap_err();
            assert!(matches!(e, CommError::Destroyed { .. }), "{e}");
        });
        assert!(t0.elapsed() < Duration::from_secs(10));
    });
}

#[test]
fn without_a_single_copy_area_large_tensors_go_through_the_mailboxes() {
    watchdog(60, || {
        let g = CpuGroup::with_options(2, "no-bulk", &sleepy(0, Duration::from_secs(30))).unwrap();
        assert_eq!(g.region.layout.arena, 0);
        let (a, b) = (g.communicator(0).unwrap(), g.communicator(1).unwrap());
        for i in 0..4 {
            let n = elems(i);
            a.send(&pattern(0, i, n), 1).unwrap();
            let t = b.recv(&[n], DType::I32, 0).unwrap();
            check(&t, 0, i);
            assert!(!in_place(&b, 0, &t));
        }
    });
}

const CHILD_ENV: &str = "ADAG_BULK_TEST_CHILD";
const XN: usize = 120;

/// The child side of `bulk_tensors_between_processes`: a no-op unless started by it. Rank 1
/// sends `XN` tensors to rank 0 while it receives `XN` from rank 0, keeping a few.
#[test]
fn bulk_child() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let fd: i32 = spec.parse().unwrap();
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(format!("/proc/self/fd/{fd}"))
        .unwrap();
    let c = CpuCommunicator::open(&file, 1).unwrap();
    thread::scope(|s| {
        s.spawn(|| {
            for i in 0..XN {
                c.send(&pattern(1, i, elems(i)), 0).unwrap();
            }
        });
        receive_and_keep(&c, 0, XN, 4);
    });
    println!("bulk child: done");
}

#[test]
fn bulk_tensors_between_processes() {
    if std::env::var(CHILD_ENV).is_ok() {
        return;
    }
    watchdog(120, || {
        let g =
            CpuGroup::with_options(2, "bulk-xproc", &sleepy(256 << 20, Duration::from_secs(30)))
                .unwrap();
        // dup() gives a descriptor without close-on-exec, which the child inherits.
        let inherit = rustix::io::dup(g.fd()).unwrap();
        let name = module_path!();
        let name = name.split_once("::").map_or(name, |(_, rest)| rest);
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                &format!("{name}::bulk_child"),
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, inherit.as_raw_fd().to_string())
            .spawn()
            .unwrap();
        drop(inherit);
        let c = g.communicator(0).unwrap();
        let result = catch_unwind(AssertUnwindSafe(|| {
            thread::scope(|s| {
                s.spawn(|| {
                    for i in 0..XN {
                        c.send(&pattern(0, i, elems(i)), 1).unwrap();
                    }
                });
                receive_and_keep(&c, 1, XN, 4);
            })
        }));
        if result.is_err() {
            g.destroy();
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("the child rank did not exit in time");
            }
            thread::sleep(Duration::from_millis(10));
        };
        if let Err(p) = result {
            resume_unwind(p);
        }
        assert!(status.success(), "the child rank failed: {status}");
    });
}
