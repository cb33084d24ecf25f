//! Tests of the communicator trait, the reduction kernels and the CPU communicator: threads of
//! one process, and real processes sharing a group by descriptor. Every test that waits on
//! other ranks runs under a watchdog.
use super::cpu::{CpuCommunicator, CpuFactory, CpuGroup, CpuGroupOptions, MAX_DIMS, TRANSPORT};
use super::*;
use crate::tensor::{DeviceBuffer, Element};
use std::any::Any;
use std::os::fd::AsRawFd;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::mpsc;
use std::thread;
use std::time::Instant;

/// Runs `f` on its own thread and fails the test if it takes longer than `secs`.
pub(super) fn watchdog<R: Send + 'static>(secs: u64, f: impl FnOnce() -> R + Send + 'static) -> R {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let _ = tx.send(catch_unwind(AssertUnwindSafe(f)));
    });
    match rx.recv_timeout(Duration::from_secs(secs)) {
        Ok(Ok(r)) => r,
        Ok(Err(panic)) => resume_unwind(panic),
        Err(_) => panic!("watchdog: the test did not finish within {secs} s (a hang)"),
    }
}

fn options(chunk_bytes: usize, timeout: Duration) -> CpuGroupOptions {
    CpuGroupOptions {
        chunk_bytes,
        timeout,
        ..CpuGroupOptions::default()
    }
}

/// Runs `f` for every rank of `group` on its own thread; the results in rank order.
fn on_ranks<R: Send>(group: &CpuGroup, f: impl Fn(&CpuCommunicator) -> R + Sync) -> Vec<R> {
    let comms: Vec<CpuCommunicator> = (0..group.world_size())
        .map(|r| group.communicator(r).unwrap())
        .collect();
    thread::scope(|s| {
        let handles: Vec<_> = comms.iter().map(|c| s.spawn(|| f(c))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[derive(Debug)]
pub(crate) struct FakeCuda(pub(crate) usize);
impl DeviceBuffer for FakeCuda {
    fn device(&self) -> Device {
        Device::Cuda(0)
    }
    fn nbytes(&self) -> usize {
        self.0
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Element types that the generic allreduce test runs over.
trait TestElem: Element {
    const INT: bool;
    fn from_f64(v: f64) -> Self;
}
impl TestElem for f32 {
    const INT: bool = false;
    fn from_f64(v: f64) -> Self {
        v as f32
    }
}
impl TestElem for f64 {
    const INT: bool = false;
    fn from_f64(v: f64) -> Self {
        v
    }
}
impl TestElem for f16 {
    const INT: bool = false;
    fn from_f64(v: f64) -> Self {
        f16::from_f64(v)
    }
}
impl TestElem for bf16 {
    const INT: bool = false;
    fn from_f64(v: f64) -> Self {
        bf16::from_f64(v)
    }
}
impl TestElem for i32 {
    const INT: bool = true;
    fn from_f64(v: f64) -> Self {
        // Wrapping, as the kernels do.
        v as i64 as i32
    }
}
impl TestElem for i8 {
    const INT: bool = true;
    fn from_f64(v: f64) -> Self {
        // Wrapping, as the kernels do.
        v as i64 as i8
    }
}
impl TestElem for i64 {
    const INT: bool = true;
    fn from_f64(v: f64) -> Self {
        // Wrapping, as the kernels do.
        v as i64
    }
}

/// Small integers (exact in every dtype, products included), signs mixed.
fn value(rank: usize, i: usize) -> f64 {
    let v = (rank as f64 + 1.0) * ((i % 3) as f64 + 1.0);
    if i.is_multiple_of(2) { v } else { -v }
}

fn expected(op: ReduceOp, world: usize, i: usize, int: bool) -> f64 {
    let vals: Vec<f64> = (0..world).map(|r| value(r, i)).collect();
    match op {
        ReduceOp::Sum => vals.iter().sum(),
        ReduceOp::Product => vals.iter().product(),
        ReduceOp::Min => vals.iter().copied().fold(f64::INFINITY, f64::min),
        ReduceOp::Max => vals.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        ReduceOp::Average if int => (vals.iter().sum::<f64>() / world as f64).trunc(),
        ReduceOp::Average => vals.iter().sum::<f64>() / world as f64,
    }
}

/// Every op on `T`, on every rank of the group, in the same order.
fn allreduce_all_ops<T: TestElem>(c: &CpuCommunicator, n: usize) {
    let world = c.world_size();
    for op in ReduceOp::ALL {
        let data: Vec<T> = (0..n).map(|i| T::from_f64(value(c.rank(), i))).collect();
        let t = Tensor::from_vec(data, [n]).unwrap();
        let out = c.allreduce(&t, op).unwrap();
        assert_eq!(out.shape(), &[n]);
        let want: Vec<T> = (0..n)
            .map(|i| T::from_f64(expected(op, world, i, T::INT)))
            .collect();
        assert_eq!(
            out.as_slice::<T>().unwrap(),
            &want[..],
            "{op} of {} on rank {} of {world}",
            T::DTYPE,
            c.rank()
        );
    }
}

#[test]
fn allreduce_every_op_and_dtype_on_2_3_4_threads() {
    watchdog(120, || {
        for world in [2, 3, 4] {
            // 37 elements over 128-byte chunks: one to two chunks per call.
            let g = CpuGroup::with_options(world, "ops", &options(128, Duration::from_secs(30)))
                .unwrap();
            on_ranks(&g, |c| {
                allreduce_all_ops::<f32>(c, 37);
                allreduce_all_ops::<i32>(c, 37);
                allreduce_all_ops::<f16>(c, 37);
                allreduce_all_ops::<bf16>(c, 37);
                allreduce_all_ops::<f64>(c, 5);
                allreduce_all_ops::<i8>(c, 5);
                allreduce_all_ops::<i64>(c, 5);
            });
        }
    });
}

#[test]
fn allreduce_results_are_identical_on_every_rank_and_large_tensors_chunk() {
    watchdog(120, || {
        let g =
            CpuGroup::with_options(3, "big", &options(64 << 10, Duration::from_secs(30))).unwrap();
        let n = 300_000; // 1.2 MB of f32 over 64 KiB chunks
        let outs = on_ranks(&g, |c| {
            let data: Vec<f32> = (0..n)
                .map(|i| (i as f32).sin() * (c.rank() as f32 + 0.1))
                .collect();
            let t = Tensor::from_vec(data, [n / 100, 100]).unwrap();
            c.allreduce(&t, ReduceOp::Average).unwrap()
        });
        assert_eq!(outs[0].shape(), &[n / 100, 100]);
        assert_eq!(outs[0], outs[1]);
        assert_eq!(outs[1], outs[2]);
        let got = outs[0].as_slice::<f32>().unwrap();
        for i in [0, 1, 12_345, n - 1] {
            let want = (i as f32).sin() * (0.1 + 1.1 + 2.1) / 3.0;
            assert!((got[i] - want).abs() < 1e-5, "{i}: {} vs {want}", got[i]);
        }
    });
}

#[test]
fn allreduce_bool_and_u8() {
    watchdog(60, || {
        let g = CpuGroup::create(3, "bool").unwrap();
        on_ranks(&g, |c| {
            // Element i is true on ranks < i.
            let t = Tensor::from((0..4).map(|i| c.rank() < i).collect::<Vec<bool>>());
            let get = |op| c.allreduce(&t, op).unwrap().to_vec::<bool>().unwrap();
            assert_eq!(get(ReduceOp::Sum), [false, true, true, true]);
            assert_eq!(get(ReduceOp::Max), [false, true, true, true]);
            assert_eq!(get(ReduceOp::Product), [false, false, false, true]);
            assert_eq!(get(ReduceOp::Min), [false, false, false, true]);
            assert_eq!(get(ReduceOp::Average), [false, false, true, true]);
            let u = Tensor::from(vec![200u8, c.rank() as u8]);
            let s = c.allreduce(&u, ReduceOp::Sum).unwrap();
            assert_eq!(s.to_vec::<u8>().unwrap(), [600u32 as u8, 3]);
            let a = c.allreduce(&u, ReduceOp::Average).unwrap();
            assert_eq!(a.to_vec::<u8>().unwrap(), [200, 1]);
        });
    });
}

#[test]
fn allgather_concatenates_along_dim0_in_rank_order() {
    watchdog(60, || {
        let g =
            CpuGroup::with_options(3, "gather", &options(128, Duration::from_secs(30))).unwrap();
        on_ranks(&g, |c| {
            let r = c.rank() as i32;
            let t =
                Tensor::from_vec((0..10).map(|i| r * 100 + i).collect::<Vec<_>>(), [2, 5]).unwrap();
            let out = c.allgather(&t).unwrap();
            assert_eq!(out.shape(), &[6, 5]);
            let want: Vec<i32> = (0..3)
                .flat_map(|q| (0..10).map(move |i| q * 100 + i))
                .collect();
            assert_eq!(out.to_vec::<i32>().unwrap(), want);
            // Scalars gather into a vector.
            let s = c.allgather(&Tensor::scalar(r as f64)).unwrap();
            assert_eq!(s.shape(), &[3]);
            assert_eq!(s.to_vec::<f64>().unwrap(), [0.0, 1.0, 2.0]);
            // Several chunks (100 f32 = 400 bytes over 128-byte chunks).
            let big = Tensor::from(vec![r as f32; 100]);
            let out = c.allgather(&big).unwrap();
            let v = out.to_vec::<f32>().unwrap();
            assert_eq!(v.len(), 300);
            assert!((0..300).all(|i| v[i] == (i / 100) as f32));
            // Empty tensors.
            let e = c.allgather(&Tensor::zeros([0, 4], DType::F16)).unwrap();
            assert_eq!(e.shape(), &[0, 4]);
        });
    });
}

#[test]
fn reducescatter_gives_each_rank_its_part() {
    watchdog(60, || {
        for (world, chunk) in [(2, 1 << 20), (4, 128), (3, 256)] {
            let g = CpuGroup::with_options(world, "rs", &options(chunk, Duration::from_secs(30)))
                .unwrap();
            let rows = world * 5;
            on_ranks(&g, |c| {
                let r = c.rank() as i64;
                let data: Vec<i64> = (0..rows as i64 * 7).map(|i| i * (r + 1)).collect();
                let t = Tensor::from_vec(data, [rows, 7]).unwrap();
                let out = c.reducescatter(&t, ReduceOp::Sum).unwrap();
                assert_eq!(out.shape(), &[5, 7]);
                let factor: i64 = (1..=world as i64).sum();
                let start = c.rank() as i64 * 35;
                let want: Vec<i64> = (start..start + 35).map(|i| i * factor).collect();
                assert_eq!(out.to_vec::<i64>().unwrap(), want);
                let mx = c.reducescatter(&t, ReduceOp::Max).unwrap();
                let want: Vec<i64> = (start..start + 35).map(|i| i * world as i64).collect();
                assert_eq!(mx.to_vec::<i64>().unwrap(), want);
            });
        }
    });
}

#[test]
fn reducescatter_uneven_is_a_typed_error_on_every_rank_and_the_group_survives() {
    watchdog(60, || {
        let g = CpuGroup::create(2, "uneven").unwrap();
        on_ranks(&g, |c| {
            let e = c
                .reducescatter(&Tensor::from(vec![1.0f32; 5]), ReduceOp::Sum)
                .unwrap_err();
            assert!(
                matches!(&e, CommError::Uneven { world_size: 2, shape, .. } if shape == &[5]),
                "{e}"
            );
            assert!(
                e.to_string().contains("divisible by the world size 2"),
                "{e}"
            );
            let e = c
                .reducescatter(&Tensor::scalar(1.0f32), ReduceOp::Sum)
                .unwrap_err();
            assert!(matches!(e, CommError::Uneven { .. }), "{e}");
            let ok = c
                .allreduce(&Tensor::from(vec![1i32]), ReduceOp::Sum)
                .unwrap();
            assert_eq!(ok.to_vec::<i32>().unwrap(), [2]);
        });
    });
}

#[test]
fn mismatched_collectives_are_typed_errors_on_every_rank() {
    watchdog(60, || {
        let g =
            CpuGroup::with_options(3, "mismatch", &options(128, Duration::from_secs(30))).unwrap();
        on_ranks(&g, |c| {
            let r = c.rank();
            // Shape: rank 2 passes 4 elements (several chunks for the others' 100).
            let n = if r == 2 { 4 } else { 100 };
            let e = c
                .allreduce(&Tensor::from(vec![1.0f32; n]), ReduceOp::Sum)
                .unwrap_err();
            match &e {
                CommError::Mismatch {
                    rank,
                    peer,
                    op,
                    expected,
                    found,
                    ..
                } => {
                    assert_eq!(*rank, r);
                    assert_eq!(*peer, if r == 2 { 0 } else { 2 });
                    assert_eq!(*op, CommOp::AllReduce(ReduceOp::Sum));
                    assert_ne!(expected, found);
                    assert!(found.contains("shape"), "{found}");
                }
                e => panic!("rank {r}: {e}"),
            }
            // Dtype.
            let t = if r == 1 {
                Tensor::from(vec![1i32; 3])
            } else {
                Tensor::from(vec![1.0f32; 3])
            };
            assert!(matches!(
                c.allreduce(&t, ReduceOp::Max),
                Err(CommError::Mismatch { .. })
            ));
            // Operation: rank 0 gathers while the others reduce.
            let t = Tensor::from(vec![1.0f32; 3]);
            let res = if r == 0 {
                c.allgather(&t)
            } else {
                c.allreduce(&t, ReduceOp::Sum)
            };
            let e = res.unwrap_err();
            assert!(e.to_string().contains("allgather"), "{e}");
            // Reduce op.
            let op = if r == 1 { ReduceOp::Min } else { ReduceOp::Sum };
            assert!(matches!(
                c.allreduce(&t, op),
                Err(CommError::Mismatch { .. })
            ));
            // The group still works.
            let ok = c.allreduce(&t, ReduceOp::Sum).unwrap();
            assert_eq!(ok.to_vec::<f32>().unwrap(), [3.0; 3]);
        });
    });
}

#[test]
fn an_unusable_tensor_on_one_rank_fails_the_call_on_every_rank() {
    watchdog(60, || {
        let g = CpuGroup::create(3, "device").unwrap();
        on_ranks(&g, |c| {
            let t = if c.rank() == 1 {
                Tensor::from_device_buffer(DType::F32, [2], Arc::new(FakeCuda(8))).unwrap()
            } else {
                Tensor::from(vec![1.0f32; 2])
            };
            let e = c.allreduce(&t, ReduceOp::Sum).unwrap_err();
            if c.rank() == 1 {
                assert!(
                    matches!(
                        &e,
                        CommError::Tensor {
                            source: TensorError::NotOnCpu { .. },
                            ..
                        }
                    ),
                    "{e}"
                );
            } else {
                assert!(matches!(&e, CommError::PeerFailed { peer: 1, .. }), "{e}");
                assert!(e.to_string().contains("lives on cuda:0"), "{e}");
            }
            let deep = Tensor::zeros(vec![1; MAX_DIMS + 1], DType::U8);
            let t = if c.rank() == 0 {
                deep
            } else {
                Tensor::zeros([1], DType::U8)
            };
            assert!(c.allgather(&t).is_err());
            let ok = c.allgather(&Tensor::from(vec![c.rank() as u8])).unwrap();
            assert_eq!(ok.to_vec::<u8>().unwrap(), [0, 1, 2]);
        });
    });
}

#[test]
fn send_recv_keeps_order_across_chunks_and_directions() {
    watchdog(60, || {
        let g = CpuGroup::with_options(2, "p2p", &options(128, Duration::from_secs(30))).unwrap();
        let a = Arc::new(g.communicator(0).unwrap());
        let b = Arc::new(g.communicator(1).unwrap());
        let msg = |i: usize, from: usize| {
            // 1 to 150 f32: up to 5 chunks of 128 bytes.
            let n = (i * 37) % 150 + 1;
            Tensor::from(vec![(i * 10 + from) as f32; n])
        };
        const N: usize = 200;
        thread::scope(|s| {
            for (me, peer) in [(&a, 1usize), (&b, 0usize)] {
                let me2 = Arc::clone(me);
                // One thread sends, another receives, on the same communicator.
                s.spawn(move || {
                    for i in 0..N {
                        me2.send(&msg(i, me2.rank()), peer).unwrap();
                    }
                });
                let me3 = Arc::clone(me);
                s.spawn(move || {
                    for i in 0..N {
                        let want = msg(i, peer);
                        let got = me3.recv(want.shape(), DType::F32, peer).unwrap();
                        assert_eq!(got, want, "message {i} from rank {peer}");
                    }
                });
            }
        });
    });
}

#[test]
fn many_senders_one_receiver() {
    watchdog(60, || {
        let g = CpuGroup::create(4, "fan-in").unwrap();
        on_ranks(&g, |c| {
            if c.rank() == 0 {
                for i in 0..50 {
                    for peer in 1..4 {
                        let t = c.recv(&[2], DType::I64, peer).unwrap();
                        assert_eq!(t.to_vec::<i64>().unwrap(), [peer as i64, i]);
                    }
                }
            } else {
                for i in 0..50 {
                    c.send(&Tensor::from(vec![c.rank() as i64, i]), 0).unwrap();
                }
            }
        });
    });
}

#[test]
fn recv_of_another_shape_or_dtype_is_a_typed_error_and_later_messages_stay_in_order() {
    watchdog(60, || {
        let g = CpuGroup::with_options(2, "p2p-mismatch", &options(128, Duration::from_secs(30)))
            .unwrap();
        on_ranks(&g, |c| {
            if c.rank() == 0 {
                c.send(&Tensor::from(vec![1.0f32; 100]), 1).unwrap(); // 4 chunks
                c.send(&Tensor::from(vec![2i32, 3]), 1).unwrap();
                c.send(&Tensor::from(vec![4i32, 5]), 1).unwrap();
                c.send(&Tensor::from(vec![true, false]), 1).unwrap();
            } else {
                let e = c.recv(&[99], DType::F32, 0).unwrap_err();
                match &e {
                    CommError::Mismatch {
                        peer: 0,
                        op: CommOp::Recv,
                        expected,
                        found,
                        ..
                    } => {
                        assert!(expected.contains("[99]") && found.contains("[100]"), "{e}");
                    }
                    e => panic!("{e}"),
                }
                let e = c.recv(&[2], DType::F32, 0).unwrap_err();
                assert!(e.to_string().contains("dtype i32"), "{e}");
                let t = c.recv(&[2], DType::I32, 0).unwrap();
                assert_eq!(t.to_vec::<i32>().unwrap(), [4, 5]);
                let t = c.recv(&[2], DType::Bool, 0).unwrap();
                assert_eq!(t.to_vec::<bool>().unwrap(), [true, false]);
            }
        });
    });
}

#[test]
fn send_recv_edge_cases() {
    watchdog(60, || {
        let g = CpuGroup::create(2, "edges").unwrap();
        let (a, b) = (g.communicator(0).unwrap(), g.communicator(1).unwrap());
        // Empty and scalar tensors.
        a.send(&Tensor::zeros([0, 3], DType::F32), 1).unwrap();
        a.send(&Tensor::scalar(7i16), 1).unwrap();
        assert_eq!(b.recv(&[0, 3], DType::F32, 0).unwrap().numel(), 0);
        assert_eq!(
            b.recv(&[], DType::I16, 0).unwrap().to_vec::<i16>().unwrap(),
            [7]
        );
        // Bad peers.
        for peer in [0, 2] {
            let e = a.send(&Tensor::scalar(1u8), peer).unwrap_err();
            assert!(matches!(e, CommError::InvalidPeer { rank: 0, .. }), "{e}");
        }
        assert!(matches!(
            b.recv(&[1], DType::U8, 5),
            Err(CommError::InvalidPeer { peer: 5, .. })
        ));
        // A device tensor cannot be sent by the CPU communicator.
        let d = Tensor::from_device_buffer(DType::U8, [3], Arc::new(FakeCuda(3))).unwrap();
        assert!(matches!(a.send(&d, 1), Err(CommError::Tensor { .. })));
        assert!(matches!(
            a.send(&Tensor::zeros(vec![1; MAX_DIMS + 1], DType::U8), 1),
            Err(CommError::Unsupported { .. })
        ));
        assert!(matches!(
            b.recv(&[usize::MAX, 2], DType::U8, 0),
            Err(CommError::Tensor { .. })
        ));
    });
}

#[test]
fn recv_timeout_with_nothing_sent_leaves_the_group_usable() {
    watchdog(60, || {
        let g = CpuGroup::with_options(2, "rto", &options(1 << 16, Duration::from_millis(200)))
            .unwrap();
        let (a, b) = (g.communicator(0).unwrap(), g.communicator(1).unwrap());
        let t0 = Instant::now();
        let e = b.recv(&[4], DType::F32, 0).unwrap_err();
        let took = t0.elapsed();
        assert!(
            took >= Duration::from_millis(190) && took < Duration::from_secs(5),
            "{took:?}"
        );
        match &e {
            CommError::Timeout {
                rank: 1,
                op: CommOp::Recv,
                waiting_for,
                timeout,
                ..
            } => {
                assert!(waiting_for.contains("rank 0"), "{e}");
                assert_eq!(*timeout, Duration::from_millis(200));
            }
            e => panic!("{e}"),
        }
        assert!(!g.is_destroyed());
        a.send(&Tensor::from(vec![1.0f32; 4]), 1).unwrap();
        assert_eq!(b.recv(&[4], DType::F32, 0).unwrap().numel(), 4);
    });
}

#[test]
fn send_to_a_full_mailbox_times_out_and_the_group_stays_usable() {
    watchdog(60, || {
        let g =
            CpuGroup::with_options(2, "sto", &options(128, Duration::from_millis(200))).unwrap();
        let (a, b) = (g.communicator(0).unwrap(), g.communicator(1).unwrap());
        let depth = super::cpu::DEPTH as u8;
        for k in 1..=depth {
            a.send(&Tensor::scalar(k), 1).unwrap();
        }
        let e = a.send(&Tensor::scalar(depth + 1), 1).unwrap_err();
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
        for k in 1..=depth {
            assert_eq!(
                b.recv(&[], DType::U8, 0).unwrap().to_vec::<u8>().unwrap(),
                [k]
            );
        }
        a.send(&Tensor::scalar(200u8), 1).unwrap();
        assert_eq!(
            b.recv(&[], DType::U8, 0).unwrap().to_vec::<u8>().unwrap(),
            [200]
        );
        // A timeout in the middle of a chunked message aborts the group.
        a.set_timeout(Duration::from_millis(100));
        let chunks = super::cpu::DEPTH as usize + 3;
        let e = a
            .send(&Tensor::from(vec![0u8; 128 * chunks]), 1)
            .unwrap_err();
        assert!(matches!(e, CommError::Timeout { .. }), "{e}");
        assert!(g.is_destroyed());
        let e = b.recv(&[1], DType::U8, 0).unwrap_err();
        assert!(matches!(e, CommError::Aborted { by: 0, .. }), "{e}");
    });
}

#[test]
fn destroy_wakes_a_rank_blocked_in_allreduce() {
    watchdog(60, || {
        let g = CpuGroup::with_options(2, "destroy", &options(1 << 16, Duration::from_secs(60)))
            .unwrap();
        let a = g.communicator(0).unwrap();
        let b = g.communicator(1).unwrap();
        let t0 = Instant::now();
        let blocked = thread::spawn(move || {
            let r = a.allreduce(&Tensor::from(vec![1.0f32; 8]), ReduceOp::Sum);
            (r, a)
        });
        // Nothing will come from rank 0 to rank 1.
        let blocked_recv = thread::spawn(move || b.recv(&[1], DType::F32, 0));
        thread::sleep(Duration::from_millis(200));
        g.destroy();
        let (r, a) = blocked.join().unwrap();
        let e = r.unwrap_err();
        assert!(matches!(e, CommError::Destroyed { rank: 0, .. }), "{e}");
        assert!(e.to_string().contains("destroyed"));
        let e = blocked_recv.join().unwrap().unwrap_err();
        assert!(matches!(e, CommError::Destroyed { rank: 1, .. }), "{e}");
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
        // Later calls fail at once; destroy is idempotent.
        assert!(matches!(
            a.allgather(&Tensor::scalar(1u8)),
            Err(CommError::Destroyed { .. })
        ));
        assert!(a.destroy().is_ok());
        assert!(g.is_destroyed());
    });
}

#[test]
fn destroy_by_a_rank_wakes_the_others() {
    watchdog(60, || {
        let g = CpuGroup::with_options(3, "destroy2", &options(1 << 16, Duration::from_secs(60)))
            .unwrap();
        let comms: Vec<_> = (0..3)
            .map(|r| Arc::new(g.communicator(r).unwrap()))
            .collect();
        let waiters: Vec<_> = comms[..2]
            .iter()
            .map(|c| {
                let c = Arc::clone(c);
                thread::spawn(move || c.allreduce(&Tensor::from(vec![1i32]), ReduceOp::Sum))
            })
            .collect();
        thread::sleep(Duration::from_millis(100));
        comms[2].destroy().unwrap();
        for w in waiters {
            assert!(matches!(
                w.join().unwrap(),
                Err(CommError::Destroyed { .. })
            ));
        }
    });
}

#[test]
fn a_rank_that_never_joins_times_out_the_others() {
    watchdog(60, || {
        let g = CpuGroup::with_options(3, "late", &options(1 << 16, Duration::from_millis(300)))
            .unwrap();
        let comms: Vec<_> = (0..2).map(|r| g.communicator(r).unwrap()).collect();
        let t0 = Instant::now();
        let errs: Vec<CommError> = thread::scope(|s| {
            let hs: Vec<_> = comms
                .iter()
                .map(|c| s.spawn(|| c.allreduce(&Tensor::from(vec![1.0f32; 4]), ReduceOp::Sum)))
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap().unwrap_err())
                .collect()
        });
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
        let mut timeouts = 0;
        for e in &errs {
            match e {
                CommError::Timeout {
                    waiting_for, op, ..
                } => {
                    timeouts += 1;
                    assert!(waiting_for.contains("[2]"), "{e}");
                    assert_eq!(*op, CommOp::AllReduce(ReduceOp::Sum));
                    assert!(e.to_string().contains("timed out after 300ms"), "{e}");
                }
                CommError::Aborted { reason, .. } => assert!(reason.contains("timed out")),
                e => panic!("{e}"),
            }
        }
        assert!(timeouts >= 1, "{errs:?}");
        // The group is aborted: the late rank finds out at once.
        let late = g.communicator(2).unwrap();
        let e = late
            .allreduce(&Tensor::from(vec![1.0f32; 4]), ReduceOp::Sum)
            .unwrap_err();
        assert!(matches!(e, CommError::Aborted { .. }), "{e}");
    });
}

#[test]
fn ranks_are_opened_once_and_checked() {
    let g = CpuGroup::create(2, "ranks").unwrap();
    let a = g.communicator(0).unwrap();
    assert!(matches!(
        g.communicator(0),
        Err(CommError::RankInUse { rank: 0, .. })
    ));
    drop(a);
    let a = g.communicator(0).unwrap();
    assert!(matches!(
        g.communicator(2),
        Err(CommError::InvalidRank {
            rank: 2,
            world_size: 2,
            ..
        })
    ));
    assert_eq!(a.world_size(), 2);
    assert_eq!(a.transport_name(), "cpu");
    assert_eq!(a.comm_id(), Some(g.id()));
    assert_eq!(a.label(), "ranks");
    assert_eq!(a.device(), Device::Cpu);
    assert_eq!(a.recv_stream(), None);
    assert_eq!(a.send_stream(), None);
    assert!(format!("{a:?}").contains("ranks"));
    assert!(matches!(
        CpuGroup::create(0, "none"),
        Err(CommError::Config { .. })
    ));
    assert!(CpuGroup::create(cpu::MAX_WORLD_SIZE + 1, "many").is_err());
    let long = "x".repeat(500);
    assert_eq!(CpuGroup::create(1, &long).unwrap().label().len(), 96);
    assert_eq!(g.chunk_bytes(), 1 << 20);
    assert!(g.region_bytes() > 4 * (1 << 20));
}

#[test]
fn a_world_of_one_works() {
    watchdog(30, || {
        let g = CpuGroup::create(1, "solo").unwrap();
        let c = g.communicator(0).unwrap();
        let t = Tensor::from(vec![1.5f32, 2.5]);
        assert_eq!(c.allreduce(&t, ReduceOp::Average).unwrap(), t);
        assert_eq!(c.allgather(&t).unwrap(), t);
        assert_eq!(c.reducescatter(&t, ReduceOp::Sum).unwrap(), t);
    });
}

#[test]
fn open_by_descriptor_and_through_the_factory() {
    watchdog(60, || {
        let f = factory(TRANSPORT).unwrap();
        let group = f.create_group(2, "ticket").unwrap();
        assert_eq!(group.transport_name(), "cpu");
        let ticket = group.ticket().unwrap();
        assert_eq!(ticket.world_size, 2);
        assert_eq!(ticket.id, group.id());
        // The ticket travels serialized; the descriptor separately.
        let ticket: GroupTicket =
            postcard::from_bytes(&postcard::to_stdvec(&ticket).unwrap()).unwrap();
        let fd = group.fds()[0].try_clone_to_owned().unwrap();
        // A second mapping of the same memfd, as another process would have.
        let remote = open_ticket(&ticket, vec![fd], 1).unwrap();
        let local = group.communicator(0).unwrap();
        assert_eq!(remote.comm_id(), Some(group.id()));
        let outs: Vec<Tensor> = thread::scope(|s| {
            let hs: Vec<_> = [&local, &remote]
                .into_iter()
                .map(|c| {
                    s.spawn(move || {
                        c.allreduce(
                            &Tensor::from(vec![c.rank() as i32 + 1; 3]),
                            ReduceOp::Product,
                        )
                        .unwrap()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(outs[0].to_vec::<i32>().unwrap(), [2, 2, 2]);
        assert_eq!(outs[0], outs[1]);
        remote.send(&Tensor::from(vec![9u8]), 0).unwrap();
        assert_eq!(
            local
                .recv(&[1], DType::U8, 1)
                .unwrap()
                .to_vec::<u8>()
                .unwrap(),
            [9]
        );
        // Errors: wrong ticket, no fd, rank held, unknown transport, not a region.
        let fd = group.fds()[0].try_clone_to_owned().unwrap();
        let mut wrong = ticket.clone();
        wrong.id = CommId::generate();
        assert!(matches!(
            open_ticket(&wrong, vec![fd], 0),
            Err(CommError::Config { .. }) | Err(CommError::RankInUse { .. })
        ));
        assert!(matches!(
            open_ticket(&ticket, vec![], 0),
            Err(CommError::Config { .. })
        ));
        let fd = group.fds()[0].try_clone_to_owned().unwrap();
        assert!(matches!(
            open_ticket(&ticket, vec![fd], 1),
            Err(CommError::RankInUse { rank: 1, .. })
        ));
        let mut other = ticket.clone();
        other.transport = "carrier-pigeon".into();
        assert!(matches!(
            open_ticket(&other, vec![], 0),
            Err(CommError::UnknownTransport { .. })
        ));
        let not_a_region =
            rustix::fs::memfd_create("adag-test-not-a-region", rustix::fs::MemfdFlags::CLOEXEC)
                .unwrap();
        let e = CpuCommunicator::open(&not_a_region, 0).unwrap_err();
        assert!(matches!(e, CommError::Protocol { .. }), "{e}");
        rustix::fs::ftruncate(&not_a_region, 8192).unwrap();
        let e = CpuCommunicator::open(&not_a_region, 0).unwrap_err();
        assert!(e.to_string().contains("bad magic"), "{e}");
        // Destroy through the trait reaches the other mapping.
        group.destroy();
        assert!(matches!(
            remote.send(&Tensor::scalar(1u8), 0),
            Err(CommError::Destroyed { .. })
        ));
    });
}

#[test]
fn registered_factories_take_precedence() {
    #[derive(Debug)]
    struct Custom;
    impl CommunicatorFactory for Custom {
        fn transport_name(&self) -> &str {
            "custom-test"
        }
        fn create_group(
            &self,
            world_size: usize,
            label: &str,
        ) -> Result<Arc<dyn CommunicatorGroup>, CommError> {
            Ok(Arc::new(CpuGroup::create(world_size, label)?))
        }
        fn open(
            &self,
            _: &GroupTicket,
            _: Vec<OwnedFd>,
            _: usize,
        ) -> Result<Arc<dyn Communicator>, CommError> {
            Err(CommError::Unsupported {
                transport: "custom-test".into(),
                op: CommOp::Open,
                reason: "test".into(),
            })
        }
    }
    assert!(factory("custom-test").is_none());
    register_factory(Arc::new(Custom));
    let f = factory("custom-test").unwrap();
    assert_eq!(f.create_group(2, "c").unwrap().world_size(), 2);
    let t = GroupTicket {
        id: CommId::generate(),
        transport: "custom-test".into(),
        world_size: 2,
        payload: vec![],
    };
    assert!(matches!(
        open_ticket(&t, vec![], 0),
        Err(CommError::Unsupported { .. })
    ));
}

#[test]
fn local_group_checks_its_communicators() {
    let g = CpuGroup::create(2, "local").unwrap();
    let c0: Arc<dyn Communicator> = Arc::new(g.communicator(0).unwrap());
    let c1: Arc<dyn Communicator> = Arc::new(g.communicator(1).unwrap());
    assert!(LocalGroup::new(vec![]).is_err());
    assert!(LocalGroup::new(vec![c1.clone(), c0.clone()]).is_err());
    assert!(LocalGroup::new(vec![c0.clone()]).is_err());
    let lg = LocalGroup::new(vec![c0, c1]).unwrap();
    assert_eq!(lg.id(), g.id());
    assert_eq!(lg.transport_name(), "cpu");
    assert!(lg.communicator(2).is_err());
    assert!(matches!(lg.ticket(), Err(CommError::Unsupported { .. })));
    assert!(lg.fds().is_empty());
    lg.destroy();
    assert!(g.is_destroyed());
}

#[test]
fn comm_ids_are_unique_and_print_as_hex() {
    let ids: std::collections::HashSet<CommId> = (0..1000).map(|_| CommId::generate()).collect();
    assert_eq!(ids.len(), 1000);
    let id = CommId::from_u128(0xab);
    assert_eq!(id.to_string(), format!("{:032x}", 0xab));
    assert_eq!(id.as_u128(), 0xab);
    assert!(format!("{id:?}").starts_with("CommId("));
}

#[test]
fn names_of_ops_and_errors() {
    assert_eq!(
        CommOp::AllReduce(ReduceOp::Average).to_string(),
        "allreduce(avg)"
    );
    assert_eq!(
        CommOp::ReduceScatter(ReduceOp::Max).to_string(),
        "reducescatter(max)"
    );
    assert_eq!(ReduceOp::Product.to_string(), "product");
    let e = CommError::InvalidPeer {
        group: "g".into(),
        rank: 1,
        peer: 1,
        op: CommOp::Send,
        world_size: 4,
    };
    let s = e.to_string();
    assert!(
        s.contains("rank 1") && s.contains("peer 1") && s.contains("send"),
        "{s}"
    );
}

#[test]
fn reduce_kernels() {
    let run = |dtype, op, ins: &[Vec<u8>]| {
        let refs: Vec<&[u8]> = ins.iter().map(|v| &v[..]).collect();
        let mut out = vec![0u8; ins[0].len()];
        reduce_bytes(dtype, op, &refs, &mut out).unwrap();
        out
    };
    // Integers wrap on sum and product; the mean is exact.
    let i8s = |v: &[i8]| v.iter().map(|&x| x as u8).collect::<Vec<u8>>();
    assert_eq!(
        run(DType::I8, ReduceOp::Sum, &[i8s(&[100]), i8s(&[100])]),
        i8s(&[-56])
    );
    assert_eq!(
        run(DType::I8, ReduceOp::Product, &[i8s(&[16]), i8s(&[16])]),
        i8s(&[0])
    );
    assert_eq!(
        run(
            DType::I8,
            ReduceOp::Average,
            &[i8s(&[127]), i8s(&[127]), i8s(&[-128])]
        ),
        i8s(&[42])
    );
    let big = i64::MAX.to_ne_bytes().to_vec();
    assert_eq!(
        run(DType::I64, ReduceOp::Average, &[big.clone(), big.clone()]),
        big
    );
    // f16 accumulates in f32: 2048 + 1 + 1 is 2050, where f16 steps would give 2048.
    let h = |x: f32| f16::from_f32(x).to_ne_bytes().to_vec();
    assert_eq!(
        run(DType::F16, ReduceOp::Sum, &[h(2048.0), h(1.0), h(1.0)]),
        h(2050.0)
    );
    let b = |x: f32| bf16::from_f32(x).to_ne_bytes().to_vec();
    assert_eq!(
        run(DType::BF16, ReduceOp::Average, &[b(1.0), b(2.0)]),
        b(1.5)
    );
    assert_eq!(run(DType::BF16, ReduceOp::Min, &[b(1.0), b(-2.0)]), b(-2.0));
    // Errors, not panics.
    let mut out = [0u8; 4];
    assert!(reduce_bytes(DType::F32, ReduceOp::Sum, &[], &mut out).is_err());
    assert!(reduce_bytes(DType::F32, ReduceOp::Sum, &[&[0u8; 8][..]], &mut out).is_err());
    let mut odd = [0u8; 3];
    assert!(reduce_bytes(DType::I16, ReduceOp::Sum, &[&[0u8; 3][..]], &mut odd).is_err());
    // The tensor-level reference.
    let r = reduce_tensors(
        &[
            Tensor::from(vec![1.0f64, 4.0]),
            Tensor::from(vec![3.0f64, 2.0]),
        ],
        ReduceOp::Average,
    )
    .unwrap();
    assert_eq!(r.to_vec::<f64>().unwrap(), [2.0, 3.0]);
    assert!(reduce_tensors(&[], ReduceOp::Sum).is_err());
    assert!(
        reduce_tensors(
            &[Tensor::from(vec![1u8]), Tensor::from(vec![1i8])],
            ReduceOp::Sum
        )
        .is_err()
    );
    assert!(
        reduce_tensors(
            &[Tensor::from(vec![1u8]), Tensor::from(vec![1u8, 2])],
            ReduceOp::Sum
        )
        .is_err()
    );
}

#[test]
fn the_factory_uses_its_options() {
    let f = CpuFactory {
        options: options(4096, Duration::from_millis(50)),
    };
    let g = f.create_group(2, "opts").unwrap();
    let c = g.communicator(0).unwrap();
    let t0 = Instant::now();
    assert!(matches!(
        c.recv(&[1], DType::U8, 1),
        Err(CommError::Timeout { .. })
    ));
    assert!(t0.elapsed() < Duration::from_secs(2));
}

// ---- Across processes ----------------------------------------------------------------------

/// Set in the child processes: `fd,rank,world`.
const CHILD_ENV: &str = "ADAG_COMM_TEST_CHILD";

fn child_test_name() -> String {
    let path = module_path!();
    let path = path.split_once("::").map_or(path, |(_, rest)| rest);
    format!("{path}::cross_process_child")
}

/// What every rank does in the cross-process test; returns the rank's communicator.
fn cross_process_rank(c: &CpuCommunicator) {
    let (r, w) = (c.rank(), c.world_size());
    // A large allreduce (several chunks) and the small ones.
    let n = 100_000;
    let t = Tensor::from(vec![(r + 1) as f32; n]);
    let s = c.allreduce(&t, ReduceOp::Sum).unwrap();
    let want = (w * (w + 1) / 2) as f32;
    assert!(s.as_slice::<f32>().unwrap().iter().all(|&x| x == want));
    let m = c
        .allreduce(&Tensor::from(vec![bf16::from_f32(r as f32)]), ReduceOp::Max)
        .unwrap();
    assert_eq!(m.to_vec::<bf16>().unwrap()[0].to_f32(), (w - 1) as f32);
    let g = c.allgather(&Tensor::scalar(r as i32 * 10)).unwrap();
    assert_eq!(
        g.to_vec::<i32>().unwrap(),
        (0..w as i32).map(|q| q * 10).collect::<Vec<_>>()
    );
    let rs = c
        .reducescatter(&Tensor::from(vec![1i64; 2 * w]), ReduceOp::Sum)
        .unwrap();
    assert_eq!(rs.to_vec::<i64>().unwrap(), [w as i64; 2]);
    // Point to point: rank 0 sends each rank a tensor and gets it back doubled.
    if r == 0 {
        for peer in 1..w {
            c.send(&Tensor::from(vec![peer as f64; 3000]), peer)
                .unwrap();
        }
        for peer in 1..w {
            let back = c.recv(&[3000], DType::F64, peer).unwrap();
            assert!(
                back.as_slice::<f64>()
                    .unwrap()
                    .iter()
                    .all(|&x| x == 2.0 * peer as f64)
            );
        }
    } else {
        let t = c.recv(&[3000], DType::F64, 0).unwrap();
        let doubled: Vec<f64> = t
            .as_slice::<f64>()
            .unwrap()
            .iter()
            .map(|x| x * 2.0)
            .collect();
        c.send(&Tensor::from(doubled), 0).unwrap();
    }
}

/// The child side of `cross_process_allreduce`: a no-op unless started by it.
#[test]
fn cross_process_child() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let parts: Vec<usize> = spec.split(',').map(|p| p.parse().unwrap()).collect();
    let (fd, rank, world) = (parts[0], parts[1], parts[2]);
    // The inherited descriptor, reopened through /proc (no unsafe `from_raw_fd` needed).
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(format!("/proc/self/fd/{fd}"))
        .unwrap();
    let c = CpuCommunicator::open(&file, rank).unwrap();
    assert_eq!(c.world_size(), world);
    assert_eq!(c.label(), "xproc");
    cross_process_rank(&c);
    // Block until the parent destroys the group: the destroy must reach this process.
    c.set_timeout(Duration::from_secs(60));
    let t0 = Instant::now();
    let e = c.recv(&[1], DType::U8, 0).unwrap_err();
    assert!(matches!(e, CommError::Destroyed { .. }), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(30));
    println!("child rank {rank}: done");
}

#[test]
fn cross_process_allreduce() {
    if std::env::var(CHILD_ENV).is_ok() {
        return;
    }
    watchdog(120, || {
        let world = 3;
        let g = CpuGroup::with_options(world, "xproc", &options(64 << 10, Duration::from_secs(30)))
            .unwrap();
        // dup() gives a descriptor without close-on-exec, which the children inherit.
        let inherit = rustix::io::dup(g.fd()).unwrap();
        let exe = std::env::current_exe().unwrap();
        let mut children: Vec<std::process::Child> = (1..world)
            .map(|rank| {
                std::process::Command::new(&exe)
                    .args([
                        "--exact",
                        &child_test_name(),
                        "--nocapture",
                        "--test-threads=1",
                    ])
                    .env(CHILD_ENV, format!("{},{rank},{world}", inherit.as_raw_fd()))
                    .spawn()
                    .unwrap()
            })
            .collect();
        drop(inherit);
        let c = g.communicator(0).unwrap();
        let result = catch_unwind(AssertUnwindSafe(|| cross_process_rank(&c)));
        // Let the children block in their last recv, then destroy.
        thread::sleep(Duration::from_millis(100));
        g.destroy();
        let deadline = Instant::now() + Duration::from_secs(60);
        for child in &mut children {
            let status = loop {
                if let Some(s) = child.try_wait().unwrap() {
                    break s;
                }
                if Instant::now() > deadline {
                    let _ = child.kill();
                    panic!("a child rank did not exit in time");
                }
                thread::sleep(Duration::from_millis(10));
            };
            assert!(status.success(), "a child rank failed: {status}");
        }
        if let Err(p) = result {
            resume_unwind(p);
        }
    });
}
