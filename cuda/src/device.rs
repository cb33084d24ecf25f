//! CUDA devices, the device buffer of a CUDA tensor, and copies between host and device.
use crate::error::{CudaError, driver_err, guard};
use crate::libs::check_cuda;
use adag::tensor::{DType, Device, DeviceBuffer, Tensor};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use std::any::Any;
use std::fmt;
use std::sync::{Arc, Mutex};

/// A device's context and the stream that host copies run on.
pub(crate) struct Gpu {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) copy_stream: Arc<CudaStream>,
}

static GPUS: Mutex<Vec<Option<Arc<Gpu>>>> = Mutex::new(Vec::new());

/// The number of CUDA devices this process sees, or [`CudaError::NotAvailable`] without the
/// driver library.
pub fn device_count() -> Result<usize, CudaError> {
    check_cuda()?;
    guard("cuDeviceGetCount", || {
        CudaContext::device_count()
            .map(|n| n.max(0) as usize)
            .map_err(driver_err("cuDeviceGetCount"))
    })
}

/// The CUDA driver's version as (major, minor), from `cuDriverGetVersion`.
pub fn driver_version() -> Result<(u32, u32), CudaError> {
    check_cuda()?;
    guard("cuDriverGetVersion", || {
        let mut v: std::ffi::c_int = 0;
        // SAFETY: writes one int.
        unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) }
            .result()
            .map_err(driver_err("cuDriverGetVersion"))?;
        let v = v.max(0) as u32;
        Ok((v / 1000, (v % 1000) / 10))
    })
}

/// The device `ordinal`'s context and copy stream, made once per process.
pub(crate) fn gpu(ordinal: u32) -> Result<Arc<Gpu>, CudaError> {
    check_cuda()?;
    let mut gpus = GPUS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(Some(g)) = gpus.get(ordinal as usize) {
        return Ok(g.clone());
    }
    let count = device_count()?;
    if ordinal as usize >= count {
        return Err(CudaError::NoSuchDevice { ordinal, count });
    }
    let g = guard("cuDevicePrimaryCtxRetain", || {
        let ctx =
            CudaContext::new(ordinal as usize).map_err(driver_err("cuDevicePrimaryCtxRetain"))?;
        let copy_stream = ctx.new_stream().map_err(driver_err("cuStreamCreate"))?;
        Ok(Arc::new(Gpu { ctx, copy_stream }))
    })?;
    if gpus.len() <= ordinal as usize {
        gpus.resize(ordinal as usize + 1, None);
    }
    gpus[ordinal as usize] = Some(g.clone());
    Ok(g)
}

/// The (primary) context of device `ordinal`, shared by everything in this process.
pub fn context(ordinal: u32) -> Result<Arc<CudaContext>, CudaError> {
    gpu(ordinal).map(|g| g.ctx.clone())
}

/// The storage of a CUDA tensor: device memory (a cudarc `CudaSlice<u8>`) on one device.
///
/// cudarc tracks the streams that read and write the slice with events, so a buffer made on
/// one stream (a copy, a communicator's stream) can be used on another and freed safely.
pub struct CudaBuffer {
    slice: CudaSlice<u8>,
    ordinal: u32,
    /// The bytes of the tensor: the whole slice, except for an empty tensor, whose slice
    /// holds one byte (CUDA does not allocate zero bytes).
    nbytes: usize,
}

impl CudaBuffer {
    /// Wraps device memory.
    pub fn new(slice: CudaSlice<u8>) -> CudaBuffer {
        let ordinal = slice.ordinal() as u32;
        let nbytes = slice.len();
        CudaBuffer {
            slice,
            ordinal,
            nbytes,
        }
    }

    /// The device memory: at least [`DeviceBuffer::nbytes`] bytes (one byte for an empty
    /// tensor).
    pub fn slice(&self) -> &CudaSlice<u8> {
        &self.slice
    }

    /// The device memory, owned.
    pub fn into_slice(self) -> CudaSlice<u8> {
        self.slice
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }
}

impl fmt::Debug for CudaBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaBuffer")
            .field("device", &Device::Cuda(self.ordinal))
            .field("nbytes", &self.nbytes)
            .finish()
    }
}

impl DeviceBuffer for CudaBuffer {
    fn device(&self) -> Device {
        Device::Cuda(self.ordinal)
    }
    fn nbytes(&self) -> usize {
        self.nbytes
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The [`CudaBuffer`] of a CUDA tensor made by this crate; `None` for a CPU tensor or another
/// crate's device buffer.
pub fn cuda_buffer(tensor: &Tensor) -> Option<&CudaBuffer> {
    tensor
        .device_buffer()?
        .as_any()
        .downcast_ref::<CudaBuffer>()
}

/// The buffer of a device tensor, or the reason there is none.
pub(crate) fn require_buffer(tensor: &Tensor, expected: Device) -> Result<&CudaBuffer, CudaError> {
    match tensor.device_buffer() {
        None => Err(CudaError::WrongDevice {
            found: tensor.device(),
            expected,
        }),
        Some(b) => {
            b.as_any()
                .downcast_ref::<CudaBuffer>()
                .ok_or_else(|| CudaError::ForeignBuffer {
                    device: b.device(),
                    type_hint: format!("{b:?}").chars().take(80).collect(),
                })
        }
    }
}

/// A tensor over device memory: `slice` must hold exactly the bytes of `dtype` × `shape`.
pub fn tensor_from_slice(
    slice: CudaSlice<u8>,
    dtype: DType,
    shape: impl Into<Vec<usize>>,
) -> Result<Tensor, CudaError> {
    Ok(Tensor::from_device_buffer(
        dtype,
        shape,
        Arc::new(CudaBuffer::new(slice)),
    )?)
}

/// A tensor over memory from [`alloc`] of `nbytes` (one byte more for an empty tensor).
pub(crate) fn tensor_from_alloc(
    slice: CudaSlice<u8>,
    dtype: DType,
    shape: impl Into<Vec<usize>>,
) -> Result<Tensor, CudaError> {
    let shape = shape.into();
    let mut buf = CudaBuffer::new(slice);
    if shape.iter().product::<usize>() == 0 {
        buf.nbytes = 0;
    }
    Ok(Tensor::from_device_buffer(dtype, shape, Arc::new(buf))?)
}

/// Allocates `nbytes` of device memory on `stream` (uninitialized: the caller overwrites it),
/// or one byte for zero (CUDA does not allocate zero bytes).
pub(crate) fn alloc(stream: &Arc<CudaStream>, nbytes: usize) -> Result<CudaSlice<u8>, CudaError> {
    // SAFETY: every caller overwrites the first `nbytes` before they are read (a copy or an
    // NCCL operation that writes every byte); the extra byte of an empty buffer is never read.
    unsafe { stream.alloc::<u8>(nbytes.max(1)) }.map_err(driver_err("cuMemAllocAsync"))
}

/// A copy of `tensor` on CUDA device `ordinal`.
///
/// A tensor already on that device is returned as is (O(1), shared); a CPU tensor is copied
/// up; a tensor on another CUDA device goes through host memory. Returns when the copy is done.
///
/// ```no_run
/// # use adag::tensor::Tensor;
/// let t = Tensor::from(vec![1.0f32, 2.0, 3.0]);
/// let d = adag_cuda::to_device(&t, 0)?;
/// assert_eq!(d.device(), adag::tensor::Device::Cuda(0));
/// assert_eq!(adag_cuda::to_host(&d)?, t);
/// # Ok::<(), adag_cuda::CudaError>(())
/// ```
pub fn to_device(tensor: &Tensor, ordinal: u32) -> Result<Tensor, CudaError> {
    match tensor.device() {
        Device::Cuda(o) if o == ordinal => {
            require_buffer(tensor, Device::Cuda(ordinal))?;
            return Ok(tensor.clone());
        }
        Device::Cuda(_) => return to_device(&to_host(tensor)?, ordinal),
        Device::Cpu => {}
    }
    let bytes = tensor.as_bytes()?;
    let g = gpu(ordinal)?;
    let slice = guard("cuMemcpyHtoDAsync", || {
        let stream = &g.copy_stream;
        let mut slice = alloc(stream, bytes.len())?;
        if !bytes.is_empty() {
            stream
                .memcpy_htod(bytes, &mut slice)
                .map_err(driver_err("cuMemcpyHtoDAsync"))?;
        }
        // The host bytes may be freed when this returns.
        stream
            .synchronize()
            .map_err(driver_err("cuStreamSynchronize"))?;
        Ok(slice)
    })?;
    tensor_from_alloc(slice, tensor.dtype(), tensor.shape().to_vec())
}

/// A CPU copy of `tensor` (a CPU tensor is returned as is). Returns when the copy is done;
/// it waits for the operations that write the tensor (a communicator's) to finish first.
pub fn to_host(tensor: &Tensor) -> Result<Tensor, CudaError> {
    if tensor.is_cpu() {
        return Ok(tensor.clone());
    }
    let buf = require_buffer(tensor, tensor.device())?;
    let g = gpu(buf.ordinal)?;
    let mut result = Ok(());
    let out = Tensor::from_fill(tensor.dtype(), tensor.shape().to_vec(), |out| {
        if out.is_empty() {
            return;
        }
        result = guard("cuMemcpyDtoHAsync", || {
            let stream = &g.copy_stream;
            stream
                .memcpy_dtoh(&buf.slice.slice(..out.len()), out)
                .map_err(driver_err("cuMemcpyDtoHAsync"))?;
            stream
                .synchronize()
                .map_err(driver_err("cuStreamSynchronize"))
        });
    });
    result?;
    Ok(out?)
}
