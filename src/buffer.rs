//! [`Buffer`]: bytes that cross processes without re-encoding and are read in place.
use crate::value::frame;
use bytes::Bytes;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::ops::Deref;

/// An immutable byte buffer for graph values: cheap to clone, copied once into shared memory
/// when it crosses processes, and read there in place (zero copy).
///
/// Use it for large byte payloads (images, serialized blobs, raw arrays) in place of
/// `Vec<u8>`, which serde encodes byte by byte. Between processes a buffer of at least 16 KiB
/// travels beside the value's encoding, 64-byte aligned; the reading actor (or the driver)
/// gets a `Buffer` that points into the channel's shared memory. Keeping it is fine: the writer
/// moves on to other memory meanwhile, and the shared memory is freed when the last clone is
/// dropped. A buffer smaller than a quarter of its channel's slot is copied on reading instead,
/// so that a kept buffer never holds more than 4 × its size of shared memory. Within one
/// process a buffer moves without any copy.
///
/// A buffer read in place is written once: an actor that returns it (or a
/// [`slice`](Self::slice) of it) to the driver, and the driver that sends a result it got
/// back into the channel it came from, pass a reference to the shared memory it already lies
/// in instead of copying it again.
///
/// # Example
///
/// ```
/// use adag::{Buffer, CompileOptions, Dag, Placement, Runtime};
///
/// struct Checksum;
///
/// #[adag::actor]
/// impl Checksum {
///     pub fn new() -> Self {
///         Checksum
///     }
///     pub fn sum(&mut self, data: Buffer) -> u64 {
///         data.iter().map(|&b| u64::from(b)).sum()
///     }
/// }
///
/// # fn main() -> adag::Result<()> {
/// let rt = Runtime::new()?;
/// let actor = rt.spawn::<Checksum>(Placement::Process, ())?;
/// let dag = Dag::<Buffer>::new();
/// let graph = dag.compile(actor.sum(dag.input()), CompileOptions::default())?;
/// let data = Buffer::from(vec![1u8; 1 << 20]);
/// assert_eq!(graph.execute(data)?.get()?, 1 << 20);
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Buffer(Bytes);

/// Memory lent by a channel for a buffer to be built in place: writable until it is frozen.
pub(crate) trait LoanedBytes: Send + Sync {
    fn bytes(&self) -> &[u8];
    fn bytes_mut(&mut self) -> &mut [u8];
    /// The bytes, now immutable, keeping the memory lent for as long as they live.
    fn freeze(self: Box<Self>) -> Bytes;
}

/// A writable byte buffer to fill and then [`freeze`](Self::freeze) into a [`Buffer`]; from
/// [`CompiledGraph::input_buffer`](crate::CompiledGraph::input_buffer) it lies in the shared
/// memory of the graph's input channel, so sending it copies nothing (written once: where the
/// caller builds it).
///
/// # Example
///
/// ```
/// use adag::BufferMut;
///
/// let mut data = BufferMut::zeroed(4);
/// data.copy_from_slice(&[1, 2, 3, 4]);
/// let frozen = data.freeze();
/// assert_eq!(&frozen[..], &[1, 2, 3, 4]);
/// ```
pub struct BufferMut(Inner);

enum Inner {
    Heap(Vec<u8>),
    Loaned(Box<dyn LoanedBytes>),
}

impl BufferMut {
    /// `len` zero bytes on the heap.
    pub fn zeroed(len: usize) -> Self {
        BufferMut(Inner::Heap(vec![0; len]))
    }

    pub(crate) fn loaned(memory: Box<dyn LoanedBytes>) -> Self {
        BufferMut(Inner::Loaned(memory))
    }

    /// Whether the bytes lie in memory lent by a channel (else on the heap).
    pub fn is_loaned(&self) -> bool {
        matches!(self.0, Inner::Loaned(_))
    }

    /// The bytes as an immutable [`Buffer`], without a copy.
    pub fn freeze(self) -> Buffer {
        match self.0 {
            Inner::Heap(v) => Buffer::from(v),
            Inner::Loaned(memory) => Buffer(memory.freeze()),
        }
    }
}

impl Deref for BufferMut {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.0 {
            Inner::Heap(v) => v,
            Inner::Loaned(memory) => memory.bytes(),
        }
    }
}

impl std::ops::DerefMut for BufferMut {
    fn deref_mut(&mut self) -> &mut [u8] {
        match &mut self.0 {
            Inner::Heap(v) => v,
            Inner::Loaned(memory) => memory.bytes_mut(),
        }
    }
}

impl fmt::Debug for BufferMut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "BufferMut({} bytes, loaned: {})",
            self.len(),
            self.is_loaned()
        )
    }
}

impl Buffer {
    /// An empty buffer.
    pub fn new() -> Self {
        Buffer(Bytes::new())
    }

    /// A buffer holding a copy of `data`.
    pub fn copy_from_slice(data: &[u8]) -> Self {
        Buffer(Bytes::copy_from_slice(data))
    }

    /// The bytes in `range`, sharing this buffer's memory (no copy).
    ///
    /// A slice of a buffer read in place from shared memory stays there, and an actor that
    /// returns it passes it on without copying it again when the next reader maps the same
    /// memory (the driver, for a buffer that came from one of its graph's channels).
    ///
    /// # Panics
    ///
    /// If the range is out of bounds, like slicing `[u8]`.
    ///
    /// # Example
    ///
    /// ```
    /// use adag::Buffer;
    ///
    /// let data = Buffer::from(vec![1u8, 2, 3, 4, 5]);
    /// let tail = data.slice(2..);
    /// assert_eq!(&tail[..], &[3, 4, 5]);
    /// assert_eq!(tail.as_ptr(), data[2..].as_ptr());
    /// ```
    pub fn slice(&self, range: impl std::ops::RangeBounds<usize>) -> Buffer {
        Buffer(self.0.slice(range))
    }

    /// The bytes, as a [`bytes::Bytes`] sharing this buffer's memory.
    pub fn into_bytes(self) -> Bytes {
        self.0
    }

    /// The bytes, as a [`bytes::Bytes`] sharing this buffer's memory.
    pub fn as_bytes(&self) -> &Bytes {
        &self.0
    }
}

impl Deref for Buffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.0
    }
}

impl AsRef<[u8]> for Buffer {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl std::borrow::Borrow<[u8]> for Buffer {
    fn borrow(&self) -> &[u8] {
        &self.0
    }
}

impl From<Vec<u8>> for Buffer {
    /// Takes the vector without copying.
    fn from(v: Vec<u8>) -> Self {
        Buffer(Bytes::from(v))
    }
}

impl From<Bytes> for Buffer {
    fn from(b: Bytes) -> Self {
        Buffer(b)
    }
}

impl From<&'static [u8]> for Buffer {
    fn from(b: &'static [u8]) -> Self {
        Buffer(Bytes::from_static(b))
    }
}

impl From<Buffer> for Bytes {
    fn from(b: Buffer) -> Self {
        b.0
    }
}

impl From<Buffer> for Vec<u8> {
    fn from(b: Buffer) -> Self {
        Vec::from(b.0)
    }
}

impl PartialEq<[u8]> for Buffer {
    fn eq(&self, other: &[u8]) -> bool {
        self.0 == other
    }
}

impl fmt::Debug for Buffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const SHOWN: usize = 16;
        write!(f, "Buffer({} bytes", self.len())?;
        if !self.is_empty() {
            write!(f, ": {:02x?}", &self[..self.len().min(SHOWN)])?;
            if self.len() > SHOWN {
                f.write_str(" ...")?;
            }
        }
        f.write_str(")")
    }
}

impl Serialize for Buffer {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        frame::serialize_bytes(&self.0, serializer)
    }
}

impl<'de> Deserialize<'de> for Buffer {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        frame::deserialize_bytes(deserializer).map(Buffer)
    }
}

/// Holds the memory of one dropped large value for the next one of its producer: a large
/// frame received from the network, a communicator's result. Reusing it spares the page
/// faults (and the zeroing) of fresh memory on every call: a fresh 64 MiB result costs ~16k
/// faults, a quarter of a TCP allreduce's time on the machines measured.
#[derive(Clone, Default)]
pub(crate) struct Recycler(std::sync::Arc<parking_lot::Mutex<Option<Vec<u8>>>>);

impl Recycler {
    /// Memory of `len` initialized bytes (their values unspecified), if a dropped value left
    /// enough.
    pub(crate) fn take(&self, len: usize) -> Option<Vec<u8>> {
        if len == 0 {
            return None;
        }
        let mut buf = self.0.lock().take().filter(|b| b.len() >= len)?;
        buf.truncate(len);
        Some(buf)
    }

    /// `len` bytes to be overwritten whole: recycled if a dropped value left enough, else
    /// fresh (zeroed).
    pub(crate) fn take_or_zeroed(&self, len: usize) -> Vec<u8> {
        self.take(len).unwrap_or_else(|| vec![0u8; len])
    }

    /// The bytes as [`Bytes`] that give their memory back here once dropped.
    pub(crate) fn wrap(&self, bytes: Vec<u8>) -> Bytes {
        Bytes::from_owner(Recycled {
            bytes,
            home: std::sync::Arc::downgrade(&self.0),
        })
    }
}

/// Memory that returns to its [`Recycler`] when dropped (the larger of two is kept).
struct Recycled {
    bytes: Vec<u8>,
    home: std::sync::Weak<parking_lot::Mutex<Option<Vec<u8>>>>,
}

impl AsRef<[u8]> for Recycled {
    fn as_ref(&self) -> &[u8] {
        &self.bytes
    }
}

impl Drop for Recycled {
    fn drop(&mut self) {
        if let Some(home) = self.home.upgrade() {
            // Back to its whole length (a smaller value was cut from it; the tail was written
            // before, so only it is rewritten), so that the next value of the full size fits.
            let whole = self.bytes.capacity();
            self.bytes.resize(whole, 0);
            let mut slot = home.lock();
            if slot.as_ref().is_none_or(|b| b.len() < whole) {
                *slot = Some(std::mem::take(&mut self.bytes));
            }
        }
    }
}
