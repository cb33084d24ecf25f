//! Python values on graph edges: pickle protocol 5 with out-of-band buffers, each an adag
//! [`Buffer`] (read in place from shared memory by the reading process). torch tensors travel
//! as their bytes too: a top-level one as [`Kind::Tensor`], nested ones through the package's
//! codec (`adag/_codec.py`), whose pickler takes their bytes out of band.
use adag::Buffer;
use bytes::Bytes;
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyBufferError, PyTypeError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::{PyByteArray, PyBytes, PyDict, PyList, PyMemoryView, PyTuple, PyType};
use serde::{Deserialize, Serialize};
use std::os::raw::c_int;

/// Below this size bytes are copied rather than referred to.
const SMALL: usize = 4096;

/// What a [`PyValue`] holds.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub enum Kind {
    /// A C-contiguous numpy array of a plain dtype: its bytes are `data`; the reader makes a
    /// read-only view of them (`numpy.frombuffer`), with no pickling either way.
    NdArray {
        /// `dtype.str` (byte order, kind, size: `<f4`).
        dtype: String,
        /// The array's shape.
        shape: Vec<usize>,
    },
    /// A pickle stream (`data`) and its out-of-band buffers (`oob`).
    Pickle,
    /// A `bytes` object: its bytes are `data`.
    Bytes,
    /// A `bytearray`: its bytes are `data`.
    ByteArray,
    /// A `memoryview`: its bytes are `data`; the reader gets a read-only `memoryview` of
    /// them, in place.
    MemoryView,
    /// `None` (`data` is empty: scalars travel in the kind itself, with no pickling).
    None,
    /// A `bool`.
    Bool(bool),
    /// An `int` that fits in 64 bits (larger ones are pickled).
    Int(i64),
    /// A `float`.
    Float(f64),
    /// A `str`: its UTF-8 bytes are `data`.
    Str,
    /// A `torch.Tensor` (or `torch.nn.Parameter`) with plain bytes: its contiguous bytes are
    /// `data`; the reader makes a tensor whose storage is them (`torch.frombuffer`), with no
    /// pickling either way.
    Tensor {
        /// The dtype's name in `torch` (`float32`, `bfloat16`).
        dtype: String,
        /// The tensor's shape (empty: a 0-dim tensor).
        shape: Vec<usize>,
        /// Whether the sender's tensor required grad (the received one does too).
        requires_grad: bool,
        /// The device type the reader places it on (`cpu`, `cuda`): the sender's, unless the
        /// edge's `with_tensor_transport(device=...)` says otherwise. A CUDA tensor's bytes
        /// travel through host memory.
        device: String,
        /// A `torch.nn.Parameter` (arrives as one).
        parameter: bool,
    },
}

/// One Python object as it travels along an edge. Every `Buffer` of at least 16 KiB travels
/// beside the frame's encoding and is read in place from shared memory.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PyValue {
    /// How `data` is read.
    pub kind: Kind,
    /// The pickle stream, or the bytes of a `bytes`/`bytearray`.
    pub data: Buffer,
    /// The pickle's out-of-band buffers (numpy arrays, `PickleBuffer`s), in order.
    pub oob: Vec<Buffer>,
}

/// A Python buffer held open, so that its memory stays valid and unmoved while Rust reads it.
struct HeldBuffer(PyBuffer<u8>);

impl AsRef<[u8]> for HeldBuffer {
    fn as_ref(&self) -> &[u8] {
        let len = self.0.len_bytes();
        if len == 0 {
            return &[];
        }
        // SAFETY: the buffer was requested C-contiguous (`PyBuffer::get` checks it) and stays
        // exported while `self.0` lives, so its `len` bytes at `buf_ptr` stay allocated and in
        // place; the exporter (bytes, a numpy array) is only read here.
        unsafe { std::slice::from_raw_parts(self.0.buf_ptr() as *const u8, len) }
    }
}

/// The bytes of `obj` (anything with the buffer protocol, C-contiguous), without a copy.
fn buffer_of(obj: &Bound<'_, PyAny>) -> PyResult<Buffer> {
    if let Ok(b) = obj.downcast_exact::<PyBytes>()
        && b.as_bytes().len() < SMALL
    {
        return Ok(Buffer::copy_from_slice(b.as_bytes()));
    }
    let buf = PyBuffer::<u8>::get(obj)?;
    if !buf.is_c_contiguous() {
        return Err(PyBufferError::new_err("the buffer is not C-contiguous"));
    }
    if buf.len_bytes() < SMALL {
        // Small: a copy is cheaper than holding the Python object (whose release needs the GIL).
        return Ok(Buffer::copy_from_slice(HeldBuffer(buf).as_ref()));
    }
    Ok(Buffer::from(Bytes::from_owner(HeldBuffer(buf))))
}

/// A contiguous CPU tensor held alive, so that its bytes stay valid and in place while Rust
/// reads them.
struct HeldTensor {
    /// Taken (and released with the GIL held) on drop.
    tensor: Option<PyObject>,
    ptr: *const u8,
    len: usize,
}

// SAFETY: the pointer is only read (`as_ref`), and the memory it points to belongs to the
// tensor held beside it, which any thread may keep; the tensor object itself is touched only
// on drop, with the GIL held.
unsafe impl Send for HeldTensor {}

impl AsRef<[u8]> for HeldTensor {
    fn as_ref(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `tensor_buffer` checked that the tensor is an exact `torch.Tensor` on the
        // CPU, contiguous, with no conjugate or negative bit, so its `nbytes` bytes lie in
        // order from `data_ptr()` inside its storage. The storage is reference-counted by the
        // tensor held in `self`, so it is not freed while `self` lives; its memory moves or is
        // freed only when that storage is resized (`resize_`/`set_` on a tensor sharing it),
        // which is the one thing a program must not do to a tensor it has handed to a graph
        // until the value is read (the precondition torch's own `Tensor.numpy()` views carry).
        // The bytes are only read here.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for HeldTensor {
    fn drop(&mut self) {
        if let Some(t) = self.tensor.take() {
            // Released now, not whenever this process next takes the GIL: a large tensor's
            // memory goes back at once.
            Python::with_gil(|_| drop(t));
        }
    }
}

/// `torch.Tensor` and `torch.nn.Parameter`, the types that travel as their bytes.
struct TorchTypes {
    tensor: Py<PyType>,
    parameter: Py<PyType>,
}

/// torch's tensor types once this process has torch loaded; `None` before, without
/// importing it (a value can hold a tensor only in a process that has torch).
fn torch_types(py: Python<'_>) -> PyResult<Option<&'static TorchTypes>> {
    static TORCH: GILOnceCell<TorchTypes> = GILOnceCell::new();
    static MODULES: GILOnceCell<Py<PyDict>> = GILOnceCell::new();
    if let Some(t) = TORCH.get(py) {
        return Ok(Some(t));
    }
    let modules = MODULES.get_or_try_init(py, || {
        Ok::<_, PyErr>(
            py.import("sys")?
                .getattr("modules")?
                .downcast_into::<PyDict>()?
                .unbind(),
        )
    })?;
    let Some(torch) = modules.bind(py).get_item("torch")? else {
        return Ok(None);
    };
    // `torch` is in sys.modules from the start of its import: until `torch.nn` is there too,
    // no tensor has been made, and nothing is cached.
    let types = (|| -> PyResult<TorchTypes> {
        Ok(TorchTypes {
            tensor: torch.getattr("Tensor")?.downcast_into::<PyType>()?.unbind(),
            parameter: torch
                .getattr("nn")?
                .getattr("Parameter")?
                .downcast_into::<PyType>()?
                .unbind(),
        })
    })();
    match types {
        Ok(t) => {
            let _ = TORCH.set(py, t);
            Ok(TORCH.get(py))
        }
        Err(_) => Ok(None),
    }
}

/// The package's codec (`adag/_codec.py`), imported the first time a value needs it (a
/// process with torch loaded, or a tensor received).
struct Codec {
    dumps: PyObject,
    loads: PyObject,
    tensor_parts: PyObject,
    tensor_from: PyObject,
    in_argument: PyObject,
    dumps_main: PyObject,
}

fn codec(py: Python<'_>) -> PyResult<&'static Codec> {
    static CODEC: GILOnceCell<Codec> = GILOnceCell::new();
    CODEC.get_or_try_init(py, || {
        let m = py.import("adag._codec")?;
        Ok(Codec {
            dumps: m.getattr("dumps")?.unbind(),
            loads: m.getattr("loads")?.unbind(),
            tensor_parts: m.getattr("tensor_parts")?.unbind(),
            tensor_from: m.getattr("tensor_from")?.unbind(),
            in_argument: m.getattr("in_argument")?.unbind(),
            dumps_main: m.getattr("dumps_main")?.unbind(),
        })
    })
}

/// The bytes of `t`, a contiguous CPU `torch.Tensor`, without a copy (a copy when small).
fn tensor_buffer(py: Python<'_>, t: &Bound<'_, PyAny>) -> PyResult<Buffer> {
    let exact = match torch_types(py)? {
        Some(torch) => t.get_type().is(torch.tensor.bind(py)),
        None => false,
    };
    // Checked here, not trusted from the caller: the pointer read below must start the
    // tensor's `nbytes` bytes, in order, in memory the tensor holds.
    if !exact
        || !t.getattr(intern!(py, "is_cpu"))?.is_truthy()?
        || !t.call_method0(intern!(py, "is_contiguous"))?.is_truthy()?
        || t.call_method0(intern!(py, "is_conj"))?.is_truthy()?
        || t.call_method0(intern!(py, "is_neg"))?.is_truthy()?
    {
        return Err(PyTypeError::new_err(format!(
            "adag sends the bytes of a contiguous CPU torch.Tensor without conjugate or \
             negative bit, and got {}: make it one first (adag._codec.tensor_parts does)",
            t.repr()
                .map_or_else(|_| "another object".into(), |r| r.to_string())
        )));
    }
    let len: usize = t.getattr(intern!(py, "nbytes"))?.extract()?;
    if len == 0 {
        return Ok(Buffer::new());
    }
    let held = HeldTensor {
        ptr: t
            .call_method0(intern!(py, "data_ptr"))?
            .extract::<usize>()? as *const u8,
        len,
        tensor: Some(t.clone().unbind()),
    };
    if len < SMALL {
        // Small: a copy is cheaper than holding the tensor (whose release needs the GIL).
        return Ok(Buffer::copy_from_slice(held.as_ref()));
    }
    Ok(Buffer::from(Bytes::from_owner(held)))
}

/// The bytes of a contiguous CPU `torch.Tensor`, read-only, without a copy: the codec wraps
/// them in a `pickle.PickleBuffer`, so that a nested tensor's bytes go out of band. The
/// tensor stays alive as long as the returned object (and any view of it).
#[pyfunction]
pub fn tensor_bytes(py: Python<'_>, tensor: &Bound<'_, PyAny>) -> PyResult<ShmBuffer> {
    Ok(ShmBuffer(tensor_buffer(py, tensor)?))
}

/// A `torch.Tensor` or `torch.nn.Parameter` (exactly: subclasses may carry state of their
/// own, and are pickled) that travels as its bytes. `device`: where the reader places it
/// (`None`: the tensor's own device type).
fn tensor(
    py: Python<'_>,
    torch: &TorchTypes,
    obj: &Bound<'_, PyAny>,
    device: Option<&str>,
) -> PyResult<Option<PyValue>> {
    let ty = obj.get_type();
    if !ty.is(torch.tensor.bind(py)) && !ty.is(torch.parameter.bind(py)) {
        return Ok(None);
    }
    let parts = codec(py)?.tensor_parts.bind(py).call1((obj, device))?;
    if parts.is_none() {
        // No plain bytes (sparse, quantized, ...): torch pickles it.
        return Ok(None);
    }
    let (held, dtype, shape, requires_grad, device, parameter): (
        Bound<'_, PyAny>,
        String,
        Vec<usize>,
        bool,
        String,
        bool,
    ) = parts.extract()?;
    Ok(Some(PyValue {
        kind: Kind::Tensor {
            dtype,
            shape,
            requires_grad,
            device,
            parameter,
        },
        data: tensor_buffer(py, &held)?,
        oob: Vec::new(),
    }))
}

/// Pickle with the codec (a process with torch loaded): tensors inside go out of band.
fn codec_dumps(py: Python<'_>, obj: &Bound<'_, PyAny>, device: Option<&str>) -> PyResult<PyValue> {
    let (stream, buffers): (Bound<'_, PyAny>, Bound<'_, PyList>) =
        codec(py)?.dumps.bind(py).call1((obj, device))?.extract()?;
    let mut oob = Vec::with_capacity(buffers.len());
    for b in buffers.iter() {
        let raw = b.call_method0(intern!(py, "raw"))?;
        // A tensor's bytes are a `Buffer` already (`tensor_bytes`): shared, not wrapped again.
        let shared = raw
            .getattr(intern!(py, "obj"))
            .ok()
            .and_then(|o| o.downcast_into::<ShmBuffer>().ok())
            .filter(|s| raw.len().is_ok_and(|n| n == s.get().0.len()))
            .map(|s| s.get().0.clone());
        oob.push(match shared {
            Some(buf) => buf,
            None => buffer_of(&raw)?,
        });
    }
    Ok(PyValue {
        kind: Kind::Pickle,
        data: buffer_of(&stream)?,
        oob,
    })
}

/// A node argument could not be decoded: the error, saying which argument of which method
/// and whose value it is when it is a tensor that cannot be placed on a GPU.
pub fn in_argument(py: Python<'_>, err: PyErr, method: &str, index: usize, source: &str) -> PyErr {
    let described = codec(py).and_then(|c| {
        c.in_argument
            .bind(py)
            .call1((err.value(py), method, index, source))
    });
    match described {
        Ok(e) => PyErr::from_value(e),
        Err(_) => err,
    }
}

struct Pickle {
    dumps: PyObject,
    loads: PyObject,
    cloud_dumps: Option<PyObject>,
}

fn pickle(py: Python<'_>) -> PyResult<&'static Pickle> {
    static PICKLE: GILOnceCell<Pickle> = GILOnceCell::new();
    PICKLE.get_or_try_init(py, || {
        let m = py.import("pickle")?;
        let cloud_dumps = py
            .import("cloudpickle")
            .and_then(|c| c.getattr("dumps"))
            .ok()
            .map(Bound::unbind);
        Ok(Pickle {
            dumps: m.getattr("dumps")?.unbind(),
            loads: m.getattr("loads")?.unbind(),
            cloud_dumps,
        })
    })
}

/// `cloudpickle.dumps(obj)` (classes, functions and closures by value), or `pickle.dumps`
/// without cloudpickle.
pub fn dumps_code(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    let p = pickle(py)?;
    let f = p.cloud_dumps.as_ref().unwrap_or(&p.dumps);
    let out = f.bind(py).call1((obj,))?;
    Ok(out.downcast::<PyBytes>()?.as_bytes().to_vec())
}

/// A numpy array that travels as its bytes: exactly `numpy.ndarray`, C-contiguous, of a dtype
/// without fields or objects (anything else is pickled).
fn ndarray(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<Option<PyValue>> {
    let ty = obj.get_type();
    if ty.name()? != "ndarray" || ty.module()? != "numpy" {
        return Ok(None);
    }
    let dtype = obj.getattr("dtype")?;
    if !obj.getattr("flags")?.getattr("c_contiguous")?.is_truthy()?
        || dtype.getattr("hasobject")?.is_truthy()?
        || !dtype.getattr("fields")?.is_none()
        || dtype.getattr("kind")?.extract::<String>()? == "V"
    {
        return Ok(None);
    }
    let raw = pickle_buffer(py)?
        .bind(py)
        .call1((obj,))?
        .call_method0("raw")?;
    Ok(Some(PyValue {
        kind: Kind::NdArray {
            dtype: dtype.getattr("str")?.extract()?,
            shape: obj.getattr("shape")?.extract()?,
        },
        data: buffer_of(&raw)?,
        oob: Vec::new(),
    }))
}

fn pickle_buffer(py: Python<'_>) -> PyResult<&'static PyObject> {
    static PB: GILOnceCell<PyObject> = GILOnceCell::new();
    PB.get_or_try_init(py, || {
        Ok(py.import("pickle")?.getattr("PickleBuffer")?.unbind())
    })
}

/// `numpy.frombuffer`, imported on the first array received.
fn frombuffer(py: Python<'_>) -> PyResult<&'static PyObject> {
    static F: GILOnceCell<PyObject> = GILOnceCell::new();
    F.get_or_try_init(py, || {
        Ok(py.import("numpy")?.getattr("frombuffer")?.unbind())
    })
}

/// Scalars and strings: values without buffers, pickled the short way.
fn is_plain(obj: &Bound<'_, PyAny>) -> bool {
    use pyo3::types::{PyBool, PyFloat, PyInt, PyString};
    obj.is_none()
        || obj.is_exact_instance_of::<PyInt>()
        || obj.is_exact_instance_of::<PyFloat>()
        || obj.is_exact_instance_of::<PyBool>()
        || obj.is_exact_instance_of::<PyString>()
}

impl PyValue {
    /// A value that travels in its kind alone.
    fn scalar(kind: Kind) -> PyValue {
        PyValue {
            kind,
            data: Buffer::new(),
            oob: Vec::new(),
        }
    }
}

/// `None`, `bool`, `int` (64 bits), `float` and `str` as themselves: the commonest small
/// values cost no pickling either way (a pickle round trip of an `int` is about 0.4 µs).
fn scalar(obj: &Bound<'_, PyAny>) -> Option<PyValue> {
    use pyo3::types::{PyBool, PyFloat, PyInt, PyString};
    if obj.is_none() {
        return Some(PyValue::scalar(Kind::None));
    }
    if obj.is_exact_instance_of::<PyInt>() {
        return obj
            .extract::<i64>()
            .ok()
            .map(|v| PyValue::scalar(Kind::Int(v)));
    }
    if let Ok(f) = obj.downcast_exact::<PyFloat>() {
        return Some(PyValue::scalar(Kind::Float(f.value())));
    }
    if let Ok(s) = obj.downcast_exact::<PyString>() {
        // A string with lone surrogates has no UTF-8: it is pickled.
        return s.to_str().ok().map(|s| PyValue {
            kind: Kind::Str,
            data: Buffer::copy_from_slice(s.as_bytes()),
            oob: Vec::new(),
        });
    }
    if let Ok(b) = obj.downcast_exact::<PyBool>() {
        return Some(PyValue::scalar(Kind::Bool(b.is_true())));
    }
    None
}

/// Encode `obj` for an edge: `None`, `bool`, `int`, `float`, `str` as themselves, a plain
/// numpy array as its bytes, `bytes`/`bytearray`/`memoryview` as themselves, anything else
/// pickled (protocol 5, out-of-band buffers kept apart).
pub fn dumps(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<PyValue> {
    dumps_to(py, obj, None)
}

/// [`dumps`], and with torch loaded: a top-level CPU tensor as its bytes
/// ([`Kind::Tensor`]), anything else pickled by the codec (`adag/_codec.py`), which takes the
/// bytes of the tensors inside out of band. `device` (`cpu`, `cuda`): where the reader is to
/// place the tensors (the writing node's `with_tensor_transport(device=...)`); `None`: each
/// tensor's own device type.
pub fn dumps_to(py: Python<'_>, obj: &Bound<'_, PyAny>, device: Option<&str>) -> PyResult<PyValue> {
    if let Some(v) = scalar(obj) {
        return Ok(v);
    }
    if let Ok(b) = obj.downcast_exact::<PyBytes>() {
        return Ok(PyValue {
            kind: Kind::Bytes,
            data: buffer_of(b.as_any())?,
            oob: Vec::new(),
        });
    }
    if let Ok(b) = obj.downcast_exact::<PyByteArray>() {
        // A bytearray may change after `execute` returns: its bytes are copied now.
        return Ok(PyValue {
            kind: Kind::ByteArray,
            data: Buffer::from(b.to_vec()),
            oob: Vec::new(),
        });
    }
    if obj.is_exact_instance_of::<PyMemoryView>() {
        // Bytes, whatever the view's format (a copy if it is not contiguous).
        let flat = obj
            .call_method1("cast", ("B",))
            .or_else(|_| obj.call_method0("tobytes"))?;
        return Ok(PyValue {
            kind: Kind::MemoryView,
            data: buffer_of(&flat)?,
            oob: Vec::new(),
        });
    }
    if let Some(v) = ndarray(py, obj)? {
        return Ok(v);
    }
    let torch = torch_types(py)?;
    if let Some(torch) = torch
        && let Some(v) = tensor(py, torch, obj, device)?
    {
        return Ok(v);
    }
    let p = pickle(py)?;
    if is_plain(obj) {
        // No buffer to take out of band: no callback to build.
        let stream = p.dumps.bind(py).call1((obj, 5))?;
        return Ok(PyValue {
            kind: Kind::Pickle,
            data: buffer_of(&stream)?,
            oob: Vec::new(),
        });
    }
    if torch.is_some() {
        return codec_dumps(py, obj, device);
    }
    let buffers = PyList::empty(py);
    let kwargs = pyo3::types::PyDict::new(py);
    kwargs.set_item("protocol", 5)?;
    kwargs.set_item("buffer_callback", buffers.getattr("append")?)?;
    let stream = match p.dumps.bind(py).call((obj,), Some(&kwargs)) {
        // Something of the driver's script by name (a dataclass of `__main__`): the worker's
        // `__main__` is not the script, so it goes by value (cloudpickle), as Ray sends it.
        Ok(s) if !names_main(&s) || p.cloud_dumps.is_none() => s,
        // Something of the driver's script by name (a dataclass of `__main__`), or that plain
        // pickle refuses: the script's classes by value, each defined once per process
        // (`_codec.dumps_main`); anything else it refuses (lambdas, local classes) by value
        // through cloudpickle.
        first => {
            buffers.call_method0("clear")?;
            match codec(py)?.dumps_main.bind(py).call1((obj, &buffers)) {
                Ok(s) => s,
                Err(_) => match &p.cloud_dumps {
                    Some(cloud) => {
                        buffers.call_method0("clear")?;
                        cloud.bind(py).call((obj,), Some(&kwargs))?
                    }
                    None => first?,
                },
            }
        }
    };
    let mut oob = Vec::with_capacity(buffers.len());
    for b in buffers.iter() {
        let raw = b.call_method0("raw")?;
        oob.push(buffer_of(&raw)?);
    }
    Ok(PyValue {
        kind: Kind::Pickle,
        data: buffer_of(&stream)?,
        oob,
    })
}

/// Whether a pickle stream names `__main__` (see `adag/_codec.py`, `names_main`).
fn names_main(stream: &Bound<'_, PyAny>) -> bool {
    const MAIN: &[u8] = b"__main__";
    stream
        .downcast::<PyBytes>()
        .is_ok_and(|b| b.as_bytes().windows(MAIN.len()).any(|w| w == MAIN))
}

/// Unpickle a value; its out-of-band buffers become [`ShmBuffer`]s, so a numpy array is a
/// view of the memory the value arrived in (shared memory between processes).
pub fn loads(py: Python<'_>, v: &PyValue) -> PyResult<PyObject> {
    loads_to(py, v, None)
}

/// [`loads`], placing the torch tensors inside on `device` (`cpu`, `cuda`) rather than where
/// the value says: the reading edge's `with_tensor_transport(device=...)`.
pub fn loads_to(py: Python<'_>, v: &PyValue, device: Option<&str>) -> PyResult<PyObject> {
    match &v.kind {
        Kind::None => Ok(py.None()),
        Kind::Bool(b) => Ok(pyo3::types::PyBool::new(py, *b)
            .to_owned()
            .into_any()
            .unbind()),
        Kind::Int(i) => Ok(i.into_pyobject(py)?.into_any().unbind()),
        Kind::Float(f) => Ok(pyo3::types::PyFloat::new(py, *f).into_any().unbind()),
        Kind::Str => Ok(pyo3::types::PyString::new(
            py,
            std::str::from_utf8(&v.data)
                .map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))?,
        )
        .into_any()
        .unbind()),
        Kind::NdArray { dtype, shape } => {
            let data = Bound::new(py, ShmBuffer(v.data.clone()))?;
            let flat = frombuffer(py)?.bind(py).call1((data, dtype.as_str()))?;
            Ok(flat
                .call_method1("reshape", (PyTuple::new(py, shape)?,))?
                .unbind())
        }
        Kind::Tensor {
            dtype,
            shape,
            requires_grad,
            device: sent,
            parameter,
        } => {
            let data = if v.data.is_empty() {
                py.None().into_bound(py)
            } else {
                Bound::new(py, ShmBuffer(v.data.clone()))?.into_any()
            };
            codec(py)?
                .tensor_from
                .bind(py)
                .call1((
                    data,
                    dtype.as_str(),
                    PyTuple::new(py, shape)?,
                    *requires_grad,
                    device.unwrap_or(sent),
                    *parameter,
                ))
                .map(Bound::unbind)
        }
        Kind::Bytes => Ok(PyBytes::new(py, &v.data).into_any().unbind()),
        Kind::ByteArray => Ok(PyByteArray::new(py, &v.data).into_any().unbind()),
        Kind::MemoryView => {
            let data = Bound::new(py, ShmBuffer(v.data.clone()))?;
            Ok(PyMemoryView::from(data.as_any())?.into_any().unbind())
        }
        Kind::Pickle if device.is_some() => {
            let data = Bound::new(py, ShmBuffer(v.data.clone()))?;
            let bufs = v
                .oob
                .iter()
                .map(|b| Bound::new(py, ShmBuffer(b.clone())))
                .collect::<PyResult<Vec<_>>>()?;
            codec(py)?
                .loads
                .bind(py)
                .call1((data, PyTuple::new(py, bufs)?, device))
                .map(Bound::unbind)
        }
        Kind::Pickle => {
            let p = pickle(py)?;
            if v.oob.is_empty() && v.data.len() < SMALL {
                // Small: a copy into `bytes` is cheaper than a buffer object to read through.
                let data = PyBytes::new(py, &v.data);
                return p.loads.bind(py).call1((data,)).map(Bound::unbind);
            }
            let data = Bound::new(py, ShmBuffer(v.data.clone()))?;
            if v.oob.is_empty() {
                return p.loads.bind(py).call1((data,)).map(Bound::unbind);
            }
            let bufs = v
                .oob
                .iter()
                .map(|b| Bound::new(py, ShmBuffer(b.clone())))
                .collect::<PyResult<Vec<_>>>()?;
            let kwargs = pyo3::types::PyDict::new(py);
            kwargs.set_item("buffers", PyTuple::new(py, bufs)?)?;
            p.loads
                .bind(py)
                .call((data,), Some(&kwargs))
                .map(Bound::unbind)
        }
    }
}

/// Read-only bytes of a value that arrived through a channel (often in shared memory), or of
/// a tensor about to be sent ([`tensor_bytes`]), exposed with the buffer protocol; kept valid
/// as long as this object (or a view of it, such as a numpy array or a tensor) lives.
#[pyclass(module = "adag._native", frozen)]
pub struct ShmBuffer(pub Buffer);

#[pymethods]
impl ShmBuffer {
    fn __len__(&self) -> usize {
        self.0.len()
    }

    fn __repr__(&self) -> String {
        format!("ShmBuffer({} bytes)", self.0.len())
    }

    /// # Safety
    /// Called by the interpreter with a `Py_buffer` to fill.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut pyo3::ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        if flags & pyo3::ffi::PyBUF_WRITABLE == pyo3::ffi::PyBUF_WRITABLE {
            return Err(PyBufferError::new_err(
                "a value received through an adag channel is read-only",
            ));
        }
        let bytes: &[u8] = &slf.get().0;
        // SAFETY: `view` is the interpreter's to fill; PyBuffer_FillInfo stores a new
        // reference to `slf` in it, which keeps the `Buffer` (an immutable `Bytes` whose
        // memory never moves) alive until the view is released.
        let rc = unsafe {
            pyo3::ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                bytes.as_ptr() as *mut std::ffi::c_void,
                bytes.len() as pyo3::ffi::Py_ssize_t,
                1,
                flags,
            )
        };
        if rc == -1 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }
}

/// Writable memory for the result of the running actor method (`adag.empty`): lent by the
/// method's output channel when it has shared memory ([`adag::output_buffer`]), else on the
/// heap. A numpy array over it that the method returns is written once: its bytes already
/// lie where the readers read them.
#[pyclass(module = "adag._native", frozen)]
pub struct OutputBuffer {
    memory: parking_lot::Mutex<adag::BufferMut>,
    lent: bool,
}

#[pymethods]
impl OutputBuffer {
    fn __len__(&self) -> usize {
        self.memory.lock().len()
    }

    /// Whether the bytes lie in memory lent by the output channel.
    #[getter]
    fn lent(&self) -> bool {
        self.lent
    }

    fn __repr__(&self) -> String {
        format!(
            "OutputBuffer({} bytes, lent: {})",
            self.__len__(),
            self.lent
        )
    }

    /// # Safety
    /// Called by the interpreter with a `Py_buffer` to fill.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut pyo3::ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let (ptr, len) = {
            let mut memory = slf.get().memory.lock();
            (memory.as_mut_ptr(), memory.len())
        };
        // SAFETY: `view` is the interpreter's to fill; PyBuffer_FillInfo stores a new reference
        // to `slf` in it, which keeps the `BufferMut` alive until the view is released. Its
        // bytes never move (a heap vector that is never resized, or a pinned block of a
        // channel's mapping) and are only reached through such views, by Python code holding
        // the GIL, so the writable view aliases nothing Rust reads meanwhile.
        let rc = unsafe {
            pyo3::ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                ptr as *mut std::ffi::c_void,
                len as pyo3::ffi::Py_ssize_t,
                0,
                flags,
            )
        };
        if rc == -1 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }
}

/// `len` bytes for the result of the running actor method (see [`OutputBuffer`]); called on
/// the actor's thread, where the method's output channel lends its memory.
#[pyfunction]
pub fn output_buffer(len: usize) -> OutputBuffer {
    let memory = adag::output_buffer(len);
    OutputBuffer {
        lent: memory.is_loaned(),
        memory: parking_lot::Mutex::new(memory),
    }
}
