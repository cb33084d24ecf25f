//! Tests that need a GPU (and, for `gpu_nccl_*`, NCCL). All are `#[ignore]`: run them on a
//! GPU machine with `scripts/gpu/run.sh` (or `cargo test -p adag-cuda -- --ignored
//! --test-threads=1`). Tests named `gpu_cuda_*` need only the driver.
use adag::comm::{CommError, CommOp, Communicator, ReduceOp, open_ticket, reduce_tensors};
use adag::tensor::{DType, Device, Tensor};
use adag_cuda::{CudaError, NcclCommunicator, NcclGroup, NcclOptions, to_device, to_host};
use half::{bf16, f16};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn require_cuda() -> usize {
    if let Err(e) = adag_cuda::check_cuda() {
        panic!("this test needs CUDA: {e}");
    }
    let n = adag_cuda::device_count().expect("device count");
    assert!(n >= 1, "no CUDA device visible");
    n
}

fn require_nccl() -> usize {
    let n = require_cuda();
    if let Err(e) = adag_cuda::check_nccl() {
        panic!("this test needs NCCL: {e}");
    }
    n
}

/// A tensor of small integers (exact in every dtype), different per `seed`.
fn sample(dtype: DType, shape: &[usize], seed: usize) -> Tensor {
    let n: usize = shape.iter().product();
    let v = |i: usize| ((i * 3 + seed) % 7) as i64 + 1;
    let shape = shape.to_vec();
    match dtype {
        DType::F16 => Tensor::from_vec((0..n).map(|i| f16::from_f32(v(i) as f32)).collect(), shape),
        DType::BF16 => {
            Tensor::from_vec((0..n).map(|i| bf16::from_f32(v(i) as f32)).collect(), shape)
        }
        DType::F32 => Tensor::from_vec((0..n).map(|i| v(i) as f32).collect(), shape),
        DType::F64 => Tensor::from_vec((0..n).map(|i| v(i) as f64).collect(), shape),
        DType::I8 => Tensor::from_vec((0..n).map(|i| v(i) as i8).collect(), shape),
        DType::I16 => Tensor::from_vec((0..n).map(|i| v(i) as i16).collect(), shape),
        DType::I32 => Tensor::from_vec((0..n).map(|i| v(i) as i32).collect(), shape),
        DType::I64 => Tensor::from_vec((0..n).map(v).collect(), shape),
        DType::U8 => Tensor::from_vec((0..n).map(|i| v(i) as u8).collect(), shape),
        DType::Bool => Tensor::from_vec(
            (0..n).map(|i| (i + seed).is_multiple_of(2)).collect(),
            shape,
        ),
    }
    .unwrap()
}

fn supported(dtype: DType, op: ReduceOp) -> bool {
    !(dtype == DType::I16 || (dtype == DType::Bool && op == ReduceOp::Average))
}

#[test]
#[ignore = "needs a GPU: run scripts/gpu/run.sh"]
fn gpu_cuda_devices_and_versions() {
    let n = require_cuda();
    let (major, minor) = adag_cuda::driver_version().unwrap();
    eprintln!("CUDA driver {major}.{minor}, {n} device(s)");
    assert!(major >= 11);
    let ctx = adag_cuda::context(0).unwrap();
    eprintln!("device 0: {}", ctx.name().unwrap_or_default());
    assert!(Arc::ptr_eq(&ctx, &adag_cuda::context(0).unwrap()));
    assert!(matches!(
        adag_cuda::context(n as u32),
        Err(CudaError::NoSuchDevice { .. })
    ));
    assert!(adag_cuda::loaded_library(adag_cuda::Library::Cuda).is_some());
}

#[test]
#[ignore = "needs a GPU: run scripts/gpu/run.sh"]
fn gpu_cuda_round_trip_every_dtype_and_shape() {
    require_cuda();
    for d in DType::ALL {
        for shape in [vec![], vec![0], vec![5], vec![3, 4], vec![2, 0, 3]] {
            let t = sample(d, &shape, 1);
            let g = to_device(&t, 0).unwrap();
            assert_eq!(g.device(), Device::Cuda(0));
            assert_eq!((g.dtype(), g.shape()), (d, &shape[..]));
            assert_eq!(g.nbytes(), t.nbytes());
            assert!(
                g.as_bytes().is_err(),
                "device data is not readable on the CPU"
            );
            assert!(adag_cuda::cuda_buffer(&g).is_some());
            let back = to_host(&g).unwrap();
            assert_eq!(back, t, "{d} {shape:?}");
            // Already there: shared, not copied.
            assert_eq!(to_device(&g, 0).unwrap(), g);
        }
    }
    // A large one.
    let big = Tensor::from_fill(DType::U8, [64 << 20], |b| {
        for (i, x) in b.iter_mut().enumerate() {
            *x = (i * 31 % 251) as u8;
        }
    })
    .unwrap();
    let t0 = Instant::now();
    let g = to_device(&big, 0).unwrap();
    let up = t0.elapsed();
    let back = to_host(&g).unwrap();
    eprintln!("64 MiB: up {:?}, round trip {:?}", up, t0.elapsed());
    assert_eq!(back, big);
}

fn single_rank() -> (NcclGroup, NcclCommunicator) {
    let g = NcclGroup::create(1, "single").unwrap();
    let c = g.communicator(0).unwrap();
    c.init().unwrap();
    (g, c)
}

#[test]
#[ignore = "needs a GPU: run scripts/gpu/run.sh"]
fn gpu_nccl_single_rank_collectives() {
    require_nccl();
    let (major, minor, patch) = adag_cuda::nccl_version().unwrap();
    eprintln!(
        "NCCL {major}.{minor}.{patch} from {:?}",
        adag_cuda::loaded_library(adag_cuda::Library::Nccl)
    );
    let (g, c) = single_rank();
    assert!(c.is_initialized());
    assert_eq!(c.device(), Device::Cuda(0));
    assert_eq!(c.transport_name(), "nccl");
    assert_eq!(c.comm_id(), Some(g.id()));
    assert!(c.recv_stream().is_some() && c.send_stream() == c.recv_stream());
    for d in DType::ALL {
        let t = sample(d, &[4, 3], 2);
        let dev = to_device(&t, 0).unwrap();
        for op in ReduceOp::ALL {
            let r = c.allreduce(&dev, op);
            if !supported(d, op) {
                assert!(
                    matches!(r, Err(CommError::Unsupported { .. })),
                    "{d} {op}: {r:?}"
                );
                continue;
            }
            let r = r.unwrap_or_else(|e| panic!("{d} {op}: {e}"));
            assert_eq!(r.device(), Device::Cuda(0));
            let want = reduce_tensors(std::slice::from_ref(&t), op).unwrap();
            assert_eq!(to_host(&r).unwrap(), want, "allreduce {d} {op}");
        }
        let ag = c.allgather(&dev).unwrap();
        assert_eq!(to_host(&ag).unwrap(), t, "allgather {d}");
        if d != DType::I16 {
            let rs = c.reducescatter(&dev, ReduceOp::Max).unwrap();
            assert_eq!(to_host(&rs).unwrap(), t, "reducescatter {d}");
        }
    }
    // Scalars and empty tensors.
    let s = to_device(&Tensor::scalar(3.5f32), 0).unwrap();
    let ag = c.allgather(&s).unwrap();
    assert_eq!(ag.shape(), &[1]);
    assert_eq!(to_host(&ag).unwrap().as_slice::<f32>().unwrap(), &[3.5]);
    assert!(matches!(
        c.reducescatter(&s, ReduceOp::Sum),
        Err(CommError::Uneven { .. })
    ));
    let e = to_device(&Tensor::zeros([0, 3], DType::F32), 0).unwrap();
    assert_eq!(c.allreduce(&e, ReduceOp::Sum).unwrap().shape(), &[0, 3]);
    // Wrong inputs are typed errors.
    let cpu = Tensor::from(vec![1.0f32; 4]);
    assert!(matches!(
        c.allreduce(&cpu, ReduceOp::Sum),
        Err(CommError::Unsupported { .. })
    ));
    assert!(matches!(c.send(&s, 0), Err(CommError::InvalidPeer { .. })));
    assert!(matches!(
        c.recv(&[1], DType::F32, 1),
        Err(CommError::InvalidPeer { .. })
    ));
    // Destroy: later calls fail at once.
    Communicator::destroy(&c).unwrap();
    assert!(matches!(
        c.allreduce(&s, ReduceOp::Sum),
        Err(CommError::Destroyed { .. })
    ));
    assert!(g.is_destroyed());
}

#[test]
#[ignore = "needs a GPU: run scripts/gpu/run.sh"]
fn gpu_nccl_factory_and_ticket() {
    require_nccl();
    adag_cuda::register();
    let f = adag::comm::factory("nccl").unwrap();
    let g = f.create_group(1, "factory").unwrap();
    assert_eq!(g.transport_name(), "nccl");
    let ticket = g.ticket().unwrap();
    // A worker would receive the ticket and open its rank; do it here.
    let c = open_ticket(&ticket, vec![], 0).unwrap();
    assert_eq!(c.comm_id(), Some(g.id()));
    let t = sample(DType::F32, &[8], 0);
    let r = c
        .allreduce(&to_device(&t, 0).unwrap(), ReduceOp::Sum)
        .unwrap();
    assert_eq!(to_host(&r).unwrap(), t);
    assert!(matches!(
        open_ticket(&ticket, vec![], 1),
        Err(CommError::InvalidRank { .. })
    ));
    // One holder per rank in a process.
    let group = NcclGroup::from_ticket(&ticket).unwrap();
    let first = group.communicator(0).unwrap();
    assert!(matches!(
        group.communicator(0),
        Err(CommError::RankInUse { .. })
    ));
    drop(first);
    assert!(group.communicator(0).is_ok());
}

/// Named to run last (one test thread runs tests in name order): it leaves a helper thread
/// blocked in `ncclCommInitRank` for a rank that never comes.
#[test]
#[ignore = "needs a GPU: run scripts/gpu/run.sh"]
fn gpu_nccl_zz_join_timeout_and_destroy_never_hang() {
    require_nccl();
    // Rank 1 never joins: rank 0 times out, then a destroy wakes it.
    let opts = NcclOptions {
        timeout: Duration::from_secs(1),
        devices: vec![0, 0],
        ..NcclOptions::default()
    };
    let g = NcclGroup::with_options(2, "lonely", &opts).unwrap();
    let c0 = g.communicator(0).unwrap();
    let t0 = Instant::now();
    match c0.init() {
        Err(CommError::Timeout { op, .. }) => assert_eq!(op, CommOp::Open),
        other => panic!("expected a join timeout, got {other:?}"),
    }
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    c0.set_timeout(Duration::from_secs(60));
    let t1 = Instant::now();
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(300));
            g.destroy();
        });
        match c0.init() {
            Err(CommError::Destroyed { .. }) => {}
            other => panic!("expected Destroyed, got {other:?}"),
        }
    });
    assert!(t1.elapsed() < Duration::from_secs(5), "{:?}", t1.elapsed());
}

/// Two ranks: on two GPUs, or two ranks of one GPU where NCCL allows it.
#[test]
#[ignore = "needs a GPU: run scripts/gpu/run.sh"]
fn gpu_nccl_two_ranks() {
    let n = require_nccl();
    let devices = if n >= 2 { vec![0, 1] } else { vec![0, 0] };
    let opts = NcclOptions {
        timeout: Duration::from_secs(20),
        devices: devices.clone(),
        ..NcclOptions::default()
    };
    let g = NcclGroup::with_options(2, "pair", &opts).unwrap();
    let comms = [g.communicator(0).unwrap(), g.communicator(1).unwrap()];
    let joined: Vec<Result<(), CommError>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms.iter().map(|c| s.spawn(|| c.init())).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    if let Some(Err(e)) = joined.iter().find(|r| r.is_err()) {
        if n < 2 {
            eprintln!("SKIPPED two ranks on one GPU (devices {devices:?}): NCCL refused: {e}");
            return;
        }
        panic!("two ranks on two GPUs failed to join: {e}");
    }
    eprintln!("two ranks joined on devices {devices:?}");
    let inputs: Vec<Tensor> = (0..2).map(|r| sample(DType::F32, &[4, 5], r)).collect();
    std::thread::scope(|s| {
        for (rank, c) in comms.iter().enumerate() {
            let inputs = &inputs;
            s.spawn(move || {
                let dev = c.ordinal();
                let mine = to_device(&inputs[rank], dev).unwrap();
                // Collectives against the CPU reference.
                for op in ReduceOp::ALL {
                    let r = c.allreduce(&mine, op).unwrap();
                    assert_eq!(
                        to_host(&r).unwrap(),
                        reduce_tensors(inputs, op).unwrap(),
                        "rank {rank} allreduce {op}"
                    );
                }
                let ag = to_host(&c.allgather(&mine).unwrap()).unwrap();
                assert_eq!(ag, Tensor::cat(inputs).unwrap());
                let rs = to_host(&c.reducescatter(&mine, ReduceOp::Sum).unwrap()).unwrap();
                let full = reduce_tensors(inputs, ReduceOp::Sum).unwrap();
                assert_eq!(rs, full.narrow(rank * 2, 2).unwrap());
                // Point to point, both ways.
                let peer = 1 - rank;
                for turn in 0..2 {
                    if turn == rank {
                        c.send(&mine, peer).unwrap();
                    } else {
                        let got = c.recv(&[4, 5], DType::F32, peer).unwrap();
                        assert_eq!(to_host(&got).unwrap(), inputs[peer]);
                    }
                }
                // A recv of the wrong shape is a Mismatch, and the next message lines up.
                let small = to_device(&Tensor::from(vec![7i32, 8, 9, 10]), dev).unwrap();
                let next = to_device(&Tensor::from(vec![11i32, 12]), dev).unwrap();
                if rank == 0 {
                    c.send(&small, 1).unwrap();
                    c.send(&next, 1).unwrap();
                } else {
                    match c.recv(&[5], DType::I32, 0) {
                        Err(CommError::Mismatch { .. }) => {}
                        other => panic!("expected Mismatch, got {other:?}"),
                    }
                    let got = c.recv(&[2], DType::I32, 0).unwrap();
                    assert_eq!(to_host(&got).unwrap().as_slice::<i32>().unwrap(), &[11, 12]);
                }
            });
        }
    });
    // A recv that nobody answers times out and aborts the group for the other rank.
    comms[1].set_timeout(Duration::from_secs(1));
    let t0 = Instant::now();
    match comms[1].recv(&[1], DType::F32, 0) {
        Err(CommError::Timeout { .. }) => {}
        other => panic!("expected Timeout, got {other:?}"),
    }
    assert!(t0.elapsed() < Duration::from_secs(5));
    let x = to_device(&Tensor::from(vec![1.0f32]), comms[0].ordinal()).unwrap();
    match comms[0].allreduce(&x, ReduceOp::Sum) {
        Err(CommError::Aborted { by, .. }) => assert_eq!(by, 1),
        other => panic!("expected Aborted, got {other:?}"),
    }
}
