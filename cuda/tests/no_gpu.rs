//! What adag-cuda does on a machine without CUDA (CI, laptops): every entry point returns a
//! typed "not available" error, never a panic. On a machine with CUDA the same calls must
//! succeed or fail with a typed error; the GPU behaviour itself is tested in `gpu.rs`.
use adag::comm::{
    CommError, CommId, Communicator, CommunicatorFactory, GroupTicket, ReduceOp, open_ticket,
};
use adag::tensor::{DType, Device, DeviceBuffer, Tensor};
use adag_cuda::{CudaError, Library, NcclFactory, NcclGroup, NcclOptions};
use std::any::Any;
use std::sync::Arc;

/// Whether a CUDA driver library opens here, probed independently of the crate under test
/// (the same names that cudarc tries).
fn libcuda_present() -> bool {
    ["cuda", "nvcuda"]
        .iter()
        .flat_map(|s| cudarc::get_lib_name_candidates(s))
        // SAFETY: opening the driver library runs its initializers only.
        .any(|name| unsafe { libloading::Library::new(name) }.is_ok())
}

fn cuda_disabled() -> bool {
    std::env::var_os("ADAG_CUDA_DISABLE").is_some_and(|v| !v.is_empty() && v != "0")
}

/// True where this machine has no CUDA: then every check below must be a typed error.
fn no_cuda() -> bool {
    let absent = !libcuda_present() || cuda_disabled();
    if !absent {
        eprintln!("libcuda is present: checking only that errors are typed");
    }
    absent
}

fn assert_not_available<T: std::fmt::Debug>(what: &str, r: Result<T, CudaError>) {
    match r {
        Err(CudaError::NotAvailable { library, .. }) => {
            assert!(matches!(library, Library::Cuda | Library::Nccl), "{what}")
        }
        other => panic!("{what}: expected CudaError::NotAvailable, got {other:?}"),
    }
}

fn assert_comm_not_available<T: std::fmt::Debug>(what: &str, r: Result<T, CommError>) {
    match r {
        Err(CommError::Unsupported {
            transport, reason, ..
        }) => {
            assert_eq!(transport, "nccl", "{what}");
            assert!(reason.contains("not available"), "{what}: {reason}");
        }
        other => panic!("{what}: expected CommError::Unsupported (not available), got {other:?}"),
    }
}

#[test]
fn availability_is_a_typed_result() {
    let r = adag_cuda::check_cuda();
    if no_cuda() {
        let e = r.unwrap_err();
        assert!(e.is_not_available());
        let msg = e.to_string();
        assert!(
            msg.contains("libcuda") && msg.contains("is not available"),
            "{msg}"
        );
        assert!(adag_cuda::loaded_library(Library::Cuda).is_none());
        assert_not_available("check_nccl", adag_cuda::check_nccl());
    } else if let Err(e) = r {
        panic!("libcuda opens but check_cuda says {e}");
    }
}

#[test]
fn device_entry_points_fail_typed_without_cuda() {
    let t = Tensor::from(vec![1.0f32, 2.0, 3.0]);
    if !no_cuda() {
        // Typed either way: Ok, or an error that says why (no device...).
        let _ = adag_cuda::device_count();
        return;
    }
    assert_not_available("device_count", adag_cuda::device_count());
    assert_not_available("driver_version", adag_cuda::driver_version());
    assert_not_available("context", adag_cuda::context(0));
    assert_not_available("to_device", adag_cuda::to_device(&t, 0));
    assert_not_available("nccl_version", adag_cuda::nccl_version());
    // Needs no CUDA: a CPU tensor comes back as is.
    assert_eq!(adag_cuda::to_host(&t).unwrap(), t);
}

#[derive(Debug)]
struct OtherBuffer;
impl DeviceBuffer for OtherBuffer {
    fn device(&self) -> Device {
        Device::Cuda(0)
    }
    fn nbytes(&self) -> usize {
        12
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

#[test]
fn foreign_device_buffers_are_typed_errors() {
    let t = Tensor::from_device_buffer(DType::F32, [3], Arc::new(OtherBuffer)).unwrap();
    assert!(adag_cuda::cuda_buffer(&t).is_none());
    assert!(adag_cuda::cuda_buffer(&Tensor::from(vec![1u8])).is_none());
    if no_cuda() {
        assert!(matches!(
            adag_cuda::to_host(&t),
            Err(CudaError::ForeignBuffer { .. })
        ));
        // Same device: no copy, but the buffer must be ours.
        assert!(matches!(
            adag_cuda::to_device(&t, 0),
            Err(CudaError::ForeignBuffer { .. })
        ));
    }
}

#[test]
fn nccl_groups_fail_typed_without_nccl() {
    let created = NcclGroup::create(2, "no-gpu");
    if !no_cuda() {
        // With CUDA, a group needs NCCL too; whatever happens is a typed result.
        if let Err(e) = created {
            eprintln!("NcclGroup::create: {e}");
        }
        return;
    }
    assert_comm_not_available("NcclGroup::create", created);
    assert_comm_not_available(
        "NcclGroup::with_options",
        NcclGroup::with_options(1, "no-gpu", &NcclOptions::default()),
    );
    let f = NcclFactory::default();
    assert_eq!(f.transport_name(), "nccl");
    assert_comm_not_available("NcclFactory::create_group", f.create_group(2, "x"));

    // Registered under "nccl": the compiler's path fails the same way.
    adag_cuda::register();
    let registered = adag::comm::factory("nccl").expect("registered");
    assert_comm_not_available("factory(\"nccl\")", registered.create_group(2, "y"));
}

#[test]
fn bad_arguments_are_config_errors_first() {
    assert!(matches!(
        NcclGroup::create(0, "empty"),
        Err(CommError::Config { .. })
    ));
    let opts = NcclOptions {
        devices: vec![0],
        ..NcclOptions::default()
    };
    assert!(matches!(
        NcclGroup::with_options(2, "short", &opts),
        Err(CommError::Config { .. })
    ));
}

/// The ticket payload, as `NcclGroup::ticket` writes it (postcard, field order matters).
#[derive(serde::Serialize)]
struct TicketPayload {
    version: u32,
    unique_id: Vec<u8>,
    label: String,
    timeout_ns: u64,
    devices: Vec<u32>,
    p2p_header: bool,
}

fn ticket(world_size: usize, payload: Vec<u8>) -> GroupTicket {
    GroupTicket {
        id: CommId::generate(),
        transport: "nccl".into(),
        world_size,
        payload,
    }
}

#[test]
fn tickets_open_typed_without_nccl() {
    adag_cuda::register();
    let good = postcard::to_stdvec(&TicketPayload {
        version: 1,
        unique_id: vec![0; 128],
        label: "worker".into(),
        timeout_ns: 1_000_000_000,
        devices: vec![],
        p2p_header: true,
    })
    .unwrap();
    // A garbled payload or wrong sizes: Config, before any library is touched.
    for bad in [
        ticket(2, vec![9, 9, 9]),
        ticket(
            2,
            postcard::to_stdvec(&TicketPayload {
                version: 1,
                unique_id: vec![0; 5],
                label: "x".into(),
                timeout_ns: 0,
                devices: vec![],
                p2p_header: true,
            })
            .unwrap(),
        ),
        ticket(
            2,
            postcard::to_stdvec(&TicketPayload {
                version: 99,
                unique_id: vec![0; 128],
                label: "x".into(),
                timeout_ns: 0,
                devices: vec![],
                p2p_header: true,
            })
            .unwrap(),
        ),
        ticket(0, good.clone()),
    ] {
        assert!(
            matches!(open_ticket(&bad, vec![], 0), Err(CommError::Config { .. })),
            "{bad:?}"
        );
    }
    let t = ticket(2, good);
    if no_cuda() {
        assert_comm_not_available("open_ticket", open_ticket(&t, vec![], 1));
        assert_comm_not_available(
            "NcclCommunicator::open",
            adag_cuda::NcclCommunicator::open(&t, 0),
        );
    }
}

#[test]
fn never_panics_whatever_the_machine() {
    // Every entry point under catch_unwind: a panic here fails the test.
    let r = std::panic::catch_unwind(|| {
        let t = Tensor::from(vec![1i32, 2]);
        let _ = adag_cuda::check_cuda();
        let _ = adag_cuda::check_nccl();
        let _ = adag_cuda::device_count();
        let _ = adag_cuda::driver_version();
        let _ = adag_cuda::nccl_version();
        let _ = adag_cuda::to_device(&t, 0);
        let _ = adag_cuda::to_device(&t, 1_000);
        if let Ok(g) = NcclGroup::create(1, "smoke") {
            if let Ok(c) = g.communicator(0) {
                c.set_timeout(std::time::Duration::from_secs(20));
                // A CPU tensor is refused with a typed error, with or without a GPU.
                assert!(matches!(
                    c.allreduce(&t, ReduceOp::Sum),
                    Err(CommError::Unsupported { .. })
                ));
                assert!(matches!(c.send(&t, 0), Err(CommError::InvalidPeer { .. })));
            }
            g.destroy();
        }
    });
    assert!(r.is_ok(), "an adag-cuda entry point panicked");
}
