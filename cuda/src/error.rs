//! The error type of the crate.
use adag::comm::{CommError, CommOp};
use adag::tensor::TensorError;
use std::fmt;

/// A CUDA library that this crate opens at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Library {
    /// The CUDA driver, `libcuda.so` / `libcuda.so.1`.
    Cuda,
    /// NCCL, `libnccl.so` (cudarc's name) / `libnccl.so.2` (the runtime packages' name).
    Nccl,
}

impl fmt::Display for Library {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Library::Cuda => f.write_str("the CUDA driver (libcuda)"),
            Library::Nccl => f.write_str("NCCL (libnccl)"),
        }
    }
}

/// What went wrong in this crate.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CudaError {
    /// A library could not be opened: CUDA (or NCCL) is not available on this machine.
    #[error("{library} is not available (CUDA is not usable here): {detail}; {hint}")]
    NotAvailable {
        /// The library.
        library: Library,
        /// What was tried and what the loader said.
        detail: String,
        /// What to do.
        hint: String,
    },
    /// A device ordinal beyond the devices that this process sees.
    #[error(
        "CUDA device {ordinal} does not exist: this process sees {count} device(s); pass an ordinal in 0..{count} (CUDA_VISIBLE_DEVICES renumbers them)"
    )]
    NoSuchDevice {
        /// The ordinal asked for.
        ordinal: u32,
        /// The devices visible.
        count: usize,
    },
    /// A CUDA driver call failed.
    #[error("CUDA driver call {call} failed: {message}")]
    Driver {
        /// The call (and its context).
        call: String,
        /// The driver's error.
        message: String,
    },
    /// An NCCL call failed.
    #[error("NCCL call {call} failed: {message}")]
    Nccl {
        /// The call (and its context).
        call: String,
        /// NCCL's error string and last error message.
        message: String,
    },
    /// cudarc panicked (a missing symbol in an older library, for example); caught here.
    #[error(
        "cudarc panicked in {call}: {message}; the loaded CUDA driver or NCCL library may be older than what the bindings expect (use a newer NCCL, or build adag-cuda with the cuda-XXXXX feature of the installed driver)"
    )]
    Panicked {
        /// The call.
        call: String,
        /// The panic's message.
        message: String,
    },
    /// A tensor error (shape, dtype, size).
    #[error(transparent)]
    Tensor(#[from] TensorError),
    /// A tensor on another device than the one asked for (a CPU tensor given to NCCL...).
    #[error(
        "the tensor lives on {found} but {expected} was needed; copy it there first (adag_cuda::to_device / adag_cuda::to_host)"
    )]
    WrongDevice {
        /// Where the tensor lives.
        found: adag::tensor::Device,
        /// Where it had to be.
        expected: adag::tensor::Device,
    },
    /// A device tensor whose buffer was not made by this crate.
    #[error(
        "the tensor on {device} holds a device buffer that adag-cuda did not make ({type_hint}); only CudaBuffer tensors can be copied or communicated"
    )]
    ForeignBuffer {
        /// The tensor's device.
        device: adag::tensor::Device,
        /// The buffer's Debug output, shortened.
        type_hint: String,
    },
}

impl CudaError {
    /// Whether this is [`CudaError::NotAvailable`]: the machine has no CUDA (or no NCCL).
    pub fn is_not_available(&self) -> bool {
        matches!(self, CudaError::NotAvailable { .. })
    }

    /// This error as a [`CommError`] of an operation of a communicator group.
    ///
    /// A missing library is [`CommError::Unsupported`] (the message says why and what to do),
    /// a tensor error [`CommError::Tensor`], and a failed CUDA or NCCL call
    /// [`CommError::Io`].
    pub fn into_comm(self, group: &str, rank: usize, op: CommOp) -> CommError {
        match self {
            CudaError::NotAvailable { .. } | CudaError::WrongDevice { .. } => {
                CommError::Unsupported {
                    transport: crate::TRANSPORT.to_string(),
                    op,
                    reason: self.to_string(),
                }
            }
            CudaError::Tensor(source) => CommError::Tensor {
                group: group.to_string(),
                rank,
                op,
                source,
            },
            CudaError::NoSuchDevice { .. } => CommError::Config {
                message: format!("rank {rank} of communicator group {group}: {self}"),
            },
            other => CommError::Io {
                group: group.to_string(),
                context: format!("rank {rank}: {op}"),
                message: other.to_string(),
            },
        }
    }
}

/// Runs cudarc code, turning a panic into [`CudaError::Panicked`].
pub(crate) fn guard<T>(
    call: &str,
    f: impl FnOnce() -> Result<T, CudaError>,
) -> Result<T, CudaError> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => {
            let message = if let Some(s) = payload.downcast_ref::<&str>() {
                (*s).to_string()
            } else if let Some(s) = payload.downcast_ref::<String>() {
                s.clone()
            } else {
                "a panic without a message".to_string()
            };
            Err(CudaError::Panicked {
                call: call.to_string(),
                message,
            })
        }
    }
}

/// A driver error as a [`CudaError::Driver`].
pub(crate) fn driver_err(call: &str) -> impl FnOnce(cudarc::driver::DriverError) -> CudaError + '_ {
    move |e| CudaError::Driver {
        call: call.to_string(),
        message: e.to_string(),
    }
}
