//! The shared-memory channel: a [ring](super::ring) whose words and payloads live in a memfd
//! mapped by every process that holds the fd.
//!
//! # Memory
//!
//! ```text
//! 0               ShmHeader: magic, version, config, growth state (atomics)
//! 128-aligned     RingControl: write_seq, data/space wait cells, closed
//! 128-aligned     Cursor × readers (128 bytes each)
//! 128-aligned     SlotMeta × depth: (offset, len, tag) of the payload in each slot
//! page-aligned    payload region 0: depth × stride0 bytes
//!                 payload region 1: depth × stride1 bytes (after a growth) ...
//! ```
//!
//! The memfd is created with `MFD_CLOEXEC` (a crash leaves nothing in `/dev/shm` or in other
//! children) and sealed against shrinking, so that a mapped page can never vanish. Every
//! process maps a fixed, large range with `MAP_NORESERVE` (room for every growth up to
//! `max_message_bytes`), so a growth never remaps and never passes a new fd.
//!
//! # Growth
//!
//! A message that does not fit the current stride makes the writer `ftruncate` the memfd
//! larger and carve a new payload region for *every* slot at its end (stride = max(2 × old,
//! needed), page-rounded, at most the page-rounded ceiling), pre-faulted with
//! `MADV_POPULATE_WRITE`. Each slot's [`SlotMeta`] names where its payload is, so readers follow
//! without being told; a slot is rewritten only after every reader released it, so an old
//! region is never read again once its slots were rewritten. Readers pre-fault (populate-read)
//! a region the first time a frame points into it. The regions a growth leaves behind stay
//! allocated until the channel is dropped (less than the live region in total).
//!
//! Payload bytes are written in place by the writer's encoder and read in place by readers
//! (zero copy); they are ordered by the ring (release on publish, acquire on read). Everything
//! else in the mapping is an atomic.

use std::fmt;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use memmap2::{Advice, MmapOptions, MmapRaw};
use rustix::fs::{MemfdFlags, SealFlags};

pub(crate) use super::ring::RingError;
use super::ring::{Cursor, RingControl, RingLease, RingMemory, RingReader, RingWriter};
use super::wait::DEFAULT_SPIN;
use crate::sync::{Arc, AtomicU32, AtomicU64, Ordering};

const MAGIC: u64 = u64::from_le_bytes(*b"adag-shm");
const VERSION: u32 = 1;
/// Limits that keep the layout arithmetic far from overflow.
const MAX_DEPTH: u32 = 1 << 16;
const MAX_READERS: u32 = 1 << 12;
const MAX_MESSAGE_BYTES: usize = 1 << 40;

/// Shape of a shared-memory channel, fixed at creation and recorded in its header.
#[derive(Clone, Debug)]
pub(crate) struct ShmConfig {
    /// Ring slots: the most messages in flight.
    pub depth: u32,
    /// Reader indices; every one of them must release a slot before it is reused.
    pub readers: u32,
    /// Initial payload capacity of each slot.
    pub slot_bytes: usize,
    /// Hard ceiling on one message; larger ones fail with [`RingError::TooLarge`].
    pub max_message_bytes: usize,
    /// Spin budget of waits before sleeping on the futex.
    pub spin: Duration,
}

impl Default for ShmConfig {
    fn default() -> Self {
        Self {
            depth: 8,
            readers: 1,
            slot_bytes: 4096,
            max_message_bytes: 1 << 30,
            spin: DEFAULT_SPIN,
        }
    }
}

/// Start of the mapping: identification, configuration, and the writer's growth state.
#[repr(C)]
#[derive(Debug)]
struct ShmHeader {
    /// [`MAGIC`], stored last at creation.
    magic: AtomicU64,
    version: AtomicU32,
    depth: AtomicU32,
    readers: AtomicU32,
    slot_bytes: AtomicU64,
    max_message_bytes: AtomicU64,
    spin_ns: AtomicU64,
    /// Written by the writer only: the current payload region, its per-slot stride, and the
    /// memfd's length (every byte below it is backed and mapped).
    region: AtomicU64,
    stride: AtomicU64,
    file_len: AtomicU64,
}

/// Where the payload of the message in a slot is. Written by the writer before it publishes.
#[repr(C, align(128))]
#[derive(Debug)]
struct SlotMeta {
    offset: AtomicU64,
    len: AtomicU64,
    tag: AtomicU32,
}

/// Types that may be viewed in place in the mapping.
///
/// # Safety
///
/// Every field is an atomic: any bit pattern (including the all-zero one of a fresh memfd)
/// is a valid value, and shared access from several threads and processes is sound.
unsafe trait Shared {}
// SAFETY: only atomics (`u64`/`u32` words, and `WaitCell`, itself two `AtomicU32`s).
unsafe impl Shared for ShmHeader {}
// SAFETY: as above.
unsafe impl Shared for RingControl {}
// SAFETY: as above.
unsafe impl Shared for Cursor {}
// SAFETY: as above.
unsafe impl Shared for SlotMeta {}

/// Offsets of everything in the mapping, derived from the configuration alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Layout {
    control: usize,
    cursors: usize,
    slots: usize,
    /// First payload byte; page-aligned. Everything below is header.
    payload_start: usize,
    /// Per-slot stride of the first payload region.
    initial_stride: usize,
    /// Largest stride a growth may reach (the page-rounded ceiling).
    max_stride: usize,
    /// Bytes of address space each process maps: room for every possible growth.
    reserve: usize,
}

impl Layout {
    fn new(cfg: &ShmConfig) -> Result<Self, RingError> {
        let invalid =
            |what: String| RingError::Io(io::Error::new(io::ErrorKind::InvalidInput, what));
        if cfg.depth == 0 || cfg.depth > MAX_DEPTH {
            return Err(invalid(format!(
                "depth {} is not in 1..={MAX_DEPTH}",
                cfg.depth
            )));
        }
        if cfg.readers == 0 || cfg.readers > MAX_READERS {
            return Err(invalid(format!(
                "readers {} is not in 1..={MAX_READERS}",
                cfg.readers
            )));
        }
        if cfg.max_message_bytes == 0 || cfg.max_message_bytes > MAX_MESSAGE_BYTES {
            return Err(invalid(format!(
                "max_message_bytes {} is not in 1..={MAX_MESSAGE_BYTES}",
                cfg.max_message_bytes
            )));
        }
        if cfg.slot_bytes > cfg.max_message_bytes {
            return Err(invalid(format!(
                "slot_bytes {} exceeds max_message_bytes {}",
                cfg.slot_bytes, cfg.max_message_bytes
            )));
        }
        let page = rustix::param::page_size();
        let control = size_of::<ShmHeader>().next_multiple_of(128);
        let cursors = (control + size_of::<RingControl>()).next_multiple_of(128);
        let slots = cursors + cfg.readers as usize * size_of::<Cursor>();
        let payload_start =
            (slots + cfg.depth as usize * size_of::<SlotMeta>()).next_multiple_of(page);
        let initial_stride = cfg.slot_bytes.max(1).next_multiple_of(page);
        let max_stride = cfg.max_message_bytes.next_multiple_of(page);
        // Strides at least double until they reach `max_stride`, so the regions before the
        // last one sum to less than twice the one before it, < 2 × max_stride: 3 × in all.
        let reserve = payload_start + cfg.depth as usize * 3 * max_stride;
        Ok(Self {
            control,
            cursors,
            slots,
            payload_start,
            initial_stride,
            max_stride,
            reserve,
        })
    }
}

/// Views a `T` at `offset` of `map`, whose first `valid` bytes are backed by the file.
fn view<T: Shared>(map: &MmapRaw, valid: usize, offset: usize) -> &T {
    let ptr = map.as_ptr().wrapping_add(offset);
    assert!(
        offset + size_of::<T>() <= valid.min(map.len()) && ptr.cast::<T>().is_aligned(),
        "view out of the mapping"
    );
    // SAFETY: the range is inside the mapping and below the file's length (checked above; the
    // memfd is sealed against shrinking, so it stays backed), it is aligned (checked above),
    // and `T: Shared` makes any bit pattern valid and shared access sound. The reference
    // borrows `map`, so it cannot outlive the mapping.
    unsafe { &*ptr.cast::<T>() }
}

/// One process's mapping of a channel.
#[derive(Debug)]
struct ShmShared {
    map: MmapRaw,
    fd: OwnedFd,
    layout: Layout,
    depth: u32,
    readers: u32,
    max_message_bytes: usize,
    spin: Duration,
}

impl ShmShared {
    fn at<T: Shared>(&self, offset: usize) -> &T {
        view(&self.map, self.layout.payload_start, offset)
    }

    fn header(&self) -> &ShmHeader {
        self.at(0)
    }

    fn slot(&self, seq: u64) -> &SlotMeta {
        let index = (seq % u64::from(self.depth)) as usize;
        self.at(self.layout.slots + index * size_of::<SlotMeta>())
    }

    /// Pre-faults `len` bytes at `offset` in this process's page tables. `write` when this
    /// process owns the range (a region nobody reads yet), which also allocates the pages.
    fn populate(&self, offset: usize, len: usize, write: bool) -> io::Result<()> {
        let advice = if write {
            Advice::PopulateWrite
        } else {
            Advice::PopulateRead
        };
        match self.map.advise_range(advice, offset, len) {
            // Kernels before 5.14 lack MADV_POPULATE_*: touch the pages instead, when we may.
            Err(err) if err.raw_os_error() == Some(libc::EINVAL) && write => {
                let page = rustix::param::page_size();
                assert!(
                    offset + len <= self.map.len(),
                    "populate out of the mapping"
                );
                for page_offset in (offset..offset + len).step_by(page) {
                    // SAFETY: inside the mapping and the file (the caller just sized it), and
                    // nobody else accesses this range yet (the caller owns it).
                    unsafe { self.map.as_mut_ptr().add(page_offset).write_volatile(0) };
                }
                Ok(())
            }
            Err(err) if err.raw_os_error() == Some(libc::EINVAL) => Ok(()),
            other => other,
        }
    }
}

impl RingMemory for Arc<ShmShared> {
    fn control(&self) -> &RingControl {
        self.at(self.layout.control)
    }

    fn cursor(&self, index: u32) -> &Cursor {
        assert!(index < self.readers, "reader index out of range");
        self.at(self.layout.cursors + index as usize * size_of::<Cursor>())
    }
}

/// A handle to a mapped shared-memory channel; clones share the mapping.
#[derive(Clone, Debug)]
pub(crate) struct ShmChannel {
    shared: Arc<ShmShared>,
}

impl ShmChannel {
    /// Creates a channel in a new memfd named `adag:<label>`, with every payload page
    /// allocated and mapped.
    pub fn create(cfg: &ShmConfig, label: &str) -> Result<Self, RingError> {
        let layout = Layout::new(cfg)?;
        let mut name = format!("adag:{}", label.replace('\0', "?"));
        // memfd names are at most 249 bytes.
        while name.len() > 249 {
            name.pop();
        }
        let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
            .map_err(io::Error::from)?;
        let file_len = layout.payload_start + cfg.depth as usize * layout.initial_stride;
        rustix::fs::ftruncate(&fd, file_len as u64).map_err(io::Error::from)?;
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::SEAL)
            .map_err(io::Error::from)?;
        let shared = map(fd, layout, cfg)?;
        shared.populate(0, file_len, true)?;
        let header = shared.header();
        header.version.store(VERSION, Ordering::Relaxed);
        header.depth.store(cfg.depth, Ordering::Relaxed);
        header.readers.store(cfg.readers, Ordering::Relaxed);
        header
            .slot_bytes
            .store(cfg.slot_bytes as u64, Ordering::Relaxed);
        header
            .max_message_bytes
            .store(cfg.max_message_bytes as u64, Ordering::Relaxed);
        header.spin_ns.store(
            cfg.spin.as_nanos().min(u64::MAX.into()) as u64,
            Ordering::Relaxed,
        );
        header
            .region
            .store(layout.payload_start as u64, Ordering::Relaxed);
        header
            .stride
            .store(layout.initial_stride as u64, Ordering::Relaxed);
        header.file_len.store(file_len as u64, Ordering::Relaxed);
        shared.control().init(cfg.depth, cfg.readers);
        header.magic.store(MAGIC, Ordering::Release);
        Ok(Self { shared })
    }

    /// Maps the channel created (in this or another process) on the memfd `fd`; the header
    /// tells its configuration.
    pub fn open(fd: OwnedFd) -> Result<Self, RingError> {
        let corrupt = |what: String| RingError::Corrupt(what);
        let seals = rustix::fs::fcntl_get_seals(&fd).map_err(io::Error::from)?;
        if !seals.contains(SealFlags::SHRINK) {
            return Err(corrupt("the memfd is not sealed against shrinking".into()));
        }
        let size = rustix::fs::fstat(&fd).map_err(io::Error::from)?.st_size as usize;
        if size < size_of::<ShmHeader>() {
            return Err(corrupt(format!(
                "the memfd holds {size} bytes, less than a header"
            )));
        }
        let cfg = {
            let probe = MmapOptions::new()
                .len(size_of::<ShmHeader>())
                .map_raw_read_only(&fd)?;
            let header: &ShmHeader = view(&probe, size, 0);
            let magic = header.magic.load(Ordering::Acquire);
            if magic != MAGIC {
                return Err(corrupt(format!(
                    "bad magic {magic:#x}: not an adag channel"
                )));
            }
            let version = header.version.load(Ordering::Relaxed);
            if version != VERSION {
                return Err(corrupt(format!(
                    "layout version {version}, expected {VERSION}"
                )));
            }
            ShmConfig {
                depth: header.depth.load(Ordering::Relaxed),
                readers: header.readers.load(Ordering::Relaxed),
                slot_bytes: header.slot_bytes.load(Ordering::Relaxed) as usize,
                max_message_bytes: header.max_message_bytes.load(Ordering::Relaxed) as usize,
                spin: Duration::from_nanos(header.spin_ns.load(Ordering::Relaxed)),
            }
        };
        let layout = Layout::new(&cfg).map_err(|err| corrupt(format!("bad config: {err}")))?;
        let initial_len = layout.payload_start + cfg.depth as usize * layout.initial_stride;
        if size < initial_len {
            return Err(corrupt(format!(
                "the memfd holds {size} bytes, expected {initial_len}"
            )));
        }
        Ok(Self {
            shared: map(fd, layout, &cfg)?,
        })
    }

    /// The memfd, to pass to other processes (which call [`open`](Self::open)).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.shared.fd.as_fd()
    }

    /// The writing end.
    ///
    /// # Panics
    ///
    /// If the channel's writer was taken before, in any process: a channel has one writer.
    pub fn writer(&self) -> ShmWriter {
        let ring = RingWriter::attach(self.shared.clone(), self.shared.spin)
            .expect("the writer of this shared-memory channel was taken before");
        let header = self.shared.header();
        let growth = Growth {
            region: header.region.load(Ordering::Acquire),
            stride: header.stride.load(Ordering::Acquire),
            file_len: header.file_len.load(Ordering::Acquire),
        };
        ShmWriter { ring, growth }
    }

    /// The reading end of reader `index`.
    ///
    /// # Panics
    ///
    /// If `index` is not below the configured reader count, or this reader was taken before.
    pub fn reader(&self, index: u32) -> ShmReader {
        let ring = RingReader::attach(self.shared.clone(), index, self.shared.spin)
            .unwrap_or_else(|| panic!("reader {index} of this shared-memory channel is out of range or was taken before"));
        let mut reader = ShmReader {
            ring,
            populated: self.shared.layout.payload_start as u64,
        };
        reader.populate_up_to(self.shared.header().file_len.load(Ordering::Acquire));
        reader
    }

    /// Closes the channel: every blocked or later write fails with `Closed`; readers get what
    /// was published, then `Closed`. Wakes every sleeper, in every process. Idempotent.
    pub fn close(&self) {
        self.shared.control().close();
    }

    pub fn is_closed(&self) -> bool {
        self.shared.control().is_closed()
    }
}

/// Maps the whole reservation of the channel on `fd`.
fn map(fd: OwnedFd, layout: Layout, cfg: &ShmConfig) -> Result<Arc<ShmShared>, RingError> {
    let map = MmapOptions::new()
        .len(layout.reserve)
        .no_reserve_swap()
        .map_raw(&fd)?;
    Ok(Arc::new(ShmShared {
        map,
        fd,
        layout,
        depth: cfg.depth,
        readers: cfg.readers,
        max_message_bytes: cfg.max_message_bytes,
        spin: cfg.spin,
    }))
}

/// The writer's copy of the growth state (it is the only one to change it).
#[derive(Debug)]
struct Growth {
    region: u64,
    stride: u64,
    file_len: u64,
}

/// The writing end of a shared-memory channel. Dropping it closes the channel.
#[derive(Debug)]
pub(crate) struct ShmWriter {
    ring: RingWriter<Arc<ShmShared>>,
    growth: Growth,
}

impl ShmWriter {
    /// Writes one message of kind `tag`. `encode` gets the slot's payload buffer and returns
    /// `Ok(bytes written)`, or `Err(bytes needed)` when the message does not fit; the writer
    /// then grows the channel and calls it again. Waits for a free slot until `deadline`.
    ///
    /// A message over `max_message_bytes` fails with [`RingError::TooLarge`] and is not sent;
    /// the channel stays usable. `Err(n)` with `n` not above the buffer's length is a broken
    /// encoder and fails with [`RingError::Corrupt`].
    pub fn write(
        &mut self,
        tag: u8,
        encode: &mut dyn FnMut(&mut [u8]) -> Result<usize, usize>,
        deadline: Option<Instant>,
    ) -> Result<(), RingError> {
        let seq = self.ring.reserve(deadline)?;
        let shared = self.ring.memory();
        let limit = shared.max_message_bytes;
        let slot = seq % u64::from(shared.depth);
        loop {
            let offset = (self.growth.region + slot * self.growth.stride) as usize;
            let capacity = (self.growth.stride as usize).min(limit);
            assert!(
                offset + capacity <= self.growth.file_len as usize,
                "slot out of the file"
            );
            // SAFETY: the range is inside the mapping and the file (asserted; the reservation
            // covers every region, the memfd never shrinks). Slot `seq % depth` is the
            // writer's alone until it publishes: `reserve` saw every reader release its
            // previous message (acquire), and readers reach this region only through the
            // slot's meta, which still points at the older message until the publish below.
            let buffer = unsafe {
                std::slice::from_raw_parts_mut(shared.map.as_mut_ptr().add(offset), capacity)
            };
            match encode(buffer) {
                Ok(len) if len <= capacity => {
                    let meta = shared.slot(seq);
                    meta.offset.store(offset as u64, Ordering::Relaxed);
                    meta.len.store(len as u64, Ordering::Relaxed);
                    meta.tag.store(u32::from(tag), Ordering::Relaxed);
                    self.ring.publish();
                    return Ok(());
                }
                Ok(len) => {
                    return Err(RingError::Corrupt(format!(
                        "encoder reported {len} bytes written into a buffer of {capacity}"
                    )));
                }
                Err(needed) if needed > limit => {
                    return Err(RingError::TooLarge {
                        size: needed,
                        limit,
                    });
                }
                Err(needed) if needed <= capacity => {
                    return Err(RingError::Corrupt(format!(
                        "encoder asked for {needed} bytes but was given {capacity}"
                    )));
                }
                Err(needed) => self.growth.grow(shared, needed)?,
            }
        }
    }
}

impl Growth {
    /// Gives every slot a new payload region of at least `needed` bytes at the end of the
    /// memfd, allocated and pre-faulted before any message uses it.
    fn grow(&mut self, shared: &ShmShared, needed: usize) -> Result<(), RingError> {
        let page = rustix::param::page_size();
        let stride = (2 * self.stride as usize)
            .max(needed.next_multiple_of(page))
            .min(shared.layout.max_stride);
        let region = self.file_len as usize;
        let depth = shared.depth as usize;
        let file_len = region + depth * stride;
        if file_len > shared.layout.reserve {
            return Err(RingError::Corrupt(format!(
                "growth to {file_len} bytes exceeds the {} reserved",
                shared.layout.reserve
            )));
        }
        rustix::fs::ftruncate(&shared.fd, file_len as u64).map_err(io::Error::from)?;
        // The file is longer from here on, whatever happens next: the next growth starts after.
        self.file_len = file_len as u64;
        shared.populate(region, depth * stride, true)?;
        let header = shared.header();
        header.file_len.store(file_len as u64, Ordering::Release);
        header.region.store(region as u64, Ordering::Release);
        header.stride.store(stride as u64, Ordering::Release);
        self.region = region as u64;
        self.stride = stride as u64;
        tracing::debug!(stride, file_len, "shared-memory channel grew");
        Ok(())
    }
}

/// A reading end of a shared-memory channel. Dropping it closes the channel, so that the
/// writer never waits for a reader that left.
#[derive(Debug)]
pub(crate) struct ShmReader {
    ring: RingReader<Arc<ShmShared>>,
    /// Payload bytes below this offset are pre-faulted in this process.
    populated: u64,
}

impl ShmReader {
    /// Waits until `deadline` for the next message and returns it in place; its slot is
    /// released when the frame is dropped.
    pub fn read(&mut self, deadline: Option<Instant>) -> Result<ShmFrame<'_>, RingError> {
        let (seq, tag, offset, len) = self.next(deadline)?;
        let shared = self.ring.memory();
        // SAFETY: `locate` checked that the range lies inside the mapping and below the file
        // length the writer published (acquire) before this message, and the memfd never
        // shrinks. The writer does not touch this slot's region until the frame releases it,
        // and the frame borrows this reader (so the mapping) for as long as the slice lives.
        let data = unsafe { std::slice::from_raw_parts(shared.map.as_ptr().add(offset), len) };
        Ok(ShmFrame {
            tag,
            data,
            reader: &mut self.ring,
            seq,
        })
    }

    /// Like [`read`](Self::read), but the message stays readable (and its slot taken) until
    /// the returned lease is dropped, on any thread, while this reader goes on reading. A lease
    /// kept for long stalls the writer once it comes around the ring to that slot.
    pub fn read_owned(&mut self, deadline: Option<Instant>) -> Result<ShmLease, RingError> {
        let (seq, tag, offset, len) = self.next(deadline)?;
        Ok(ShmLease {
            tag,
            offset,
            len,
            lease: self.ring.lease(seq),
        })
    }

    /// Acquires the next message and locates its payload.
    fn next(&mut self, deadline: Option<Instant>) -> Result<(u64, u8, usize, usize), RingError> {
        let seq = self.ring.acquire(deadline)?;
        match self.locate(seq) {
            Ok((tag, offset, len)) => Ok((seq, tag, offset, len)),
            Err(err) => {
                // Skip the broken message rather than wedge the ring.
                self.ring.release(seq);
                Err(err)
            }
        }
    }

    fn locate(&mut self, seq: u64) -> Result<(u8, usize, usize), RingError> {
        let shared = self.ring.memory();
        let meta = shared.slot(seq);
        let (offset, len) = (
            meta.offset.load(Ordering::Relaxed),
            meta.len.load(Ordering::Relaxed),
        );
        let tag = meta.tag.load(Ordering::Relaxed);
        let file_len = shared.header().file_len.load(Ordering::Acquire);
        let end = offset.checked_add(len);
        let in_bounds = offset >= shared.layout.payload_start as u64
            && end.is_some_and(|end| end <= file_len && end <= shared.map.len() as u64)
            && len <= shared.max_message_bytes as u64;
        let (Some(end), true, Ok(tag)) = (end, in_bounds, u8::try_from(tag)) else {
            return Err(RingError::Corrupt(format!(
                "message {seq}: payload at {offset}+{len} (tag {tag}) is outside the {file_len}-byte memfd"
            )));
        };
        if end > self.populated {
            self.populate_up_to(file_len);
        }
        Ok((tag, offset as usize, len as usize))
    }

    /// Pre-faults the payload regions below `file_len` that this process has not touched yet.
    fn populate_up_to(&mut self, file_len: u64) {
        if file_len > self.populated {
            let (from, len) = (
                self.populated as usize,
                (file_len - self.populated) as usize,
            );
            // Only an optimisation: a failure leaves page faults to the first reads.
            let _ = self.ring.memory().populate(from, len, false);
            self.populated = file_len;
        }
    }
}

/// A message read in place. Its slot is released when the frame is dropped.
pub(crate) struct ShmFrame<'a> {
    pub tag: u8,
    data: &'a [u8],
    reader: &'a mut RingReader<Arc<ShmShared>>,
    seq: u64,
}

impl ShmFrame<'_> {
    /// The payload, in shared memory.
    pub fn data(&self) -> &[u8] {
        self.data
    }
}

impl fmt::Debug for ShmFrame<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShmFrame")
            .field("tag", &self.tag)
            .field("seq", &self.seq)
            .field("len", &self.data.len())
            .finish()
    }
}

impl Drop for ShmFrame<'_> {
    fn drop(&mut self) {
        self.reader.release(self.seq);
    }
}

/// A message read in place that keeps its slot, and the mapping, until dropped. `Send` and
/// `AsRef<[u8]>`, so it can back a zero-copy `bytes::Bytes` (`Bytes::from_owner`).
#[derive(Debug)]
pub(crate) struct ShmLease {
    pub tag: u8,
    offset: usize,
    len: usize,
    lease: RingLease<Arc<ShmShared>>,
}

impl ShmLease {
    /// The payload, in shared memory.
    pub fn data(&self) -> &[u8] {
        let shared = self.lease.memory();
        // SAFETY: as in `ShmReader::read`: the range was checked against the mapping and the
        // file, and the slot stays unwritten until `self.lease` releases it on drop; the lease
        // holds an `Arc` of the mapping, and the slice borrows `self`.
        unsafe { std::slice::from_raw_parts(shared.map.as_ptr().add(self.offset), self.len) }
    }
}

impl AsRef<[u8]> for ShmLease {
    fn as_ref(&self) -> &[u8] {
        self.data()
    }
}
