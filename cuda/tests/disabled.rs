//! `ADAG_CUDA_DISABLE=1` makes adag-cuda act as if CUDA were absent, on any machine: this
//! exercises the typed "not available" path on GPU machines too. One test in its own binary,
//! because it sets an environment variable.
use adag::comm::CommError;
use adag::tensor::Tensor;
use adag_cuda::{CudaError, Library, NcclGroup};

#[test]
fn disabled_cuda_is_not_available_everywhere() {
    // SAFETY: the only test of this binary; no other thread reads the environment.
    unsafe { std::env::set_var("ADAG_CUDA_DISABLE", "1") };
    let t = Tensor::from(vec![1.0f32; 4]);
    for (what, r) in [
        ("check_cuda", adag_cuda::check_cuda().map(|_| ())),
        ("check_nccl", adag_cuda::check_nccl().map(|_| ())),
        ("device_count", adag_cuda::device_count().map(|_| ())),
        ("driver_version", adag_cuda::driver_version().map(|_| ())),
        ("context", adag_cuda::context(0).map(|_| ())),
        ("to_device", adag_cuda::to_device(&t, 0).map(|_| ())),
        ("nccl_version", adag_cuda::nccl_version().map(|_| ())),
    ] {
        match r {
            Err(CudaError::NotAvailable {
                library, detail, ..
            }) => {
                assert_eq!(library, Library::Cuda, "{what}");
                assert!(detail.contains("ADAG_CUDA_DISABLE"), "{what}: {detail}");
            }
            other => panic!("{what}: {other:?}"),
        }
    }
    match NcclGroup::create(2, "disabled") {
        Err(CommError::Unsupported { reason, .. }) => {
            assert!(reason.contains("not available"), "{reason}")
        }
        other => panic!("NcclGroup::create: {other:?}"),
    }
    // SAFETY: as above.
    unsafe { std::env::remove_var("ADAG_CUDA_DISABLE") };
}
