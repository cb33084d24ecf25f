//! Tensors: a dtype, a shape and the bytes of the elements, on the CPU or on a device.
//!
//! A [`Tensor`] is the value that communicators move ([`crate::comm::Communicator`]) and that
//! graph edges annotated as tensor transports carry. Its CPU storage is a [`bytes::Bytes`]:
//! cloning a tensor is O(1) (a reference count), slicing along the first dimension is O(1),
//! and a buffer read out of shared memory can later be wrapped without a copy
//! ([`Tensor::from_bytes`]). A tensor on a device (CUDA) holds an opaque [`DeviceBuffer`]
//! provided by the device crate; its data cannot be read on the CPU, and every CPU accessor
//! returns [`TensorError::NotOnCpu`] for it instead of panicking.
//!
//! The storage is always aligned for its element type: a buffer that is not (for example bytes
//! at an odd offset of a message) is copied once into an aligned allocation when the tensor is
//! made, so that [`Tensor::as_slice`] never fails or copies because of alignment.
//!
//! Serialization ([`serde`]) writes the dtype, the shape and the data as one byte string, so
//! postcard copies the data once with `memcpy` and never element by element.
//!
//! ```
//! use adag::tensor::{DType, Tensor};
//!
//! let t = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], [2, 3])?;
//! assert_eq!(t.dtype(), DType::F32);
//! assert_eq!(t.shape(), &[2, 3]);
//! assert_eq!(t.numel(), 6);
//! assert_eq!(t.nbytes(), 24);
//! assert_eq!(t.as_slice::<f32>()?, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
//! // Asking for the wrong element type is a typed error, not a panic.
//! assert!(t.as_slice::<i32>().is_err());
//! # Ok::<(), adag::tensor::TensorError>(())
//! ```
use crate::buffer::Buffer;
use bytes::Bytes;
use half::{bf16, f16};
use serde::de::{self, Deserializer};
use serde::ser::{self, SerializeStruct, Serializer};
use serde::{Deserialize, Serialize};
use std::any::Any;
use std::fmt;
use std::sync::Arc;
use zerocopy::{FromBytes, IntoBytes};

/// The element type of a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum DType {
    /// IEEE 754 half precision ([`half::f16`]).
    F16,
    /// bfloat16 ([`half::bf16`]).
    BF16,
    /// `f32`.
    F32,
    /// `f64`.
    F64,
    /// `i8`.
    I8,
    /// `i16`.
    I16,
    /// `i32`.
    I32,
    /// `i64`.
    I64,
    /// `u8`.
    U8,
    /// `bool`, one byte per element holding 0 or 1.
    Bool,
}

impl DType {
    /// Every dtype, in declaration order.
    pub const ALL: [DType; 10] = [
        DType::F16,
        DType::BF16,
        DType::F32,
        DType::F64,
        DType::I8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::U8,
        DType::Bool,
    ];

    /// The size of one element in bytes (also its alignment).
    ///
    /// ```
    /// # use adag::tensor::DType;
    /// assert_eq!(DType::BF16.size(), 2);
    /// assert_eq!(DType::I64.size(), 8);
    /// ```
    pub const fn size(self) -> usize {
        match self {
            DType::I8 | DType::U8 | DType::Bool => 1,
            DType::F16 | DType::BF16 | DType::I16 => 2,
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
        }
    }

    /// The Rust name of the element type (`"f32"`, `"bf16"`, `"bool"`...).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::I8 => "i8",
            DType::I16 => "i16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U8 => "u8",
            DType::Bool => "bool",
        }
    }

    /// Whether the dtype is a floating-point type.
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F16 | DType::BF16 | DType::F32 | DType::F64)
    }

    /// A stable small number for the dtype, used in binary headers (shared memory).
    pub(crate) const fn code(self) -> u32 {
        match self {
            DType::F16 => 1,
            DType::BF16 => 2,
            DType::F32 => 3,
            DType::F64 => 4,
            DType::I8 => 5,
            DType::I16 => 6,
            DType::I32 => 7,
            DType::I64 => 8,
            DType::U8 => 9,
            DType::Bool => 10,
        }
    }

    /// The dtype of a [`DType::code`], if any.
    pub(crate) fn from_code(code: u32) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.code() == code)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Where a tensor's data lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Device {
    /// Host memory, readable with [`Tensor::as_slice`].
    Cpu,
    /// The CUDA device of this ordinal; the data is only reachable through the device crate.
    Cuda(u32),
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

mod sealed {
    pub trait Sealed {}
}

/// An element type of a tensor: `f16`, `bf16`, `f32`, `f64`, `i8`, `i16`, `i32`, `i64`, `u8`,
/// `bool`. Sealed: the set matches [`DType`].
pub trait Element: sealed::Sealed + Copy + Send + Sync + PartialEq + fmt::Debug + 'static {
    /// The dtype of this element type.
    const DTYPE: DType;

    #[doc(hidden)]
    fn slice_as_bytes(s: &[Self]) -> &[u8];

    /// `None` if the bytes are misaligned, of a length that is not a multiple of the element
    /// size, or (for `bool`) hold a byte other than 0 or 1.
    #[doc(hidden)]
    fn slice_from_bytes(b: &[u8]) -> Option<&[Self]>;
}

macro_rules! pod_element {
    ($($t:ty => $d:ident),* $(,)?) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = DType::$d;
            fn slice_as_bytes(s: &[Self]) -> &[u8] {
                s.as_bytes()
            }
            fn slice_from_bytes(b: &[u8]) -> Option<&[Self]> {
                <[Self]>::ref_from_bytes(b).ok()
            }
        }
    )*};
}

pod_element!(
    f16 => F16, bf16 => BF16, f32 => F32, f64 => F64,
    i8 => I8, i16 => I16, i32 => I32, i64 => I64, u8 => U8,
);

impl sealed::Sealed for bool {}
impl Element for bool {
    const DTYPE: DType = DType::Bool;
    fn slice_as_bytes(s: &[Self]) -> &[u8] {
        s.as_bytes()
    }
    fn slice_from_bytes(b: &[u8]) -> Option<&[Self]> {
        use zerocopy::TryFromBytes;
        <[bool]>::try_ref_from_bytes(b).ok()
    }
}

/// The storage of a tensor that lives on a device (a CUDA allocation), provided by the device
/// crate. adag only moves it around; the device crate downcasts it through [`Self::as_any`].
pub trait DeviceBuffer: Send + Sync + fmt::Debug + 'static {
    /// The device that holds the buffer.
    fn device(&self) -> Device;
    /// The size of the buffer in bytes.
    fn nbytes(&self) -> usize;
    /// For downcasting to the device crate's own type.
    fn as_any(&self) -> &dyn Any;
}

/// What went wrong with a tensor operation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TensorError {
    /// The tensor's dtype is not the one asked for.
    #[error(
        "the tensor has dtype {actual} but {expected} was asked for; read it as {actual} (as_slice::<{actual}>()) or make a tensor of dtype {expected}"
    )]
    DTypeMismatch {
        /// The dtype asked for.
        expected: DType,
        /// The tensor's dtype.
        actual: DType,
    },
    /// The number of elements given does not match the shape.
    #[error("shape {shape:?} holds {numel} elements but {len} were given")]
    ShapeMismatch {
        /// The shape asked for.
        shape: Vec<usize>,
        /// The number of elements of that shape.
        numel: usize,
        /// The number of elements given.
        len: usize,
    },
    /// The byte buffer does not have the size the dtype and shape need.
    #[error(
        "a {dtype} tensor of shape {shape:?} needs {expected} bytes but the buffer holds {actual}"
    )]
    ByteLength {
        /// The dtype.
        dtype: DType,
        /// The shape.
        shape: Vec<usize>,
        /// The bytes needed.
        expected: usize,
        /// The bytes given.
        actual: usize,
    },
    /// The number of elements or bytes of the shape does not fit in `usize`.
    #[error("the size of a {dtype} tensor of shape {shape:?} overflows usize")]
    ShapeOverflow {
        /// The dtype.
        dtype: DType,
        /// The shape.
        shape: Vec<usize>,
    },
    /// The tensor's data is on a device and cannot be read on the CPU.
    #[error(
        "the tensor's data lives on {device} and cannot be read on the CPU; copy it to the CPU with the device crate first, or move it with that device's communicator"
    )]
    NotOnCpu {
        /// Where the data lives.
        device: Device,
    },
    /// A byte of a bool tensor is not 0 or 1.
    #[error("byte {index} of a bool tensor is {value}; bool elements must be 0 or 1")]
    InvalidBool {
        /// The index of the first bad element.
        index: usize,
        /// Its byte.
        value: u8,
    },
    /// A reshape to a shape of another number of elements.
    #[error("cannot reshape a tensor of shape {from:?} ({numel} elements) to shape {to:?}")]
    Reshape {
        /// The tensor's shape.
        from: Vec<usize>,
        /// The number of elements.
        numel: usize,
        /// The shape asked for.
        to: Vec<usize>,
    },
    /// An operation along dimension 0 is out of bounds or needs at least one dimension.
    #[error("{op}: {message}")]
    Dim0 {
        /// The operation (`narrow`, `cat`).
        op: &'static str,
        /// What is wrong.
        message: String,
    },
    /// A device buffer's size does not match the dtype and shape.
    #[error(
        "the device buffer holds {actual} bytes but a {dtype} tensor of shape {shape:?} needs {expected}"
    )]
    DeviceBufferSize {
        /// The dtype.
        dtype: DType,
        /// The shape.
        shape: Vec<usize>,
        /// The bytes needed.
        expected: usize,
        /// The bytes of the buffer.
        actual: usize,
    },
}

/// A heap buffer of bytes aligned to 8 (the largest element alignment), handed to
/// [`Bytes::from_owner`] so that tensors made from it are aligned for every dtype.
pub(crate) struct AlignedBuf {
    words: Vec<u64>,
    len: usize,
}

impl AlignedBuf {
    /// `len` zero bytes (calloc'd: large buffers cost no page touching until written).
    pub(crate) fn zeroed(len: usize) -> Self {
        AlignedBuf {
            words: vec![0u64; len.div_ceil(8)],
            len,
        }
    }

    pub(crate) fn as_mut_bytes(&mut self) -> &mut [u8] {
        &mut self.words.as_mut_bytes()[..self.len]
    }

    pub(crate) fn into_bytes(self) -> Bytes {
        Bytes::from_owner(self)
    }
}

impl AsRef<[u8]> for AlignedBuf {
    fn as_ref(&self) -> &[u8] {
        &self.words.as_bytes()[..self.len]
    }
}

/// A `Vec<T>` seen as bytes, so `Tensor::from_vec` wraps it without a copy.
struct VecOwner<T: Element>(Vec<T>);

impl<T: Element> AsRef<[u8]> for VecOwner<T> {
    fn as_ref(&self) -> &[u8] {
        T::slice_as_bytes(&self.0)
    }
}

#[derive(Clone)]
enum Storage {
    Cpu(Bytes),
    Device(Arc<dyn DeviceBuffer>),
}

/// An n-dimensional array of one [`DType`], stored contiguously in row-major order.
///
/// Cloning is O(1): the data is shared, never copied. Tensors are immutable; operations that
/// produce data (`zeros`, `from_fill`, collectives) make new tensors.
#[derive(Clone)]
pub struct Tensor {
    dtype: DType,
    shape: Vec<usize>,
    storage: Storage,
}

fn checked_nbytes(dtype: DType, shape: &[usize]) -> Result<(usize, usize), TensorError> {
    let overflow = || TensorError::ShapeOverflow {
        dtype,
        shape: shape.to_vec(),
    };
    let numel = shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(overflow)?;
    let nbytes = numel.checked_mul(dtype.size()).ok_or_else(overflow)?;
    Ok((numel, nbytes))
}

fn validate_bool(bytes: &[u8]) -> Result<(), TensorError> {
    match bytes.iter().position(|&b| b > 1) {
        Some(index) => Err(TensorError::InvalidBool {
            index,
            value: bytes[index],
        }),
        None => Ok(()),
    }
}

impl Tensor {
    /// A tensor of `shape` that takes ownership of `data` without copying it.
    ///
    /// ```
    /// # use adag::tensor::Tensor;
    /// let t = Tensor::from_vec(vec![1i32, 2, 3, 4], [2, 2])?;
    /// assert_eq!(t.to_vec::<i32>()?, vec![1, 2, 3, 4]);
    /// assert!(Tensor::from_vec(vec![1i32, 2, 3], [2, 2]).is_err());
    /// # Ok::<(), adag::tensor::TensorError>(())
    /// ```
    pub fn from_vec<T: Element>(
        data: Vec<T>,
        shape: impl Into<Vec<usize>>,
    ) -> Result<Self, TensorError> {
        let shape = shape.into();
        let (numel, _) = checked_nbytes(T::DTYPE, &shape)?;
        if numel != data.len() {
            return Err(TensorError::ShapeMismatch {
                shape,
                numel,
                len: data.len(),
            });
        }
        Ok(Tensor {
            dtype: T::DTYPE,
            shape,
            storage: Storage::Cpu(Bytes::from_owner(VecOwner(data))),
        })
    }

    /// A tensor of `shape` holding a copy of `data`.
    pub fn from_slice<T: Element>(
        data: &[T],
        shape: impl Into<Vec<usize>>,
    ) -> Result<Self, TensorError> {
        let shape = shape.into();
        let (numel, nbytes) = checked_nbytes(T::DTYPE, &shape)?;
        if numel != data.len() {
            return Err(TensorError::ShapeMismatch {
                shape,
                numel,
                len: data.len(),
            });
        }
        let mut buf = AlignedBuf::zeroed(nbytes);
        buf.as_mut_bytes().copy_from_slice(T::slice_as_bytes(data));
        Ok(Tensor {
            dtype: T::DTYPE,
            shape,
            storage: Storage::Cpu(buf.into_bytes()),
        })
    }

    /// A 0-dimensional tensor holding one value.
    ///
    /// ```
    /// # use adag::tensor::Tensor;
    /// let t = Tensor::scalar(2.5f64);
    /// assert_eq!(t.shape(), &[] as &[usize]);
    /// assert_eq!(t.numel(), 1);
    /// ```
    pub fn scalar<T: Element>(value: T) -> Self {
        Tensor {
            dtype: T::DTYPE,
            shape: Vec::new(),
            storage: Storage::Cpu(Bytes::from_owner(VecOwner(vec![value]))),
        }
    }

    /// A CPU tensor of zeros (`false` for bool).
    ///
    /// # Panics
    /// If the size of the shape overflows `usize` (as `vec!` does).
    ///
    /// ```
    /// # use adag::tensor::{DType, Tensor};
    /// let t = Tensor::zeros([3, 2], DType::BF16);
    /// assert_eq!(t.nbytes(), 12);
    /// assert!(t.to_vec::<half::bf16>()?.iter().all(|x| x.to_f32() == 0.0));
    /// # Ok::<(), adag::tensor::TensorError>(())
    /// ```
    pub fn zeros(shape: impl Into<Vec<usize>>, dtype: DType) -> Self {
        let shape = shape.into();
        let (_, nbytes) =
            checked_nbytes(dtype, &shape).unwrap_or_else(|e| panic!("Tensor::zeros: {e}"));
        Tensor {
            dtype,
            shape,
            storage: Storage::Cpu(AlignedBuf::zeroed(nbytes).into_bytes()),
        }
    }

    /// A CPU tensor whose raw bytes (row-major, native endian) are written by `fill` into a
    /// zeroed, aligned buffer of [`Tensor::nbytes`] bytes. Bool bytes must be 0 or 1.
    ///
    /// ```
    /// # use adag::tensor::{DType, Tensor};
    /// let t = Tensor::from_fill(DType::U8, [4], |b| b.copy_from_slice(&[1, 2, 3, 4]))?;
    /// assert_eq!(t.as_slice::<u8>()?, &[1, 2, 3, 4]);
    /// # Ok::<(), adag::tensor::TensorError>(())
    /// ```
    pub fn from_fill(
        dtype: DType,
        shape: impl Into<Vec<usize>>,
        fill: impl FnOnce(&mut [u8]),
    ) -> Result<Self, TensorError> {
        let shape = shape.into();
        let (_, nbytes) = checked_nbytes(dtype, &shape)?;
        let mut buf = AlignedBuf::zeroed(nbytes);
        fill(buf.as_mut_bytes());
        Self::from_aligned(dtype, shape, buf)
    }

    /// Wraps an aligned buffer of the right size (checked by the caller or here).
    pub(crate) fn from_aligned(
        dtype: DType,
        shape: Vec<usize>,
        buf: AlignedBuf,
    ) -> Result<Self, TensorError> {
        let (_, nbytes) = checked_nbytes(dtype, &shape)?;
        if buf.len != nbytes {
            return Err(TensorError::ByteLength {
                dtype,
                shape,
                expected: nbytes,
                actual: buf.len,
            });
        }
        if dtype == DType::Bool {
            validate_bool(buf.as_ref())?;
        }
        Ok(Tensor {
            dtype,
            shape,
            storage: Storage::Cpu(buf.into_bytes()),
        })
    }

    /// A CPU tensor over `data`, the raw bytes of the elements (row-major, native endian).
    ///
    /// Zero-copy when `data` is aligned for the dtype (a `Bytes` over shared memory, a received
    /// buffer); otherwise the bytes are copied once into an aligned buffer. Checks the length,
    /// and for bool that every byte is 0 or 1.
    ///
    /// ```
    /// # use adag::tensor::{DType, Tensor};
    /// let bytes = bytes::Bytes::from(1.5f32.to_ne_bytes().repeat(3));
    /// let t = Tensor::from_bytes(DType::F32, [3], bytes)?;
    /// assert_eq!(t.as_slice::<f32>()?, &[1.5, 1.5, 1.5]);
    /// assert!(Tensor::from_bytes(DType::F32, [4], t.as_bytes()?.to_vec().into()).is_err());
    /// # Ok::<(), adag::tensor::TensorError>(())
    /// ```
    pub fn from_bytes(
        dtype: DType,
        shape: impl Into<Vec<usize>>,
        data: Bytes,
    ) -> Result<Self, TensorError> {
        let shape = shape.into();
        let (_, nbytes) = checked_nbytes(dtype, &shape)?;
        if data.len() != nbytes {
            return Err(TensorError::ByteLength {
                dtype,
                shape,
                expected: nbytes,
                actual: data.len(),
            });
        }
        if dtype == DType::Bool {
            validate_bool(&data)?;
        }
        let data = if (data.as_ptr() as usize).is_multiple_of(dtype.size()) {
            data
        } else {
            let mut buf = AlignedBuf::zeroed(nbytes);
            buf.as_mut_bytes().copy_from_slice(&data);
            buf.into_bytes()
        };
        Ok(Tensor {
            dtype,
            shape,
            storage: Storage::Cpu(data),
        })
    }

    /// A tensor whose data lives in a device buffer (made by the device crate).
    pub fn from_device_buffer(
        dtype: DType,
        shape: impl Into<Vec<usize>>,
        buffer: Arc<dyn DeviceBuffer>,
    ) -> Result<Self, TensorError> {
        let shape = shape.into();
        let (_, nbytes) = checked_nbytes(dtype, &shape)?;
        if buffer.nbytes() != nbytes {
            return Err(TensorError::DeviceBufferSize {
                dtype,
                shape,
                expected: nbytes,
                actual: buffer.nbytes(),
            });
        }
        Ok(Tensor {
            dtype,
            shape,
            storage: Storage::Device(buffer),
        })
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The size of each dimension, outermost first. Empty for a scalar.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The number of dimensions.
    pub fn ndim(&self) -> usize {
        self.shape.len()
    }

    /// The number of elements (1 for a scalar).
    pub fn numel(&self) -> usize {
        // Checked at construction.
        self.shape.iter().product()
    }

    /// The size of the data in bytes.
    pub fn nbytes(&self) -> usize {
        self.numel() * self.dtype.size()
    }

    /// Where the data lives.
    pub fn device(&self) -> Device {
        match &self.storage {
            Storage::Cpu(_) => Device::Cpu,
            Storage::Device(b) => b.device(),
        }
    }

    /// Whether the data is in host memory.
    pub fn is_cpu(&self) -> bool {
        matches!(self.storage, Storage::Cpu(_))
    }

    /// The device buffer of a device tensor; `None` for a CPU tensor.
    pub fn device_buffer(&self) -> Option<&Arc<dyn DeviceBuffer>> {
        match &self.storage {
            Storage::Cpu(_) => None,
            Storage::Device(b) => Some(b),
        }
    }

    /// The CPU storage, shared (clone it in O(1) to keep it).
    pub fn cpu_bytes(&self) -> Result<&Bytes, TensorError> {
        match &self.storage {
            Storage::Cpu(b) => Ok(b),
            Storage::Device(b) => Err(TensorError::NotOnCpu { device: b.device() }),
        }
    }

    /// The raw bytes of the elements (row-major, native endian).
    pub fn as_bytes(&self) -> Result<&[u8], TensorError> {
        self.cpu_bytes().map(|b| &b[..])
    }

    /// The elements, borrowed; a [`TensorError::DTypeMismatch`] if `T` is not the dtype.
    ///
    /// ```
    /// # use adag::tensor::{Tensor, TensorError, DType};
    /// let t = Tensor::from(vec![half::f16::from_f32(1.5); 2]);
    /// assert_eq!(t.as_slice::<half::f16>()?[1].to_f32(), 1.5);
    /// assert_eq!(
    ///     t.as_slice::<f32>().unwrap_err(),
    ///     TensorError::DTypeMismatch { expected: DType::F32, actual: DType::F16 }
    /// );
    /// # Ok::<(), TensorError>(())
    /// ```
    pub fn as_slice<T: Element>(&self) -> Result<&[T], TensorError> {
        if T::DTYPE != self.dtype {
            return Err(TensorError::DTypeMismatch {
                expected: T::DTYPE,
                actual: self.dtype,
            });
        }
        let bytes = self.as_bytes()?;
        match T::slice_from_bytes(bytes) {
            Some(s) => Ok(s),
            // Unreachable by construction (alignment and bool bytes are checked when the
            // tensor is made), but never a panic.
            None => {
                validate_bool(bytes)?;
                Err(TensorError::ByteLength {
                    dtype: self.dtype,
                    shape: self.shape.clone(),
                    expected: self.nbytes(),
                    actual: bytes.len(),
                })
            }
        }
    }

    /// The elements, copied into a `Vec`.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>, TensorError> {
        self.as_slice::<T>().map(<[T]>::to_vec)
    }

    /// The same data seen with another shape of as many elements (O(1)).
    ///
    /// ```
    /// # use adag::tensor::Tensor;
    /// let t = Tensor::from(vec![1u8, 2, 3, 4, 5, 6]).reshape([3, 2])?;
    /// assert_eq!(t.shape(), &[3, 2]);
    /// assert!(t.reshape([4]).is_err());
    /// # Ok::<(), adag::tensor::TensorError>(())
    /// ```
    pub fn reshape(&self, shape: impl Into<Vec<usize>>) -> Result<Tensor, TensorError> {
        let shape = shape.into();
        let (numel, _) = checked_nbytes(self.dtype, &shape)?;
        if numel != self.numel() {
            return Err(TensorError::Reshape {
                from: self.shape.clone(),
                numel: self.numel(),
                to: shape,
            });
        }
        Ok(Tensor {
            dtype: self.dtype,
            shape,
            storage: self.storage.clone(),
        })
    }

    /// Rows `start..start + len` along dimension 0, sharing the data (O(1), CPU only).
    ///
    /// ```
    /// # use adag::tensor::Tensor;
    /// let t = Tensor::from_vec((0..6).collect::<Vec<i64>>(), [3, 2])?;
    /// let rows = t.narrow(1, 2)?;
    /// assert_eq!(rows.shape(), &[2, 2]);
    /// assert_eq!(rows.as_slice::<i64>()?, &[2, 3, 4, 5]);
    /// # Ok::<(), adag::tensor::TensorError>(())
    /// ```
    pub fn narrow(&self, start: usize, len: usize) -> Result<Tensor, TensorError> {
        let Some(&dim0) = self.shape.first() else {
            return Err(TensorError::Dim0 {
                op: "narrow",
                message: "a 0-dimensional tensor has no dimension 0; reshape it to [1] first"
                    .into(),
            });
        };
        let end = start
            .checked_add(len)
            .filter(|&e| e <= dim0)
            .ok_or_else(|| TensorError::Dim0 {
                op: "narrow",
                message: format!(
                    "rows {start}..{start}+{len} are out of bounds for dim 0 of size {dim0}"
                ),
            })?;
        let bytes = self.cpu_bytes()?;
        let row = self.nbytes().checked_div(dim0).unwrap_or(0);
        let mut shape = self.shape.clone();
        shape[0] = len;
        Ok(Tensor {
            dtype: self.dtype,
            shape,
            storage: Storage::Cpu(bytes.slice(start * row..end * row)),
        })
    }

    /// Concatenates CPU tensors along dimension 0. All must have the same dtype and the same
    /// size in every other dimension.
    ///
    /// ```
    /// # use adag::tensor::Tensor;
    /// let a = Tensor::from_vec(vec![1.0f32, 2.0], [1, 2])?;
    /// let b = Tensor::from_vec(vec![3.0f32, 4.0, 5.0, 6.0], [2, 2])?;
    /// let c = Tensor::cat(&[a, b])?;
    /// assert_eq!(c.shape(), &[3, 2]);
    /// assert_eq!(c.as_slice::<f32>()?, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    /// # Ok::<(), adag::tensor::TensorError>(())
    /// ```
    pub fn cat(tensors: &[Tensor]) -> Result<Tensor, TensorError> {
        let Some(first) = tensors.first() else {
            return Err(TensorError::Dim0 {
                op: "cat",
                message: "no tensors to concatenate".into(),
            });
        };
        if first.ndim() == 0 {
            return Err(TensorError::Dim0 {
                op: "cat",
                message: "0-dimensional tensors have no dimension 0; reshape them to [1] first"
                    .into(),
            });
        }
        let mut dim0 = 0usize;
        for (i, t) in tensors.iter().enumerate() {
            if t.dtype != first.dtype {
                return Err(TensorError::Dim0 {
                    op: "cat",
                    message: format!(
                        "tensor {i} has dtype {} but tensor 0 has dtype {}",
                        t.dtype, first.dtype
                    ),
                });
            }
            if t.ndim() != first.ndim() || t.shape[1..] != first.shape[1..] {
                return Err(TensorError::Dim0 {
                    op: "cat",
                    message: format!(
                        "tensor {i} has shape {:?} but tensor 0 has shape {:?}; all dimensions but the first must match",
                        t.shape, first.shape
                    ),
                });
            }
            t.as_bytes()?;
            dim0 = dim0
                .checked_add(t.shape[0])
                .ok_or(TensorError::ShapeOverflow {
                    dtype: first.dtype,
                    shape: first.shape.clone(),
                })?;
        }
        let mut shape = first.shape.clone();
        shape[0] = dim0;
        Tensor::from_fill(first.dtype, shape, |out| {
            let mut at = 0;
            for t in tensors {
                let b = t.as_bytes().unwrap_or(&[]);
                out[at..at + b.len()].copy_from_slice(b);
                at += b.len();
            }
        })
    }
}

impl<T: Element> From<Vec<T>> for Tensor {
    /// A 1-dimensional tensor over the vector, without copying.
    fn from(data: Vec<T>) -> Self {
        let n = data.len();
        Tensor {
            dtype: T::DTYPE,
            shape: vec![n],
            storage: Storage::Cpu(Bytes::from_owner(VecOwner(data))),
        }
    }
}

impl<T: Element> From<&[T]> for Tensor {
    /// A 1-dimensional tensor holding a copy of the slice.
    fn from(data: &[T]) -> Self {
        let mut buf = AlignedBuf::zeroed(std::mem::size_of_val(data));
        buf.as_mut_bytes().copy_from_slice(T::slice_as_bytes(data));
        Tensor {
            dtype: T::DTYPE,
            shape: vec![data.len()],
            storage: Storage::Cpu(buf.into_bytes()),
        }
    }
}

impl PartialEq for Tensor {
    /// Same dtype, shape and elements (byte-wise, so `NaN == NaN` when the bits match). Device
    /// tensors are equal only when they share the same buffer.
    fn eq(&self, other: &Self) -> bool {
        self.dtype == other.dtype
            && self.shape == other.shape
            && match (&self.storage, &other.storage) {
                (Storage::Cpu(a), Storage::Cpu(b)) => a == b,
                (Storage::Device(a), Storage::Device(b)) => Arc::ptr_eq(a, b),
                _ => false,
            }
    }
}

fn fmt_elements<T: Element>(t: &Tensor, f: &mut fmt::Formatter<'_>) -> fmt::Result {
    const SHOWN: usize = 8;
    match t.as_slice::<T>() {
        Ok(s) if s.len() <= SHOWN => write!(f, "{s:?}"),
        Ok(s) => write!(f, "{:?} (+{} more)", &s[..SHOWN], s.len() - SHOWN),
        Err(_) => f.write_str("<unreadable>"),
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Tensor {{ dtype: {}, shape: {:?}, device: {}, data: ",
            self.dtype,
            self.shape,
            self.device()
        )?;
        if !self.is_cpu() {
            f.write_str("<on device>")?;
        } else {
            match self.dtype {
                DType::F16 => fmt_elements::<f16>(self, f)?,
                DType::BF16 => fmt_elements::<bf16>(self, f)?,
                DType::F32 => fmt_elements::<f32>(self, f)?,
                DType::F64 => fmt_elements::<f64>(self, f)?,
                DType::I8 => fmt_elements::<i8>(self, f)?,
                DType::I16 => fmt_elements::<i16>(self, f)?,
                DType::I32 => fmt_elements::<i32>(self, f)?,
                DType::I64 => fmt_elements::<i64>(self, f)?,
                DType::U8 => fmt_elements::<u8>(self, f)?,
                DType::Bool => fmt_elements::<bool>(self, f)?,
            }
        }
        f.write_str(" }")
    }
}

impl Serialize for Tensor {
    /// `{ dtype, shape, data }` with `data` one byte string (out of band, so read in place,
    /// when it crosses processes through shared memory). A device tensor is an error: copy it
    /// to the CPU or send it through its device communicator.
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        // A `Buffer` sharing the storage (a reference count, no copy) carries the bytes.
        let bytes = self.cpu_bytes().map_err(|_| {
            ser::Error::custom(crate::value::note_serialize_failure(format!(
                "a tensor on {} (dtype {}, shape {:?}) cannot be serialized: its data is not readable by the CPU, and an edge between processes carries values through shared memory. Send it through a communicator (node.with_tensor_transport(Transport::communicator()), or Transport::custom(..)), or move the tensor to the CPU in the method that returns it",
                self.device(),
                self.dtype,
                self.shape
            )))
        })?;
        let data = Buffer::from(bytes.clone());
        let mut st = serializer.serialize_struct("Tensor", 3)?;
        st.serialize_field("dtype", &self.dtype)?;
        st.serialize_field("shape", &self.shape)?;
        st.serialize_field("data", &data)?;
        st.end()
    }
}

impl<'de> Deserialize<'de> for Tensor {
    /// Zero copy when the data was read in place from shared memory (64-byte aligned there);
    /// inline data is copied to the heap, and again by `from_bytes` in the rare case that the
    /// allocation is not aligned for the dtype.
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(rename = "Tensor")]
        struct Wire {
            dtype: DType,
            shape: Vec<usize>,
            data: Buffer,
        }
        let w = Wire::deserialize(deserializer)?;
        Tensor::from_bytes(w.dtype, w.shape, w.data.into_bytes()).map_err(de::Error::custom)
    }
}

#[cfg(feature = "ndarray")]
mod ndarray_interop {
    use super::{Element, Tensor, TensorError};
    use ndarray::{Array, ArrayD, ArrayViewD, Dimension, IxDyn};

    impl<T: Element, D: Dimension> From<Array<T, D>> for Tensor {
        /// Takes the array's buffer without copying when it is in standard (row-major,
        /// contiguous) layout; otherwise copies the elements in logical order.
        fn from(a: Array<T, D>) -> Self {
            let shape = a.shape().to_vec();
            let n = a.len();
            let data = if a.is_standard_layout() {
                let (v, offset) = a.into_raw_vec_and_offset();
                let off = offset.unwrap_or(0);
                if off == 0 && v.len() == n {
                    v
                } else {
                    v[off..off + n].to_vec()
                }
            } else {
                a.iter().copied().collect()
            };
            Tensor::from_vec(data, shape).expect("an ndarray's shape matches its length")
        }
    }

    impl Tensor {
        /// The elements copied into an `ndarray::ArrayD` of the tensor's shape.
        ///
        /// ```
        /// # use adag::tensor::Tensor;
        /// let a = ndarray::ArrayD::from_shape_vec(vec![2, 2], vec![1.0f32, 2.0, 3.0, 4.0]).unwrap();
        /// let t = Tensor::from(a.clone());
        /// assert_eq!(t.to_ndarray::<f32>()?, a);
        /// # Ok::<(), adag::tensor::TensorError>(())
        /// ```
        pub fn to_ndarray<T: Element>(&self) -> Result<ArrayD<T>, TensorError> {
            let v = self.to_vec::<T>()?;
            Ok(ArrayD::from_shape_vec(IxDyn(&self.shape), v)
                .expect("a tensor's shape matches its length"))
        }

        /// A borrowed `ndarray` view of the elements (no copy).
        pub fn as_ndarray<T: Element>(&self) -> Result<ArrayViewD<'_, T>, TensorError> {
            let s = self.as_slice::<T>()?;
            Ok(ArrayViewD::from_shape(IxDyn(&self.shape), s)
                .expect("a tensor's shape matches its length"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct FakeCuda(usize);
    impl DeviceBuffer for FakeCuda {
        fn device(&self) -> Device {
            Device::Cuda(1)
        }
        fn nbytes(&self) -> usize {
            self.0
        }
        fn as_any(&self) -> &dyn Any {
            self
        }
    }

    #[test]
    fn dtypes_sizes_names_codes() {
        for d in DType::ALL {
            assert_eq!(DType::from_code(d.code()), Some(d));
            assert!(!d.name().is_empty());
        }
        assert_eq!(DType::from_code(0), None);
        assert_eq!(DType::F16.size(), std::mem::size_of::<f16>());
        assert_eq!(DType::BF16.size(), std::mem::size_of::<bf16>());
        assert_eq!(DType::Bool.size(), 1);
        assert!(DType::BF16.is_float() && !DType::I8.is_float());
        assert_eq!(Device::Cuda(3).to_string(), "cuda:3");
    }

    #[test]
    fn from_vec_is_zero_copy_and_checks_shape() {
        let v = vec![1.0f32, 2.0, 3.0, 4.0];
        let ptr = v.as_ptr() as *const u8;
        let t = Tensor::from_vec(v, [2, 2]).unwrap();
        assert_eq!(t.as_bytes().unwrap().as_ptr(), ptr);
        let c = t.clone();
        assert_eq!(c.as_bytes().unwrap().as_ptr(), ptr, "clone shares the data");
        assert_eq!(
            Tensor::from_vec(vec![1u8; 3], [2, 2]).unwrap_err(),
            TensorError::ShapeMismatch {
                shape: vec![2, 2],
                numel: 4,
                len: 3
            }
        );
        assert!(matches!(
            Tensor::from_vec(vec![0u8], [usize::MAX, 2]),
            Err(TensorError::ShapeOverflow { .. })
        ));
    }

    #[test]
    fn as_slice_dtype_mismatch_is_typed() {
        let t = Tensor::from(vec![1i32, 2, 3]);
        assert_eq!(t.as_slice::<i32>().unwrap(), &[1, 2, 3]);
        assert_eq!(
            t.as_slice::<f32>().unwrap_err(),
            TensorError::DTypeMismatch {
                expected: DType::F32,
                actual: DType::I32
            }
        );
        assert!(t.to_vec::<i64>().is_err());
        let msg = t.as_slice::<u8>().unwrap_err().to_string();
        assert!(msg.contains("i32") && msg.contains("u8"), "{msg}");
    }

    #[test]
    fn every_dtype_round_trips() {
        fn check<T: Element>(v: Vec<T>) {
            let t = Tensor::from(v.clone());
            assert_eq!(t.dtype(), T::DTYPE);
            assert_eq!(t.to_vec::<T>().unwrap(), v);
            let s = Tensor::from(&v[..]);
            assert_eq!(s, t);
            let enc = postcard::to_stdvec(&t).unwrap();
            let back: Tensor = postcard::from_bytes(&enc).unwrap();
            assert_eq!(back, t);
            assert_eq!(back.to_vec::<T>().unwrap(), v);
        }
        check(vec![
            f16::from_f32(1.5),
            f16::from_f32(-2.25),
            f16::INFINITY,
        ]);
        check(vec![bf16::from_f32(3.0), bf16::from_f32(-0.5)]);
        check(vec![1.0f32, f32::MIN, f32::MAX]);
        check(vec![1.0f64, -1e300]);
        check(vec![-128i8, 0, 127]);
        check(vec![i16::MIN, 7]);
        check(vec![i32::MIN, 7]);
        check(vec![i64::MIN, 7]);
        check(vec![0u8, 255]);
        check(vec![true, false, true]);
    }

    #[test]
    fn postcard_writes_data_as_one_byte_string() {
        let t =
            Tensor::from_vec((0..1000).map(|i| i as f32).collect::<Vec<_>>(), [10, 100]).unwrap();
        let enc = postcard::to_stdvec(&t).unwrap();
        // dtype (1) + shape (len 1 + 1 + 1) + data length varint (2) + 4000 bytes.
        assert!(enc.len() <= 4000 + 8, "encoded {} bytes", enc.len());
        let tail = &enc[enc.len() - 4000..];
        assert_eq!(tail, t.as_bytes().unwrap());
        let back: Tensor = postcard::from_bytes(&enc).unwrap();
        assert_eq!(back.shape(), &[10, 100]);
        assert_eq!(back.as_slice::<f32>().unwrap()[999], 999.0);
        // Decoded data is aligned for its dtype even though the input offset was odd.
        assert_eq!(back.as_bytes().unwrap().as_ptr() as usize % 8, 0);
    }

    #[test]
    fn deserialize_rejects_bad_payloads() {
        let t = Tensor::from(vec![1u8, 0, 1]);
        let mut enc = postcard::to_stdvec(&t).unwrap();
        // Reinterpret as bool: valid bytes.
        enc[0] = 9; // DType::Bool variant index
        let b: Tensor = postcard::from_bytes(&enc).unwrap();
        assert_eq!(b.to_vec::<bool>().unwrap(), vec![true, false, true]);
        // A byte 2 in a bool tensor.
        let bad = Tensor::from(vec![1u8, 2, 1]);
        let mut enc = postcard::to_stdvec(&bad).unwrap();
        enc[0] = 9;
        let err = postcard::from_bytes::<Tensor>(&enc).unwrap_err();
        assert!(matches!(err, postcard::Error::SerdeDeCustom), "{err:?}");
        // Wrong length for the shape (the wire as `Tensor` writes it, 8 bytes for 3 f32s).
        let wire = (DType::F32, vec![3usize], Buffer::from(vec![0u8; 8]));
        let enc = postcard::to_stdvec(&wire).unwrap();
        assert!(postcard::from_bytes::<Tensor>(&enc).is_err());
    }

    #[test]
    fn large_data_outside_a_frame_stays_inline() {
        // Out of band only inside a shared-memory frame: any other encoding carries the data.
        let t = Tensor::from_vec(vec![7i16; 20_000], [100, 200]).unwrap();
        let enc = postcard::to_stdvec(&t).unwrap();
        assert!(enc.len() > 40_000, "{} bytes", enc.len());
        let back: Tensor = postcard::from_bytes(&enc).unwrap();
        assert_eq!(back, t);
        assert_eq!(back.as_bytes().unwrap().as_ptr() as usize % 8, 0);
    }

    #[test]
    fn half_types() {
        let xs: Vec<f16> = [0.5f32, 1.0, 65504.0]
            .iter()
            .map(|&x| f16::from_f32(x))
            .collect();
        let t = Tensor::from_vec(xs.clone(), [3]).unwrap();
        assert_eq!(t.nbytes(), 6);
        assert_eq!(t.as_slice::<f16>().unwrap()[2].to_f32(), 65504.0);
        assert!(t.as_slice::<bf16>().is_err());
        let b = Tensor::from_vec(vec![bf16::from_f32(1.0); 4], [2, 2]).unwrap();
        assert!(b.as_slice::<f16>().is_err());
        assert_eq!(b.as_slice::<bf16>().unwrap()[3], bf16::ONE);
    }

    #[test]
    fn zeros_scalar_fill() {
        for d in DType::ALL {
            let z = Tensor::zeros([2, 3], d);
            assert_eq!(z.nbytes(), 6 * d.size());
            assert!(z.as_bytes().unwrap().iter().all(|&b| b == 0));
            assert_eq!(z.as_bytes().unwrap().as_ptr() as usize % 8, 0);
        }
        assert_eq!(Tensor::zeros([0, 5], DType::F32).numel(), 0);
        let s = Tensor::scalar(7i64);
        assert_eq!(s.ndim(), 0);
        assert_eq!(s.to_vec::<i64>().unwrap(), vec![7]);
        assert!(matches!(
            Tensor::from_fill(DType::Bool, [2], |b| b[1] = 3),
            Err(TensorError::InvalidBool { index: 1, value: 3 })
        ));
    }

    #[test]
    fn from_bytes_aligns_misaligned_input() {
        let raw: Vec<u8> = std::iter::once(0u8)
            .chain([1.0f64, 2.0].iter().flat_map(|x| x.to_ne_bytes()))
            .collect();
        let b = Bytes::from(raw).slice(1..);
        let t = Tensor::from_bytes(DType::F64, [2], b.clone()).unwrap();
        assert_eq!(t.as_slice::<f64>().unwrap(), &[1.0, 2.0]);
        assert_eq!(t.as_bytes().unwrap().as_ptr() as usize % 8, 0);
        // Aligned input is kept as is.
        let aligned = Tensor::from(vec![1u64 as i64, 2])
            .cpu_bytes()
            .unwrap()
            .clone();
        let t2 = Tensor::from_bytes(DType::I64, [2], aligned.clone()).unwrap();
        assert_eq!(t2.as_bytes().unwrap().as_ptr(), aligned.as_ptr());
        assert!(matches!(
            Tensor::from_bytes(DType::I64, [3], aligned),
            Err(TensorError::ByteLength {
                expected: 24,
                actual: 16,
                ..
            })
        ));
    }

    #[test]
    fn reshape_narrow_cat() {
        let t = Tensor::from_vec((0..12).collect::<Vec<i32>>(), [4, 3]).unwrap();
        let r = t.reshape([2, 6]).unwrap();
        assert_eq!(r.shape(), &[2, 6]);
        assert!(matches!(t.reshape([5]), Err(TensorError::Reshape { .. })));
        let n = t.narrow(1, 2).unwrap();
        assert_eq!(n.as_slice::<i32>().unwrap(), &[3, 4, 5, 6, 7, 8]);
        assert!(t.narrow(3, 2).is_err());
        assert!(Tensor::scalar(1u8).narrow(0, 1).is_err());
        let parts: Vec<Tensor> = (0..4).map(|i| t.narrow(i, 1).unwrap()).collect();
        assert_eq!(Tensor::cat(&parts).unwrap(), t);
        assert!(Tensor::cat(&[]).is_err());
        assert!(Tensor::cat(&[t.clone(), Tensor::from(vec![1i32])]).is_err());
        assert!(Tensor::cat(&[t.clone(), Tensor::zeros([1, 3], DType::F32)]).is_err());
    }

    #[test]
    fn device_tensors_error_instead_of_panicking() {
        let t = Tensor::from_device_buffer(DType::F32, [4], Arc::new(FakeCuda(16))).unwrap();
        assert_eq!(t.device(), Device::Cuda(1));
        assert!(!t.is_cpu());
        assert_eq!(t.nbytes(), 16);
        let e = t.as_slice::<f32>().unwrap_err();
        assert_eq!(
            e,
            TensorError::NotOnCpu {
                device: Device::Cuda(1)
            }
        );
        assert!(e.to_string().contains("cuda:1"));
        assert!(t.as_bytes().is_err());
        assert!(t.narrow(0, 1).is_err());
        assert!(postcard::to_stdvec(&t).is_err());
        assert!(format!("{t:?}").contains("on device"));
        assert!(t.device_buffer().unwrap().as_any().is::<FakeCuda>());
        assert!(matches!(
            Tensor::from_device_buffer(DType::F32, [5], Arc::new(FakeCuda(16))),
            Err(TensorError::DeviceBufferSize { .. })
        ));
        assert_eq!(t, t.clone());
    }

    #[test]
    fn debug_shows_a_few_elements() {
        let t = Tensor::from((0..20).collect::<Vec<u8>>());
        let s = format!("{t:?}");
        assert!(s.contains("u8") && s.contains("+12 more"), "{s}");
    }

    #[cfg(feature = "ndarray")]
    #[test]
    fn ndarray_interop() {
        use ndarray::{ArrayD, IxDyn, s};
        let a = ArrayD::from_shape_vec(IxDyn(&[2, 3]), (0..6).map(|x| x as f32).collect()).unwrap();
        let t = Tensor::from(a.clone());
        assert_eq!(t.shape(), &[2, 3]);
        assert_eq!(t.to_ndarray::<f32>().unwrap(), a);
        assert_eq!(t.as_ndarray::<f32>().unwrap(), a.view());
        assert!(t.to_ndarray::<f64>().is_err());
        // A non-contiguous (transposed) array is copied in logical order.
        let tr = a.t().to_owned();
        let tt = Tensor::from(a.clone().reversed_axes());
        assert_eq!(tt.to_ndarray::<f32>().unwrap(), tr);
        // A sliced array with an offset.
        let sl = a.slice(s![1.., ..]).to_owned().into_dyn();
        assert_eq!(Tensor::from(sl.clone()).to_ndarray::<f32>().unwrap(), sl);
    }
}
