//! CUDA tensors and an NCCL communicator for [`adag`].
//!
//! - [`CudaBuffer`] is the [`adag::tensor::DeviceBuffer`] of a CUDA tensor: a cudarc
//!   `CudaSlice<u8>` and its device ordinal. [`to_device`] and [`to_host`] copy tensors
//!   between host memory and a GPU.
//! - [`NcclCommunicator`] implements [`adag::Communicator`] over NCCL (`transport_name() ==
//!   "nccl"`); an [`NcclGroup`] makes the NCCL unique id in the driver and hands out ranks, in
//!   this process or, through a [`adag::comm::GroupTicket`], in worker processes;
//!   [`NcclFactory`] makes groups for `default_communicator = Create`. Call [`register`] in
//!   every process (driver and workers) before making or opening NCCL groups.
//!
//! # Without a GPU
//!
//! The crate never links against CUDA: cudarc opens `libcuda` and `libnccl` at run time
//! (its `dynamic-loading` feature). cudarc *panics* when a library cannot be opened, so every
//! entry point of this crate first checks that the library opens ([`check_cuda`],
//! [`check_nccl`]) and runs cudarc under `catch_unwind` as a second line of defence. On a
//! machine without the libraries every constructor returns [`CudaError::NotAvailable`] (or,
//! through the communicator traits, [`adag::CommError::Unsupported`] carrying that message),
//! never a panic.
//!
//! Setting the environment variable `ADAG_CUDA_DISABLE=1` makes this crate behave as if the
//! libraries were absent (useful to test the fallback path on a GPU machine).
//!
//! # How the libraries are found
//!
//! cudarc (0.19) tries the names of [`cudarc::get_lib_name_candidates`]: for the driver
//! `libcuda.so`, `libcuda.so.1`, ...; for NCCL `libnccl.so`, `libnccl.so.<CUDA major>`,
//! `libnccl.so.12`, `libnccl.so.11`, ..., `libnccl.so.1` — but **not** `libnccl.so.2`, the
//! only name that the NCCL runtime packages (`libnccl2`, the `nvidia-nccl-cu12` pip wheel)
//! install. Where only `libnccl.so.2` exists, [`check_nccl`] finds it and says so in its
//! error; put a symlink named `libnccl.so` to it in a directory on `LD_LIBRARY_PATH` (the
//! loader reads `LD_LIBRARY_PATH` when the process starts, so set it before). The GPU script
//! `scripts/gpu/run.sh` does this.
//!
//! ```
//! // On any machine: either CUDA works, or a typed error says why not.
//! match adag_cuda::device_count() {
//!     Ok(n) => println!("{n} CUDA device(s)"),
//!     Err(e) => assert!(e.is_not_available() || matches!(e, adag_cuda::CudaError::Driver { .. })),
//! }
//! ```
#![warn(missing_docs)]

mod device;
mod error;
mod libs;
pub mod nccl;

pub use cudarc;
pub use device::{
    CudaBuffer, context, cuda_buffer, device_count, driver_version, tensor_from_slice, to_device,
    to_host,
};
pub use error::{CudaError, Library};
pub use libs::{check_cuda, check_nccl, loaded_library};
pub use nccl::{
    NcclCommunicator, NcclFactory, NcclGroup, NcclOptions, TRANSPORT, nccl_version, register,
};
