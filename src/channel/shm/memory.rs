//! The shared-memory channel: a [ring](super::ring) whose words and payloads live in a memfd
//! mapped by every process that holds the fd.
//!
//! # Memory
//!
//! ```text
//! 0               ShmHeader: magic, version, config, growth state (atomics)
//! 128-aligned     RingControl: data/space wait cells, closed
//! 128-aligned     Cursor × readers (128 bytes each)
//! 128-aligned     slot lines × depth (128 bytes each): SlotMeta (the ring's stamp, where
//!                 the payload is, its tag), then up to INLINE_BYTES of a small payload
//! page-aligned    block of slot 0: BlockHeader (64 bytes: pin count), payload
//!                 block of slot 1, ... block of slot depth - 1 (stride0 bytes each)
//!                 blocks added later (growth, pinned blocks replaced) ...
//! ```
//!
//! The memfd is created with `MFD_CLOEXEC` (a crash leaves nothing in `/dev/shm` or in other
//! children) and sealed against shrinking, so that a mapped page can never vanish. Every
//! process maps a fixed, large range with `MAP_NORESERVE` (room for every growth up to
//! `max_message_bytes`), so a growth never remaps and never passes a new fd.
//!
//! # Blocks, growth and pins
//!
//! Every slot's payload lives in a *block*: a page-aligned range whose first 64 bytes are a
//! [`BlockHeader`] (its pin count) and the rest the payload, so payloads are 64-byte aligned.
//! The writer owns the assignment of blocks to slots (its [`Blocks`]); each slot's
//! [`SlotMeta`] names where its message's payload is, so readers follow without being told.
//!
//! A message that does not fit the slot's block raises the *stride* (max(2 × old, needed),
//! page-rounded, at most the page-rounded ceiling); a slot gets a block of the new stride the
//! next time it is written, carved at the end of the memfd (`ftruncate`, pre-faulted with
//! `MADV_POPULATE_WRITE`). Readers pre-fault (populate-read) new ranges the first time a frame
//! points into them.
//!
//! A reader may [pin](ShmFrame::pin) a message's block to keep reading its payload after
//! releasing the slot: that is how byte buffers and tensors are read in place (zero copy)
//! and kept as long as the user likes. When the writer comes round to a slot whose block is
//! pinned, it moves the slot to another block (an unpinned spare, or a new one) instead of
//! waiting: a value kept by a reader never stalls the graph. Blocks given up stay with the
//! writer: a few are kept for reuse, the memory of the others is given back to the kernel
//! (`FALLOC_FL_PUNCH_HOLE`), and a block too small for the current stride is never used again.
//! Only when the address space reserved for the channel is used up by pinned blocks does the
//! writer wait for readers to drop what they keep (up to its deadline, or the channel's close).
//!
//! # Small payloads in the slot's line
//!
//! A payload of at most [`INLINE_BYTES`] (a number, a short string, a small pickle) is written
//! right after its slot's [`SlotMeta`], in the 128 bytes the slot has anyway, instead of in
//! the slot's block: the reader, which polls the slot's stamp there, finds the payload on the
//! line it already fetched, one cross-core transfer instead of two. The writer tries there
//! first while the channel's payloads are that small (it stops trying after a larger one, and
//! tries again after the next small one). Such a payload is never kept in place: it holds no
//! attachment (those are at least `OUT_OF_BAND_MIN` bytes), and its memory is the slot's,
//! reused by the next message.
//!
//! A payload there is usually a *bare* body ([`Form::Bare`], a flag in the slot's tag word):
//! the value's postcard encoding alone, without the frame's header and table, which a small
//! value never needs. Writing and checking those cost a small message's write and read about a
//! third of their time (a `u64` written and read on one thread: ~100 ns, ~60 ns bare, with
//! the slot's index kept in step rather than divided out of the sequence number). Frames that
//! arrive whole (a network channel's relay) go into the line as they are ([`Form::Framed`]);
//! a bare body anywhere else is refused as corrupt.
//!
//! # References: a payload written once
//!
//! A payload that already lies in a pinned block (one read in place, kept by a value) is not
//! copied again when it is written to a channel whose readers map that block's memory: the
//! channel's own memory (a buffer the driver got back, sent again), or any channel of the same
//! graph when the channel's readers are all in the process that created the graph's channels
//! (the driver, which maps every one of them: [`ShmGroup`]). The frame then carries a
//! reference ([`frame`](crate::value::frame)), and the writer adds one pin of the block for
//! each of its readers before it publishes; each reader adopts one pin when it decodes the
//! frame. Every process finds the block of bytes it holds through a registry of the pinned
//! ranges it maps ([`ShmPin`] registers its range while it lives). The pin count never drops
//! to zero between the holder's pin and the readers' (the writer still holds its own while it
//! adds theirs), so the block's writer cannot reuse the block meanwhile (see
//! [`ring`](super::ring)'s pins).
//!
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use memmap2::{Advice, MmapOptions, MmapRaw};
use rustix::fs::{MemfdFlags, SealFlags};

pub(crate) use super::ring::RingError;
use super::ring::{Cursor, RingControl, RingMemory, RingReader, RingWriter};
use crate::channel::wait::DEFAULT_SPIN;
use crate::sync::{Arc, AtomicU32, AtomicU64, Ordering};
use crate::value::frame::{Location, Sharing};
use bytes::Bytes;

const MAGIC: u64 = u64::from_le_bytes(*b"adag-shm");
const VERSION: u32 = 5;
/// Limits that keep the layout arithmetic far from overflow.
const MAX_DEPTH: u32 = 1 << 16;
const MAX_READERS: u32 = 1 << 12;
const MAX_MESSAGE_BYTES: usize = 1 << 40;

/// Bytes of shared memory per slot: its [`SlotMeta`], then room for a small payload.
const SLOT_LINE: usize = 128;
/// Where a small payload starts in its slot's line: right after the [`SlotMeta`].
const INLINE_AT: usize = 32;
/// The largest frame written in its slot's line (see the module docs).
const INLINE_BYTES: usize = SLOT_LINE - INLINE_AT;
/// Set in a slot's tag word when its payload is a bare body ([`Form::Bare`]).
const BARE_FORM: u32 = 1 << 8;

/// What a payload written into a channel is, as the reader must decode it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Form {
    /// A whole [frame](crate::value::frame): header, body, table, attachments.
    Framed,
    /// A frame's body alone, with no header and no attachment (only in a slot's line).
    Bare,
}

/// What an encoder wrote into the room it was given.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Written {
    pub len: usize,
    pub form: Form,
}

/// What writes a message's payload into the room it is given ([`ShmWriter::write`]): what it
/// wrote, or `Err(bytes needed)`.
pub(crate) type Encoder<'a> = dyn FnMut(&mut [u8], Room) -> Result<Written, usize> + 'a;

/// Where an encoder writes ([`ShmWriter::write`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Room {
    /// The slot's own line: small, and the reader fetches it anyway. A bare body may go here.
    SlotLine,
    /// A block: a whole frame only.
    Block,
}

/// Bytes before the payload in every block: its [`BlockHeader`].
const BLOCK_HEADER: usize = 64;
/// Address space reserved per slot, in units of the largest stride: the regions of every
/// growth take less than 3, the rest is room for blocks that readers keep pinned.
const RESERVED_STRIDES_PER_SLOT: usize = 8;
/// How often a writer that found every block pinned and no room for another looks again.
const PINNED_POLL: Duration = Duration::from_millis(1);

/// How much of each slot is pre-faulted when a channel is created.
const PREFAULT_PER_SLOT: usize = 64 * 1024;

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
    /// The graph's channels share this nonzero id when one process creates them all and keeps
    /// them mapped while the graph lives (0: no group).
    pub group: u64,
    /// Every reader of this channel is in the process that created the group, so it maps every
    /// channel of the group: a payload in any of them may be written by reference.
    pub readers_map_group: bool,
}

impl Default for ShmConfig {
    fn default() -> Self {
        Self {
            depth: 8,
            readers: 1,
            slot_bytes: 4096,
            max_message_bytes: 1 << 30,
            spin: DEFAULT_SPIN,
            group: 0,
            readers_map_group: false,
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
    /// Written by the writer only: the stride of new blocks, and the memfd's length (every
    /// byte below it is backed and mapped).
    stride: AtomicU64,
    file_len: AtomicU64,
    /// A random id of this channel's memory, which references name.
    uid: AtomicU64,
    /// [`ShmConfig::group`] and [`ShmConfig::readers_map_group`].
    group: AtomicU64,
    readers_map_group: AtomicU32,
}

/// The first bytes of every block.
#[repr(C, align(64))]
#[derive(Debug)]
struct BlockHeader {
    /// Readers that keep this block's payload past the release of its slot (see
    /// [`ring::pin`](super::ring::pin)).
    pins: AtomicU32,
    /// The block's size, header included; written by the writer before a message uses it.
    size: AtomicU64,
}

const _: () = assert!(size_of::<BlockHeader>() == BLOCK_HEADER);

/// Where the payload of the message in a slot is: inside a block, right after its header, or
/// in the slot's own line, right after this. Written by the writer before it publishes, which
/// stores `stamp` (the ring's, see [`RingMemory::stamp`]): a reader polls the line it reads
/// next. The first [`INLINE_AT`] bytes of the slot's [`SLOT_LINE`]; the rest is a small
/// payload's, reached by raw pointer as block payloads are (so no reference covers it).
#[repr(C, align(32))]
#[derive(Debug)]
struct SlotMeta {
    stamp: AtomicU64,
    offset: AtomicU64,
    len: AtomicU64,
    tag: AtomicU32,
}

const _: () = assert!(size_of::<SlotMeta>() == INLINE_AT && SLOT_LINE.is_multiple_of(128));

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
// SAFETY: as above.
unsafe impl Shared for BlockHeader {}

/// Offsets of everything in the mapping, derived from the configuration alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Layout {
    control: usize,
    cursors: usize,
    slots: usize,
    /// First payload byte; page-aligned. Everything below is header.
    payload_start: usize,
    /// Size of the first block of every slot (header included).
    initial_stride: usize,
    /// Largest block a growth may make (the page-rounded ceiling, header included).
    max_stride: usize,
    /// Bytes of address space each process maps: room for every growth and pinned blocks.
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
        let payload_start = (slots + cfg.depth as usize * SLOT_LINE).next_multiple_of(page);
        let initial_stride = (cfg.slot_bytes + BLOCK_HEADER).next_multiple_of(page);
        let max_stride = (cfg.max_message_bytes + BLOCK_HEADER).next_multiple_of(page);
        let reserve = cfg.depth as usize * RESERVED_STRIDES_PER_SLOT;
        let reserve = reserve
            .checked_mul(max_stride)
            .and_then(|r| r.checked_add(payload_start))
            .filter(|r| *r <= isize::MAX as usize)
            .ok_or_else(|| {
                invalid(format!(
                    "depth {} × max_message_bytes {} needs more address space than there is",
                    cfg.depth, cfg.max_message_bytes
                ))
            })?;
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
    uid: u64,
    group: u64,
    readers_map_group: bool,
}

impl ShmShared {
    fn at<T: Shared>(&self, offset: usize) -> &T {
        view(&self.map, self.layout.payload_start, offset)
    }

    fn header(&self) -> &ShmHeader {
        self.at(0)
    }

    fn slot(&self, slot: usize) -> &SlotMeta {
        self.at(self.slot_line(slot))
    }

    /// Offset of the line of slot `slot` (`< depth`).
    fn slot_line(&self, slot: usize) -> usize {
        debug_assert!(slot < self.depth as usize, "slot {slot} of {}", self.depth);
        self.layout.slots + slot * SLOT_LINE
    }

    /// Offset of the room for a small payload in the line of slot `slot`.
    fn inline_at(&self, slot: usize) -> usize {
        self.slot_line(slot) + INLINE_AT
    }

    /// The header of the block at `at`, below the file length `file_len`.
    fn block(&self, at: usize, file_len: usize) -> &BlockHeader {
        view(&self.map, file_len, at)
    }

    /// Records the size of the block at `at` in its header, before a message uses it.
    fn stamp_block(&self, at: usize, size: usize, file_len: usize) {
        self.block(at, file_len)
            .size
            .store(size as u64, Ordering::Relaxed);
    }

    /// Gives the memory of `len` bytes at `offset` back to the kernel; the range reads as
    /// zeros afterwards (and allocates again when written). Nobody may be reading it.
    fn punch(&self, offset: usize, len: usize) {
        let flags = rustix::fs::FallocateFlags::PUNCH_HOLE | rustix::fs::FallocateFlags::KEEP_SIZE;
        if let Err(err) = rustix::fs::fallocate(&self.fd, flags, offset as u64, len as u64) {
            // Only memory use: the range stays valid.
            tracing::debug!(%err, offset, len, "could not punch a hole in a channel's memfd");
        }
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

    fn stamp(&self, slot: usize) -> &AtomicU64 {
        &self.slot(slot).stamp
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
        let mut uid = [0u8; 8];
        getrandom::fill(&mut uid).map_err(|e| io::Error::other(e.to_string()))?;
        let uid = u64::from_le_bytes(uid);
        let shared = map(fd, layout, cfg, uid)?;
        // Pre-fault the header and the first PREFAULT_PER_SLOT bytes of every slot: small
        // messages never fault, and compiling stays fast (faulting 10 x 1 MB per edge cost
        // ~10 ms per edge). The rest of a large slot faults once, on its first use.
        shared.populate(0, layout.payload_start, true)?;
        let per_slot = layout.initial_stride.min(PREFAULT_PER_SLOT);
        for slot in 0..cfg.depth as usize {
            let block = layout.payload_start + slot * layout.initial_stride;
            shared.populate(block, per_slot, true)?;
            shared.stamp_block(block, layout.initial_stride, file_len);
        }
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
            .stride
            .store(layout.initial_stride as u64, Ordering::Relaxed);
        header.file_len.store(file_len as u64, Ordering::Relaxed);
        header.uid.store(shared.uid, Ordering::Relaxed);
        header.group.store(cfg.group, Ordering::Relaxed);
        header
            .readers_map_group
            .store(u32::from(cfg.readers_map_group), Ordering::Relaxed);
        shared.control().init(cfg.depth, cfg.readers);
        header.magic.store(MAGIC, Ordering::Release);
        Ok(Self { shared })
    }

    /// Maps the channel created (in this or another process) on the memfd `fd`; the header
    /// tells its configuration.
    pub fn open(fd: OwnedFd) -> Result<Self, RingError> {
        let seals = rustix::fs::fcntl_get_seals(&fd).map_err(io::Error::from)?;
        if !seals.contains(SealFlags::SHRINK) {
            return Err(RingError::Corrupt(
                "the memfd is not sealed against shrinking".into(),
            ));
        }
        let size = rustix::fs::fstat(&fd).map_err(io::Error::from)?.st_size as usize;
        if size < size_of::<ShmHeader>() {
            return Err(RingError::Corrupt(format!(
                "the memfd holds {size} bytes, less than a header"
            )));
        }
        let (cfg, uid) = {
            let probe = MmapOptions::new()
                .len(size_of::<ShmHeader>())
                .map_raw_read_only(&fd)?;
            let header: &ShmHeader = view(&probe, size, 0);
            let magic = header.magic.load(Ordering::Acquire);
            if magic != MAGIC {
                return Err(RingError::Corrupt(format!(
                    "bad magic {magic:#x}: not an adag channel"
                )));
            }
            let version = header.version.load(Ordering::Relaxed);
            if version != VERSION {
                return Err(RingError::Corrupt(format!(
                    "layout version {version}, expected {VERSION}"
                )));
            }
            let cfg = ShmConfig {
                depth: header.depth.load(Ordering::Relaxed),
                readers: header.readers.load(Ordering::Relaxed),
                slot_bytes: header.slot_bytes.load(Ordering::Relaxed) as usize,
                max_message_bytes: header.max_message_bytes.load(Ordering::Relaxed) as usize,
                spin: Duration::from_nanos(header.spin_ns.load(Ordering::Relaxed)),
                group: header.group.load(Ordering::Relaxed),
                readers_map_group: header.readers_map_group.load(Ordering::Relaxed) != 0,
            };
            (cfg, header.uid.load(Ordering::Relaxed))
        };
        let layout =
            Layout::new(&cfg).map_err(|err| RingError::Corrupt(format!("bad config: {err}")))?;
        let initial_len = layout.payload_start + cfg.depth as usize * layout.initial_stride;
        if size < initial_len {
            return Err(RingError::Corrupt(format!(
                "the memfd holds {size} bytes, expected {initial_len}"
            )));
        }
        Ok(Self {
            shared: map(fd, layout, &cfg, uid)?,
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
        let layout = &self.shared.layout;
        let blocks = Blocks {
            current: (0..self.shared.depth as usize)
                .map(|slot| Block {
                    at: layout.payload_start + slot * layout.initial_stride,
                    size: layout.initial_stride,
                    backed: true,
                })
                .collect(),
            kept: Vec::new(),
            free: Vec::new(),
            stride: layout.initial_stride,
            file_len: self.shared.header().file_len.load(Ordering::Acquire) as usize,
        };
        ShmWriter {
            ring,
            blocks,
            small_frames: true,
        }
    }

    /// The reading end of reader `index`.
    ///
    /// # Panics
    ///
    /// If `index` is not below the configured reader count, or this reader was taken before.
    pub fn reader(&self, index: u32) -> ShmReader {
        let ring = RingReader::attach(self.shared.clone(), index, self.shared.spin)
            .unwrap_or_else(|| panic!("reader {index} of this shared-memory channel is out of range or was taken before"));
        // The initial regions map in on first read (once); regions made by growth later are
        // pre-faulted when first seen.
        ShmReader {
            ring,
            populated: self.shared.header().file_len.load(Ordering::Acquire),
            group: ShmGroup::default(),
        }
    }

    /// Closes the channel: every blocked or later write fails with `Closed`; readers get what
    /// was published, then `Closed`. Wakes every sleeper, in every process. Idempotent.
    pub fn close(&self) {
        self.shared.control().close();
    }

    #[allow(dead_code)] // Part of the channel API; only the tests ask yet.
    pub fn is_closed(&self) -> bool {
        self.shared.control().is_closed()
    }
}

/// Maps the whole reservation of the channel on `fd`.
fn map(
    fd: OwnedFd,
    layout: Layout,
    cfg: &ShmConfig,
    uid: u64,
) -> Result<Arc<ShmShared>, RingError> {
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
        uid,
        group: cfg.group,
        readers_map_group: cfg.readers_map_group,
    }))
}

/// A block: `size` bytes at `at` in the memfd, its header first.
#[derive(Clone, Copy, Debug)]
struct Block {
    at: usize,
    size: usize,
    /// Whether its pages are allocated (false once its memory was punched out).
    backed: bool,
}

impl Block {
    fn payload(&self) -> usize {
        self.at + BLOCK_HEADER
    }

    fn capacity(&self) -> usize {
        self.size - BLOCK_HEADER
    }
}

/// The writer's map of blocks (it alone allocates them and assigns them to slots).
#[derive(Debug)]
struct Blocks {
    /// The block of each slot.
    current: Vec<Block>,
    /// Blocks that left their slot while pinned; each is reused or given back once unpinned.
    kept: Vec<Block>,
    /// Unpinned blocks out of any slot, at least `stride` bytes each, ready for reuse.
    free: Vec<Block>,
    /// Size of new blocks.
    stride: usize,
    /// The memfd's length: new blocks are carved from here.
    file_len: usize,
}

impl Blocks {
    /// The block for the next message of `slot`: the slot's own when it is unpinned and big
    /// enough, else another one (the slot's old block is kept while pinned).
    fn ready(
        &mut self,
        shared: &Arc<ShmShared>,
        slot: usize,
        deadline: Option<Instant>,
    ) -> Result<Block, RingError> {
        let block = self.current[slot];
        let pinned = super::ring::is_pinned(&shared.block(block.at, self.file_len).pins);
        if !pinned && block.size >= self.stride {
            return Ok(block);
        }
        if pinned {
            // Kept from now on: `take` may hand it back (to this slot) once it is unpinned.
            self.kept.push(block);
        }
        match self.take(shared, deadline) {
            Ok(fresh) => {
                if !pinned {
                    // Smaller than the stride: never used again.
                    shared.punch(block.at, block.size);
                }
                self.current[slot] = fresh;
                Ok(fresh)
            }
            Err(err) => {
                // The slot keeps its block: it must not stay in a list of blocks to hand out.
                // It can be in `free` only when `take` failed to populate another, unbacked
                // block; then it was punched too, and its header with it.
                self.kept.retain(|b| b.at != block.at);
                self.free.retain(|b| b.at != block.at);
                shared.stamp_block(block.at, block.size, self.file_len);
                Err(err)
            }
        }
    }

    /// An unpinned block of `stride` bytes out of any slot: a spare one, or a new one at the
    /// end of the memfd; waits while every block is pinned and the reservation is used up.
    fn take(
        &mut self,
        shared: &Arc<ShmShared>,
        deadline: Option<Instant>,
    ) -> Result<Block, RingError> {
        // Set once every block is pinned and no room is left: when the wait began.
        let mut waiting_since: Option<Instant> = None;
        loop {
            self.collect_unpinned(shared);
            let backed_first = self.free.iter().position(|b| b.backed);
            let spare = match backed_first {
                Some(index) => Some(self.free.swap_remove(index)),
                None => self.free.pop(),
            };
            if let Some(mut block) = spare {
                if !block.backed {
                    shared.populate(block.at, block.size, true)?;
                    block.backed = true;
                    // Its header went with its memory.
                    shared.stamp_block(block.at, block.size, self.file_len);
                }
                return Ok(block);
            }
            if self.file_len + self.stride <= shared.layout.reserve {
                return self.carve(shared);
            }
            let since = *waiting_since.get_or_insert_with(|| {
                tracing::warn!(
                    blocks = self.kept.len(),
                    "every block of a shared-memory channel is pinned by values its readers \
                     keep; the writer waits until some are dropped"
                );
                Instant::now()
            });
            if shared.control().is_closed() {
                return Err(RingError::Closed);
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(RingError::Timeout);
            }
            tracing::trace!(waited = ?since.elapsed(), "waiting for a pinned block");
            std::thread::sleep(PINNED_POLL);
        }
    }

    /// Moves the kept blocks that readers let go of to `free` (those still big enough; the
    /// others give their memory back and are forgotten), and gives back the memory of free
    /// blocks beyond one per slot.
    fn collect_unpinned(&mut self, shared: &ShmShared) {
        let (file_len, stride) = (self.file_len, self.stride);
        let mut released = Vec::new();
        self.kept.retain(|block| {
            let pinned = super::ring::is_pinned(&shared.block(block.at, file_len).pins);
            if !pinned {
                released.push(*block);
            }
            pinned
        });
        self.free.extend(released);
        self.free.retain(|block| {
            let fits = block.size >= stride;
            if !fits && block.backed {
                shared.punch(block.at, block.size);
            }
            fits
        });
        for block in self.free.iter_mut().skip(shared.depth as usize) {
            if block.backed {
                shared.punch(block.at, block.size);
                block.backed = false;
            }
        }
    }

    /// A new block of `stride` bytes at the end of the memfd, allocated and pre-faulted.
    fn carve(&mut self, shared: &ShmShared) -> Result<Block, RingError> {
        self.carve_sized(shared, self.stride)
    }

    /// A block to lend for `len` payload bytes: a spare one, or a new one, without changing
    /// the stride (a large loan must not make every slot's block large), and without waiting.
    fn lend(&mut self, shared: &Arc<ShmShared>, len: usize) -> Result<Block, RingError> {
        let size = (len + BLOCK_HEADER).next_multiple_of(rustix::param::page_size());
        if size <= self.stride {
            return self.take(shared, Some(crate::channel::passed()));
        }
        self.collect_unpinned(shared);
        if let Some(index) = self.free.iter().position(|b| b.size >= size) {
            let mut block = self.free.swap_remove(index);
            if !block.backed {
                shared.populate(block.at, block.size, true)?;
                block.backed = true;
                shared.stamp_block(block.at, block.size, self.file_len);
            }
            return Ok(block);
        }
        if self.file_len + size > shared.layout.reserve {
            return Err(RingError::Timeout);
        }
        self.carve_sized(shared, size)
    }

    /// A new block of `size` bytes at the end of the memfd, allocated and pre-faulted.
    fn carve_sized(&mut self, shared: &ShmShared, size: usize) -> Result<Block, RingError> {
        let block = Block {
            at: self.file_len,
            size,
            backed: true,
        };
        let file_len = block.at + block.size;
        rustix::fs::ftruncate(&shared.fd, file_len as u64).map_err(io::Error::from)?;
        // The file is longer from here on, whatever happens next: the next block starts after.
        self.file_len = file_len;
        shared.populate(block.at, block.size, true)?;
        shared.stamp_block(block.at, block.size, file_len);
        shared
            .header()
            .file_len
            .store(file_len as u64, Ordering::Release);
        Ok(block)
    }

    /// Raises the stride so that a message of `needed` bytes fits a new block.
    fn grow(&mut self, shared: &ShmShared, needed: usize) {
        let page = rustix::param::page_size();
        self.stride = (2 * self.stride)
            .max((needed + BLOCK_HEADER).next_multiple_of(page))
            .min(shared.layout.max_stride);
        shared
            .header()
            .stride
            .store(self.stride as u64, Ordering::Release);
        tracing::debug!(stride = self.stride, "shared-memory channel grew");
    }
}

/// The writing end of a shared-memory channel. Dropping it closes the channel.
#[derive(Debug)]
pub(crate) struct ShmWriter {
    ring: RingWriter<Arc<ShmShared>>,
    blocks: Blocks,
    /// Whether the next frame is first tried in its slot's line: the last one fitted there.
    small_frames: bool,
}

impl ShmWriter {
    /// How frames written here refer to payloads already in shared memory (see [`Sharing`]).
    pub fn sharing(&self) -> WriteSharing {
        WriteSharing {
            target: self.ring.memory().clone(),
        }
    }

    /// A block of this channel's memory for `len` bytes built in place (a loan), pinned until
    /// the returned memory and every value made from it are dropped: written to this channel,
    /// its bytes travel by reference. Never waits: when every block is pinned and no room is
    /// left it fails with [`RingError::Timeout`].
    pub fn loan(&mut self, len: usize) -> Result<ShmLoan, RingError> {
        let shared = self.ring.memory().clone();
        if len > shared.max_message_bytes {
            return Err(RingError::TooLarge {
                size: len,
                limit: shared.max_message_bytes,
            });
        }
        let block = self.blocks.lend(&shared, len)?;
        super::ring::pin(&shared.block(block.at, self.blocks.file_len).pins);
        // Kept from now on: back among the free blocks once every pin is dropped.
        self.blocks.kept.push(block);
        Ok(ShmLoan(ShmPin::hold(
            shared,
            block.at,
            block.payload(),
            len,
        )))
    }

    /// [`write`](Self::write) with an encoder of whole frames only, wherever it writes.
    pub fn write_framed(
        &mut self,
        tag: u8,
        encode: &mut dyn FnMut(&mut [u8]) -> Result<usize, usize>,
        deadline: Option<Instant>,
    ) -> Result<u64, RingError> {
        self.write(
            tag,
            &mut |buf: &mut [u8], _: Room| {
                encode(buf).map(|len| Written {
                    len,
                    form: Form::Framed,
                })
            },
            deadline,
        )
    }

    /// Writes one message of kind `tag`. `encode` gets a payload buffer and what it is (the
    /// room in the slot's line while frames are small, else the slot's block, 64-byte aligned)
    /// and returns what it wrote, or `Err(bytes needed)` when the message does not fit; the
    /// writer then tries the block, or grows the channel, and calls it again (an answer from
    /// the slot's line only says "not here": the block's attempt tells the size). Waits for a
    /// free slot until `deadline`. Returns how many times the channel grew for this message.
    ///
    /// A message over `max_message_bytes` fails with [`RingError::TooLarge`] and is not sent;
    /// the channel stays usable. `Err(n)` with `n` not above the buffer's length is a broken
    /// encoder and fails with [`RingError::Corrupt`].
    pub fn write(
        &mut self,
        tag: u8,
        encode: &mut Encoder<'_>,
        deadline: Option<Instant>,
    ) -> Result<u64, RingError> {
        self.ring.reserve(deadline)?;
        let mut growths = 0;
        let slot = self.ring.slot();
        let shared = self.ring.memory();
        let limit = shared.max_message_bytes;
        if self.small_frames {
            let at = shared.inline_at(slot);
            let capacity = INLINE_BYTES.min(limit);
            assert!(
                at + INLINE_BYTES <= shared.layout.payload_start,
                "slot line out of the header"
            );
            // Encoded aside, then copied in one go: the reader polls this line, and each of
            // its looks while the encoder wrote here would take the line back. The whole room
            // is copied, a fixed size: a few vector moves instead of a call to `memmove`.
            let mut staged = [0u8; INLINE_BYTES];
            match encode(&mut staged[..capacity], Room::SlotLine) {
                Ok(written) if written.len <= capacity => {
                    // SAFETY: the range is inside the mapping's header part (asserted), which
                    // is backed from creation on, and no reference covers it (`SlotMeta` ends
                    // where it starts). Nobody else touches it until the publish below:
                    // `reserve` saw every reader release the slot's previous message
                    // (acquire), and a small frame is never kept past its release (see the
                    // module docs).
                    let room = unsafe {
                        &mut *shared.map.as_mut_ptr().add(at).cast::<[u8; INLINE_BYTES]>()
                    };
                    *room = staged;
                    publish_frame(&mut self.ring, slot, at, written, tag);
                    return Ok(growths);
                }
                Ok(written) => {
                    return Err(RingError::Corrupt(format!(
                        "encoder reported {} bytes written into a buffer of {capacity}",
                        written.len
                    )));
                }
                // Not in the line: the block's attempt tells how large it is.
                Err(_) => self.small_frames = false,
            }
        }
        loop {
            let block = self.blocks.ready(shared, slot, deadline)?;
            let capacity = block.capacity().min(limit);
            assert!(
                block.payload() + capacity <= self.blocks.file_len,
                "block out of the file"
            );
            // SAFETY: the range is inside the mapping and the file (asserted; the reservation
            // covers every block, the memfd never shrinks). Nobody else touches it until the
            // publish below: `reserve` saw every reader release the slot's previous message
            // (acquire), `ready` saw the block unpinned (acquire), and readers reach a block
            // only through a slot's meta (this slot's still names the older message) or a pin.
            let buffer = unsafe {
                std::slice::from_raw_parts_mut(
                    shared.map.as_mut_ptr().add(block.payload()),
                    capacity,
                )
            };
            match encoded(encode(buffer, Room::Block), capacity, limit)? {
                Ok(written) if written.form == Form::Bare => {
                    return Err(RingError::Corrupt(
                        "encoder wrote a bare body into a block; only a slot's line takes one"
                            .into(),
                    ));
                }
                Ok(written) => {
                    self.small_frames = written.len <= INLINE_BYTES;
                    publish_frame(&mut self.ring, slot, block.payload(), written, tag);
                    return Ok(growths);
                }
                Err(needed) if needed <= capacity => {
                    return Err(RingError::Corrupt(format!(
                        "encoder asked for {needed} bytes but was given {capacity}"
                    )));
                }
                Err(needed) => {
                    growths += 1;
                    self.blocks.grow(shared, needed);
                }
            }
        }
    }
}

/// What an encoder's answer means for a buffer of `capacity` bytes, under the channel's
/// `limit`: `Ok(Ok(len))` written, `Ok(Err(needed))` too small for it, or the error to report.
fn encoded(
    answer: Result<Written, usize>,
    capacity: usize,
    limit: usize,
) -> Result<Result<Written, usize>, RingError> {
    match answer {
        Ok(written) if written.len <= capacity => Ok(Ok(written)),
        Ok(written) => Err(RingError::Corrupt(format!(
            "encoder reported {} bytes written into a buffer of {capacity}",
            written.len
        ))),
        Err(needed) if needed > limit => Err(RingError::TooLarge {
            size: needed,
            limit,
        }),
        Err(needed) => Ok(Err(needed)),
    }
}

/// Describes the reserved message (its payload `written` at `offset`, its `tag`) in its slot,
/// `slot`, and publishes it.
fn publish_frame(
    ring: &mut RingWriter<Arc<ShmShared>>,
    slot: usize,
    offset: usize,
    written: Written,
    tag: u8,
) {
    let meta = ring.memory().slot(slot);
    let form = match written.form {
        Form::Framed => 0,
        Form::Bare => BARE_FORM,
    };
    meta.offset.store(offset as u64, Ordering::Relaxed);
    meta.len.store(written.len as u64, Ordering::Relaxed);
    meta.tag.store(u32::from(tag) | form, Ordering::Relaxed);
    ring.publish();
}

#[cfg(all(test, not(loom)))]
impl ShmWriter {
    /// How many of the blocks this writer knows of are pinned (tests: 0 once every value that
    /// kept a payload was dropped).
    pub fn pinned_blocks(&self) -> usize {
        let shared = self.ring.memory();
        let (blocks, file_len) = (&self.blocks, self.blocks.file_len);
        blocks
            .current
            .iter()
            .chain(&blocks.kept)
            .chain(&blocks.free)
            .filter(|b| super::ring::is_pinned(&shared.block(b.at, file_len).pins))
            .count()
    }
}

/// A reading end of a shared-memory channel. Dropping it closes the channel, so that the
/// writer never waits for a reader that left.
#[derive(Debug)]
pub(crate) struct ShmReader {
    ring: RingReader<Arc<ShmShared>>,
    /// Payload bytes below this offset are pre-faulted in this process.
    populated: u64,
    /// The channels whose memory a reference in this channel may point into.
    group: ShmGroup,
}

impl ShmReader {
    /// Resolves references to the memory of the channels of `group` (this process maps them).
    pub fn in_group(mut self, group: ShmGroup) -> Self {
        self.group = group;
        self
    }

    /// Waits until `deadline` for the next message and returns it in place; its slot is
    /// released when the frame is dropped.
    pub fn read(&mut self, deadline: Option<Instant>) -> Result<ShmFrame<'_>, RingError> {
        let (
            seq,
            Located {
                tag,
                form,
                offset,
                len,
            },
        ) = self.next(deadline)?;
        let shared = self.ring.memory();
        // SAFETY: `locate` checked that the range lies inside the mapping and below the file
        // length the writer published (acquire) before this message, and the memfd never
        // shrinks. The writer does not touch this slot's region until the frame releases it,
        // and the frame borrows this reader (so the mapping) for as long as the slice lives.
        let data = unsafe { std::slice::from_raw_parts(shared.map.as_ptr().add(offset), len) };
        Ok(ShmFrame {
            tag,
            form,
            data,
            offset,
            reader: &mut self.ring,
            group: &self.group,
            seq,
        })
    }

    /// Acquires the next message and locates its payload.
    fn next(&mut self, deadline: Option<Instant>) -> Result<(u64, Located), RingError> {
        let (seq, slot) = self.ring.acquire(deadline)?;
        match self.locate(seq, slot) {
            Ok(located) => Ok((seq, located)),
            Err(err) => {
                // Skip the broken message rather than wedge the ring.
                self.ring.release(seq);
                Err(err)
            }
        }
    }

    /// Where message `seq`, in slot `slot`, is.
    fn locate(&mut self, seq: u64, slot: usize) -> Result<Located, RingError> {
        let shared = self.ring.memory();
        let meta = shared.slot(slot);
        let (offset, len) = (
            meta.offset.load(Ordering::Relaxed),
            meta.len.load(Ordering::Relaxed),
        );
        let word = meta.tag.load(Ordering::Relaxed);
        let (tag, form) = match word & BARE_FORM {
            0 => (word, Form::Framed),
            _ => (word & !BARE_FORM, Form::Bare),
        };
        let file_len = shared.header().file_len.load(Ordering::Acquire);
        let end = offset.checked_add(len);
        let small = offset == shared.inline_at(slot) as u64;
        let in_bounds = if small {
            len <= INLINE_BYTES as u64
        } else {
            // A bare body is only ever written in the slot's line.
            form == Form::Framed
                && offset >= (shared.layout.payload_start + BLOCK_HEADER) as u64
                && offset % BLOCK_HEADER as u64 == 0
                && end.is_some_and(|end| end <= file_len && end <= shared.map.len() as u64)
        } && len <= shared.max_message_bytes as u64;
        let (Some(end), true, Ok(tag)) = (end, in_bounds, u8::try_from(tag)) else {
            return Err(RingError::Corrupt(format!(
                "message {seq}: payload at {offset}+{len} (tag {tag}, {form:?}) is outside the {file_len}-byte memfd or its slot's line"
            )));
        };
        if !small && end > self.populated {
            self.populate_up_to(file_len);
        }
        Ok(Located {
            tag,
            form,
            offset: offset as usize,
            len: len as usize,
        })
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

/// Where a message's payload is, as its slot describes it.
struct Located {
    tag: u8,
    form: Form,
    offset: usize,
    len: usize,
}

/// A message read in place. Its slot is released when the frame is dropped.
pub(crate) struct ShmFrame<'a> {
    pub tag: u8,
    /// How to decode [`data`](Self::data).
    pub form: Form,
    data: &'a [u8],
    /// Where `data` starts in the mapping: right after its block's header.
    offset: usize,
    reader: &'a mut RingReader<Arc<ShmShared>>,
    group: &'a ShmGroup,
    seq: u64,
}

impl ShmFrame<'_> {
    /// The payload, in shared memory.
    pub fn data(&self) -> &[u8] {
        self.data
    }

    /// The payload bytes of the block this frame is in: what a [pin](Self::pin) keeps.
    /// `usize::MAX` for a small frame in its slot's line, which is never kept in place
    /// (nothing in it fills a quarter of that).
    pub fn block_capacity(&self) -> usize {
        if self.is_small() {
            return usize::MAX;
        }
        let block = self
            .reader
            .memory()
            .block(self.offset - BLOCK_HEADER, self.offset);
        (block.size.load(Ordering::Relaxed) as usize).saturating_sub(BLOCK_HEADER)
    }

    /// Keeps the payload readable, in place, after this frame releases its slot, until the
    /// pin is dropped (on any thread). The writer moves the slot to another block meanwhile.
    pub fn pin(&self) -> ShmPin {
        assert!(
            !self.is_small(),
            "a small frame in its slot's line is never kept in place"
        );
        let shared = self.reader.memory().clone();
        let block = self.offset - BLOCK_HEADER;
        let end = self.offset + self.data.len();
        // Before the slot's release (in this frame's drop): see `ring::pin`.
        super::ring::pin(&shared.block(block, end).pins);
        ShmPin::hold(shared, block, self.offset, self.data.len())
    }

    /// Whether the payload is in the slot's line (a small frame) rather than in a block.
    fn is_small(&self) -> bool {
        self.offset < self.reader.memory().layout.payload_start
    }

    /// How this frame adopts the references it carries (see [`Sharing::adopt`]).
    pub fn sharing(&self) -> ReadSharing<'_> {
        ReadSharing {
            own: self.reader.memory(),
            group: self.group,
        }
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

/// Payload bytes kept readable in place after their slot was released: their block stays
/// pinned, and the mapping alive, until this is dropped. `Send` and `AsRef<[u8]>`, so it can
/// back a zero-copy `bytes::Bytes` (`Bytes::from_owner`). While it lives its range is in this
/// process's registry of pinned ranges, so that the bytes can be written by reference.
#[derive(Debug)]
pub(crate) struct ShmPin {
    shared: Arc<ShmShared>,
    /// The block's offset in the memfd.
    block: usize,
    /// The bytes' offset in the memfd (after the block's header) and length.
    offset: usize,
    len: usize,
    /// Its key in the registry.
    key: u64,
}

/// A pinned range of a mapping in this process.
struct Region {
    end: usize,
    shared: Arc<ShmShared>,
    block: usize,
}

/// The pinned ranges this process maps, by their start address (and a unique key: ranges
/// may overlap, when one block is pinned twice).
static PINNED: std::sync::Mutex<BTreeMap<(usize, u64), Region>> =
    std::sync::Mutex::new(BTreeMap::new());
static NEXT_KEY: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
/// Ranges looked at before a lookup gives up (overlapping pins of one address are few).
const LOOKUP_SCAN: usize = 64;

fn pinned() -> std::sync::MutexGuard<'static, BTreeMap<(usize, u64), Region>> {
    // The map stays consistent whatever panicked while it was held (single inserts/removes).
    PINNED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The pinned range that holds all of `bytes`: its mapping and block, and where `bytes` start
/// in the memfd.
fn pinned_range(bytes: &[u8]) -> Option<(Arc<ShmShared>, usize, usize)> {
    let (ptr, len) = (bytes.as_ptr() as usize, bytes.len());
    let map = pinned();
    map.range(..=(ptr, u64::MAX))
        .rev()
        .take(LOOKUP_SCAN)
        .find(|((start, _), region)| ptr >= *start && ptr + len <= region.end)
        .map(|(_, region)| {
            let base = region.shared.map.as_ptr() as usize;
            (region.shared.clone(), region.block, ptr - base)
        })
}

impl ShmPin {
    /// Holds one pin, already taken, of the block at `block`, for the `len` bytes at `offset`
    /// (checked against the mapping and the file by the caller), and registers the range.
    fn hold(shared: Arc<ShmShared>, block: usize, offset: usize, len: usize) -> Self {
        let key = NEXT_KEY.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let start = shared.map.as_ptr() as usize + offset;
        pinned().insert(
            (start, key),
            Region {
                end: start + len,
                shared: shared.clone(),
                block,
            },
        );
        ShmPin {
            shared,
            block,
            offset,
            len,
            key,
        }
    }

    /// The payload, in shared memory.
    pub fn data(&self) -> &[u8] {
        // SAFETY: the range was checked against the mapping and the file (which never shrinks)
        // when the pin was taken (`ShmReader::locate`, `adopt`); the writer writes this block
        // again only once it is unpinned, which happens in `drop`. The pin holds an `Arc` of
        // the mapping, and the slice borrows `self`.
        unsafe { std::slice::from_raw_parts(self.shared.map.as_ptr().add(self.offset), self.len) }
    }
}

impl AsRef<[u8]> for ShmPin {
    fn as_ref(&self) -> &[u8] {
        self.data()
    }
}

impl Drop for ShmPin {
    fn drop(&mut self) {
        let start = self.shared.map.as_ptr() as usize + self.offset;
        // Out of the registry first: nobody may write the range by reference once unpinned.
        pinned().remove(&(start, self.key));
        let end = self.offset + self.len;
        super::ring::unpin(&self.shared.block(self.block, end).pins);
    }
}

/// A block of a channel's memory lent for a buffer built in place ([`ShmWriter::loan`]):
/// writable through this handle alone until it is frozen into bytes.
#[derive(Debug)]
pub(crate) struct ShmLoan(ShmPin);

impl crate::buffer::LoanedBytes for ShmLoan {
    fn bytes(&self) -> &[u8] {
        self.0.data()
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        let pin = &self.0;
        // SAFETY: the range lies inside the mapping and the file (the writer carved or reused
        // the block below its file length). The block was unpinned and out of every slot when
        // it was lent (nobody reads it), and it stays pinned by this loan, so the writer never
        // hands it to a slot; no reference to it has been written yet (that needs the frozen
        // bytes). So this handle is its only accessor, and the slice borrows it mutably.
        unsafe {
            std::slice::from_raw_parts_mut(pin.shared.map.as_mut_ptr().add(pin.offset), pin.len)
        }
    }

    fn freeze(self: Box<Self>) -> Bytes {
        Bytes::from_owner(self.0)
    }
}

/// The shared-memory channels of one graph mapped by the process that created them (the
/// driver), by memory id: where its readers find what a reference points to.
#[derive(Clone, Debug, Default)]
pub(crate) struct ShmGroup(std::sync::Arc<HashMap<u64, Arc<ShmShared>>>);

impl ShmGroup {
    /// The group of `channels`.
    pub fn new<'a>(channels: impl IntoIterator<Item = &'a ShmChannel>) -> Self {
        ShmGroup(std::sync::Arc::new(
            channels
                .into_iter()
                .map(|ch| (ch.shared.uid, ch.shared.clone()))
                .collect(),
        ))
    }
}

/// How a writer refers to payloads already in shared memory (see [`Sharing`]).
pub(crate) struct WriteSharing {
    target: Arc<ShmShared>,
}

impl WriteSharing {
    /// Whether every reader of the target channel maps `memory`.
    fn readers_map(&self, memory: &ShmShared) -> bool {
        let target = &self.target;
        memory.uid == target.uid
            || (target.readers_map_group && target.group != 0 && memory.group == target.group)
    }
}

impl Sharing for WriteSharing {
    fn locate(&self, bytes: &Bytes) -> Option<Location> {
        let (memory, block, offset) = pinned_range(bytes)?;
        self.readers_map(&memory).then_some([
            memory.uid,
            block as u64,
            offset as u64,
            bytes.len() as u64,
        ])
    }

    fn commit(&self, bytes: &Bytes, at: &Location) {
        // `bytes` is still alive, so its range is still registered and its block pinned: the
        // count cannot reach zero before the readers' pins are added.
        let Some((memory, block, _)) = pinned_range(bytes) else {
            unreachable!("a located payload left the registry while it was written");
        };
        debug_assert_eq!((memory.uid, block as u64), (at[0], at[1]));
        let end = block + BLOCK_HEADER;
        // Relaxed: the publish that follows (a release store) orders it before any reader's
        // adoption, and the holder's own unpin (a release decrement) comes after it.
        memory
            .block(block, end)
            .pins
            .fetch_add(self.target.readers, Ordering::Relaxed);
    }
}

/// How a reader adopts the references of a frame (see [`Sharing`]).
pub(crate) struct ReadSharing<'a> {
    own: &'a Arc<ShmShared>,
    group: &'a ShmGroup,
}

impl Sharing for ReadSharing<'_> {
    fn adopt(&self, at: &Location) -> Result<Bytes, String> {
        let [uid, block, offset, len] = *at;
        let memory = if uid == self.own.uid {
            self.own
        } else {
            self.group.0.get(&uid).ok_or_else(|| {
                format!("a reference to the memory of channel {uid:#x}, which is not mapped here")
            })?
        };
        let file_len = memory.header().file_len.load(Ordering::Acquire);
        let fits = block >= memory.layout.payload_start as u64
            && block % BLOCK_HEADER as u64 == 0
            && offset >= block + BLOCK_HEADER as u64
            && offset
                .checked_add(len)
                .is_some_and(|end| end <= file_len && end <= memory.map.len() as u64);
        if !fits {
            return Err(format!(
                "a reference to {len} bytes at {offset} (block {block}) outside the {file_len}-byte memfd"
            ));
        }
        Ok(Bytes::from_owner(ShmPin::hold(
            memory.clone(),
            block as usize,
            offset as usize,
            len as usize,
        )))
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::os::fd::{AsRawFd, FromRawFd};
    use std::process::{Child, Command, Stdio};
    use std::thread;

    use super::*;
    use crate::channel::wait::watchdog::{WATCHDOG, with_watchdog};

    /// Set in a child process: the raw fds of the channels it reads from and writes to.
    const CHILD_ENV: &str = "ADAG_SHM_TEST_CHILD_FDS";
    /// Message kinds of the tests: contents to check, or a bare ping.
    const CHECKED: u8 = 1;
    const PING: u8 = 0;

    fn config(depth: u32, readers: u32, slot_bytes: usize, max_message_bytes: usize) -> ShmConfig {
        ShmConfig {
            depth,
            readers,
            slot_bytes,
            max_message_bytes,
            spin: DEFAULT_SPIN,
            ..ShmConfig::default()
        }
    }

    /// The pseudo-random bytes of message `seq` (xorshift64*, seeded by `seq`), after an
    /// 8-byte header holding `seq`: a reader can check a message knowing nothing but its bytes.
    fn fill(seq: u64, buf: &mut [u8]) {
        let mut state = seq.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        for (index, chunk) in buf.chunks_mut(8).enumerate() {
            let word = if index == 0 {
                seq
            } else {
                state ^= state >> 12;
                state ^= state << 25;
                state ^= state >> 27;
                state.wrapping_mul(0x2545_F491_4F6C_DD1D)
            };
            chunk.copy_from_slice(&word.to_le_bytes()[..chunk.len()]);
        }
    }

    /// Checks a message written by [`fill`]; returns its sequence number.
    fn check(data: &[u8]) -> u64 {
        assert!(
            data.len() >= 8,
            "message of {} bytes lacks its header",
            data.len()
        );
        let seq = u64::from_le_bytes(data[..8].try_into().unwrap());
        let mut expected = vec![0; data.len()];
        fill(seq, &mut expected);
        assert!(
            data == expected,
            "message {seq} ({} bytes) is torn",
            data.len()
        );
        seq
    }

    /// Sizes that force growth: mostly small, every 25th message doubling from 8 KiB to 6 MiB.
    fn message_len(seq: u64) -> usize {
        if seq % 25 == 24 {
            (8 << 10 << (seq / 25)).min(6 << 20)
        } else {
            8 + (seq as usize * 97) % 2000
        }
    }

    fn send(
        writer: &mut ShmWriter,
        seq: u64,
        len: usize,
        deadline: Option<Instant>,
    ) -> Result<(), RingError> {
        writer
            .write_framed(
                CHECKED,
                &mut |buf: &mut [u8]| {
                    let buf = buf.get_mut(..len).ok_or(len)?;
                    fill(seq, buf);
                    Ok(len)
                },
                deadline,
            )
            .map(drop)
    }

    /// Writes a copy of `data`.
    fn write_copy(
        writer: &mut ShmWriter,
        tag: u8,
        data: &[u8],
        deadline: Option<Instant>,
    ) -> Result<(), RingError> {
        writer
            .write_framed(
                tag,
                &mut |buf: &mut [u8]| {
                    let buf = buf.get_mut(..data.len()).ok_or(data.len())?;
                    buf.copy_from_slice(data);
                    Ok(data.len())
                },
                deadline,
            )
            .map(drop)
    }

    /// Writes every message read back, unchanged (checking the `CHECKED` ones), until the
    /// input closes.
    fn echo_until_closed(
        reader: &mut ShmReader,
        writer: &mut ShmWriter,
        deadline: Option<Instant>,
    ) {
        loop {
            let frame = match reader.read(deadline) {
                Ok(frame) => frame,
                Err(RingError::Closed) => return,
                Err(err) => panic!("echo: {err}"),
            };
            if frame.tag == CHECKED {
                check(frame.data());
            }
            write_copy(writer, frame.tag, frame.data(), deadline).unwrap();
        }
    }

    fn after(millis: u64) -> Option<Instant> {
        Some(Instant::now() + Duration::from_millis(millis))
    }

    #[test]
    fn handles_are_send() {
        fn send<T: Send>() {}
        send::<ShmChannel>();
        send::<ShmWriter>();
        send::<ShmReader>();
        send::<ShmPin>();
        send::<ShmFrame<'static>>();
    }

    /// Four readers (one through its own mapping from `open`, one keeping pins) check every
    /// message, in order, while messages of growing size force the channel to grow.
    #[test]
    fn many_readers_see_every_message_in_order_across_growths() {
        const MESSAGES: u64 = 300;
        with_watchdog(WATCHDOG, || {
            let channel = ShmChannel::create(&config(4, 4, 64, 8 << 20), "stress").unwrap();
            let reopened = ShmChannel::open(rustix::io::dup(channel.fd()).unwrap()).unwrap();
            let readers: Vec<_> = (0..4)
                .map(|index| {
                    let mut reader = match index {
                        3 => reopened.reader(index),
                        _ => channel.reader(index),
                    };
                    thread::spawn(move || {
                        let mut pins = Vec::new();
                        let mut small = 0;
                        for expected in 0..MESSAGES {
                            // A small frame, in its slot's line, is never pinned.
                            if index == 2 && message_len(expected) > INLINE_BYTES {
                                let pin = reader.read(None).unwrap().pin();
                                assert_eq!(pin.data().len(), message_len(expected));
                                assert_eq!(check(pin.data()), expected);
                                // Keep the last six (more than the ring's depth): they must
                                // stay intact while the writer goes on (and grows) around them.
                                pins.push(pin);
                                if pins.len() > 6 {
                                    let oldest = pins.remove(0);
                                    check(oldest.data());
                                }
                            } else {
                                let frame = reader.read(None).unwrap();
                                assert_eq!(
                                    (frame.tag, frame.data().len()),
                                    (CHECKED, message_len(expected))
                                );
                                assert_eq!(check(frame.data()), expected);
                                if frame.is_small() {
                                    assert!(frame.data().len() <= INLINE_BYTES);
                                    small += 1;
                                }
                            }
                        }
                        // Small frames come in the slot's line, once the one before was small.
                        assert!(index == 2 || small > 0, "no small frame in the slot's line");
                        pins.iter().for_each(|pin| _ = check(pin.data()));
                        drop(pins);
                        assert!(matches!(reader.read(None), Err(RingError::Closed)));
                    })
                })
                .collect();
            let mut writer = channel.writer();
            for seq in 0..MESSAGES {
                send(&mut writer, seq, message_len(seq), None).unwrap();
            }
            let stride = channel.shared.header().stride.load(Ordering::Relaxed);
            assert!(
                stride >= 6 << 20,
                "the channel did not grow: stride {stride}"
            );
            drop(writer);
            for reader in readers {
                reader.join().unwrap();
            }
        });
    }

    #[test]
    fn close_wakes_a_blocked_reader_and_a_blocked_writer() {
        with_watchdog(WATCHDOG, || {
            let channel = ShmChannel::create(&config(1, 1, 64, 1024), "close").unwrap();
            let mut reader = channel.reader(0);
            let blocked_reader = thread::spawn(move || {
                let result = reader.read(None).map(|frame| frame.tag);
                (result, reader)
            });
            thread::sleep(Duration::from_millis(50));
            channel.close();
            let (result, reader) = blocked_reader.join().unwrap();
            assert!(matches!(result, Err(RingError::Closed)), "{result:?}");
            assert!(channel.is_closed());
            channel.close(); // idempotent

            // A full ring whose reader does not read: the writer sleeps until the close.
            let channel = ShmChannel::create(&config(1, 1, 64, 1024), "close-writer").unwrap();
            let (mut writer, _reader) = (channel.writer(), channel.reader(0));
            send(&mut writer, 0, 16, None).unwrap();
            let blocked_writer = thread::spawn(move || send(&mut writer, 1, 16, None));
            thread::sleep(Duration::from_millis(50));
            channel.close();
            let result = blocked_writer.join().unwrap();
            assert!(matches!(result, Err(RingError::Closed)), "{result:?}");
            drop(reader);
        });
    }

    #[test]
    fn deadlines_give_timeout() {
        with_watchdog(WATCHDOG, || {
            let channel = ShmChannel::create(&config(1, 1, 64, 1024), "deadline").unwrap();
            let (mut writer, mut reader) = (channel.writer(), channel.reader(0));
            let start = Instant::now();
            assert!(matches!(reader.read(after(30)), Err(RingError::Timeout)));
            let waited = start.elapsed();
            assert!(
                (Duration::from_millis(30)..Duration::from_secs(5)).contains(&waited),
                "{waited:?}"
            );
            // A deadline already past fails at once when the call would block.
            assert!(matches!(
                reader.read(Some(Instant::now())),
                Err(RingError::Timeout)
            ));

            send(&mut writer, 0, 16, None).unwrap();
            let start = Instant::now();
            assert!(matches!(
                send(&mut writer, 1, 16, after(30)),
                Err(RingError::Timeout)
            ));
            assert!(start.elapsed() >= Duration::from_millis(30));
            // Nothing was lost: the first message is there, and the second goes through now.
            assert_eq!(check(reader.read(after(1000)).unwrap().data()), 0);
            send(&mut writer, 1, 16, after(1000)).unwrap();
            assert_eq!(check(reader.read(after(1000)).unwrap().data()), 1);
        });
    }

    /// Frames of up to `INLINE_BYTES` go in the slot's line while the one before did; a
    /// larger one goes to a block (and a try in the line first is no growth).
    #[test]
    fn small_frames_travel_in_the_slot_line() {
        with_watchdog(WATCHDOG, || {
            let channel = ShmChannel::create(&config(8, 1, 4096, 1 << 20), "small").unwrap();
            let (mut writer, mut reader) = (channel.writer(), channel.reader(0));
            let sizes = [8, INLINE_BYTES, INLINE_BYTES + 1, 8, 8, 9000, 8, 8];
            let small = [true, true, false, false, true, false, false, true];
            let mut growths = 0;
            for (seq, len) in sizes.into_iter().enumerate() {
                growths += writer
                    .write_framed(
                        CHECKED,
                        &mut |buf: &mut [u8]| {
                            let buf = buf.get_mut(..len).ok_or(len)?;
                            fill(seq as u64, buf);
                            Ok(len)
                        },
                        None,
                    )
                    .unwrap();
            }
            assert_eq!(
                growths, 1,
                "only the 9000-byte frame outgrew its 8 KiB block"
            );
            for (seq, (len, small)) in sizes.into_iter().zip(small).enumerate() {
                let frame = reader.read(None).unwrap();
                assert_eq!(frame.data().len(), len);
                assert_eq!(check(frame.data()), seq as u64);
                assert_eq!(frame.is_small(), small, "frame {seq} of {len} bytes");
                assert_eq!(frame.block_capacity() == usize::MAX, small);
            }
        });
    }

    #[test]
    fn too_large_fails_and_the_channel_stays_usable() {
        with_watchdog(WATCHDOG, || {
            let channel = ShmChannel::create(&config(2, 1, 64, 64 << 10), "large").unwrap();
            let (mut writer, mut reader) = (channel.writer(), channel.reader(0));
            let err = send(&mut writer, 0, 100 << 10, None).unwrap_err();
            assert!(
                matches!(
                    err,
                    RingError::TooLarge {
                        size: 102_400,
                        limit: 65_536
                    }
                ),
                "{err:?}"
            );
            assert!(
                err.to_string()
                    .contains("102400 bytes exceeds the channel's limit of 65536"),
                "{err}"
            );
            // Exactly the ceiling fits.
            send(&mut writer, 1, 64 << 10, None).unwrap();
            send(&mut writer, 2, 100, None).unwrap();
            assert_eq!(check(reader.read(None).unwrap().data()), 1);
            assert_eq!(check(reader.read(None).unwrap().data()), 2);
            // A broken encoder is reported, not looped on.
            let err = writer
                .write_framed(CHECKED, &mut |_| Err(1), None)
                .unwrap_err();
            assert!(matches!(err, RingError::Corrupt(_)), "{err:?}");
        });
    }

    #[test]
    fn writer_drop_drains_then_closes_and_reader_drop_closes() {
        with_watchdog(WATCHDOG, || {
            let channel = ShmChannel::create(&config(4, 2, 64, 1024), "drop").unwrap();
            let (mut writer, mut first, second) =
                (channel.writer(), channel.reader(0), channel.reader(1));
            send(&mut writer, 0, 16, None).unwrap();
            send(&mut writer, 1, 16, None).unwrap();
            drop(writer);
            assert_eq!(check(first.read(None).unwrap().data()), 0);
            assert_eq!(check(first.read(None).unwrap().data()), 1);
            assert!(matches!(first.read(None), Err(RingError::Closed)));
            drop(second);

            let channel = ShmChannel::create(&config(4, 2, 64, 1024), "drop-reader").unwrap();
            let (mut writer, reader) = (channel.writer(), channel.reader(0));
            drop(reader);
            assert!(matches!(
                send(&mut writer, 0, 16, None),
                Err(RingError::Closed)
            ));
        });
    }

    /// Pinned payloads stay intact, in place, while the writer laps the ring many times (and
    /// grows) without waiting for them; once dropped, their blocks are reused rather than the
    /// memfd growing for ever.
    #[test]
    fn pins_survive_laps_and_growth_without_stalling_the_writer() {
        with_watchdog(WATCHDOG, || {
            let channel = ShmChannel::create(&config(2, 1, 64, 1 << 20), "pin").unwrap();
            let (mut writer, mut reader) = (channel.writer(), channel.reader(0));
            let mut pins = Vec::new();
            for seq in 0..40 {
                let len = if seq == 20 { 300 << 10 } else { 1000 };
                send(&mut writer, seq, len, after(1000)).unwrap();
                let frame = reader.read(after(1000)).unwrap();
                if seq % 4 == 0 {
                    pins.push(frame.pin());
                }
            }
            // A pin read on another thread, after the slot moved on many times.
            let first = pins.remove(0);
            assert_eq!(
                thread::spawn(move || check(first.data())).join().unwrap(),
                0
            );
            for (kept, pin) in (1..).zip(&pins) {
                assert_eq!(check(pin.data()), kept * 4);
            }
            drop(pins);
            let file_len = channel.shared.header().file_len.load(Ordering::Acquire);
            for seq in 40..400 {
                send(&mut writer, seq, 1000, after(1000)).unwrap();
                let pin = reader.read(after(1000)).unwrap().pin();
                assert_eq!(check(pin.data()), seq);
            }
            assert_eq!(
                channel.shared.header().file_len.load(Ordering::Acquire),
                file_len,
                "blocks given up were not reused"
            );
        });
    }

    /// The writer waits for a pinned block only once the channel's address space is used
    /// up, and then until a pin goes, its deadline passes or the channel closes.
    #[test]
    fn a_writer_out_of_room_waits_for_a_pin_to_go() {
        with_watchdog(WATCHDOG, || {
            // One slot with blocks of one page, and room for 8 blocks of the ceiling (4 KiB
            // and a header: two pages): 16 blocks of one page in all.
            let channel = ShmChannel::create(&config(1, 1, 64, 4096), "out-of-room").unwrap();
            let (mut writer, mut reader) = (channel.writer(), channel.reader(0));
            let room = channel.shared.layout.reserve - channel.shared.layout.payload_start;
            let blocks = room / channel.shared.layout.initial_stride;
            let mut pins = Vec::new();
            for seq in 0..blocks as u64 {
                send(&mut writer, seq, 100, after(1000)).unwrap();
                pins.push(reader.read(after(1000)).unwrap().pin());
            }
            let start = Instant::now();
            let next = blocks as u64;
            assert!(matches!(
                send(&mut writer, next, 100, after(50)),
                Err(RingError::Timeout)
            ));
            assert!(start.elapsed() >= Duration::from_millis(50));
            // A pin dropped on another thread lets the blocked writer go on.
            let third = pins.remove(3);
            let dropper = thread::spawn(move || {
                thread::sleep(Duration::from_millis(30));
                drop(third);
            });
            send(&mut writer, next, 100, after(5000)).unwrap();
            dropper.join().unwrap();
            assert_eq!(check(reader.read(after(1000)).unwrap().data()), next);
            for (seq, pin) in (0..).filter(|s| *s != 3).zip(&pins) {
                assert_eq!(check(pin.data()), seq);
            }
            // Out of room again; this time the pin of the slot's own block goes.
            send(&mut writer, next + 1, 100, after(1000)).unwrap();
            let latest = reader.read(after(1000)).unwrap().pin();
            let dropper = thread::spawn(move || {
                thread::sleep(Duration::from_millis(30));
                drop(latest);
            });
            send(&mut writer, next + 2, 100, after(5000)).unwrap();
            dropper.join().unwrap();
            assert_eq!(check(reader.read(after(1000)).unwrap().data()), next + 2);
            // Out of room again, with no deadline: the close wakes the writer.
            send(&mut writer, next + 3, 100, after(1000)).unwrap();
            pins.push(reader.read(after(1000)).unwrap().pin());
            let blocked = thread::spawn(move || send(&mut writer, next + 4, 100, None));
            thread::sleep(Duration::from_millis(30));
            channel.close();
            assert!(matches!(blocked.join().unwrap(), Err(RingError::Closed)));
        });
    }

    #[test]
    fn open_rejects_what_is_not_a_channel() {
        with_watchdog(WATCHDOG, open_rejects_what_is_not_a_channel_body);
    }

    fn open_rejects_what_is_not_a_channel_body() {
        let plain = rustix::fs::memfd_create("adag-test-plain", MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&plain, 1 << 16).unwrap();
        let err = ShmChannel::open(plain).unwrap_err();
        assert!(err.to_string().contains("not sealed"), "{err}");

        let zeros = rustix::fs::memfd_create(
            "adag-test-zeros",
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
        )
        .unwrap();
        rustix::fs::ftruncate(&zeros, 1 << 16).unwrap();
        rustix::fs::fcntl_add_seals(&zeros, SealFlags::SHRINK).unwrap();
        let err = ShmChannel::open(zeros).unwrap_err();
        assert!(err.to_string().contains("bad magic"), "{err}");

        let err = ShmChannel::create(&config(0, 1, 64, 1024), "bad").unwrap_err();
        assert!(err.to_string().contains("depth 0"), "{err}");
    }

    /// Starts this test binary again as the child running [`child_echo`], passing the fds of
    /// the channel it reads (`to_child`) and the one it writes (`from_child`).
    fn spawn_echo_child(to_child: &ShmChannel, from_child: &ShmChannel) -> Child {
        // Inheritable copies (no CLOEXEC), closed here once the child has its own.
        let fds = [
            rustix::io::dup(to_child.fd()).unwrap(),
            rustix::io::dup(from_child.fd()).unwrap(),
        ];
        let test = format!("{}::child_echo", module_path!().split_once("::").unwrap().1);
        let child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                &test,
                "--include-ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(
                CHILD_ENV,
                format!("{},{}", fds[0].as_raw_fd(), fds[1].as_raw_fd()),
            )
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        drop(fds);
        child
    }

    fn wait_child(mut child: Child, limit: Duration) {
        let start = Instant::now();
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                assert!(status.success(), "the child process failed: {status}");
                return;
            }
            if start.elapsed() > limit {
                let _ = child.kill();
                let _ = child.wait();
                panic!("watchdog: the child process still runs after {limit:?}");
            }
            thread::sleep(Duration::from_millis(10));
        }
    }

    /// The child side of the cross-process tests: reads every message, checks the `CHECKED`
    /// ones, and writes each back unchanged, until the channel closes.
    #[test]
    #[ignore = "the child process of the cross-process tests"]
    fn child_echo() {
        let Ok(fds) = std::env::var(CHILD_ENV) else {
            return;
        };
        let open = |raw: &str| {
            // SAFETY: the parent left this fd open, without CLOEXEC, for this process alone;
            // nothing else here owns it.
            let fd = unsafe { OwnedFd::from_raw_fd(raw.parse().unwrap()) };
            rustix::io::fcntl_setfd(&fd, rustix::io::FdFlags::CLOEXEC).unwrap();
            ShmChannel::open(fd).unwrap()
        };
        let (input, output) = fds.split_once(',').unwrap();
        let (input, output) = (open(input), open(output));
        let (mut reader, mut writer) = (input.reader(0), output.writer());
        pin_for_bench(1);
        echo_until_closed(&mut reader, &mut writer, Some(Instant::now() + WATCHDOG));
    }

    /// Messages of growing sizes go to another process and back; both sides check them.
    #[test]
    fn messages_cross_processes_intact() {
        const MESSAGES: u64 = 200;
        with_watchdog(WATCHDOG, || {
            let to_child = ShmChannel::create(&config(4, 1, 64, 8 << 20), "to-child").unwrap();
            let from_child = ShmChannel::create(&config(4, 1, 64, 8 << 20), "from-child").unwrap();
            let child = spawn_echo_child(&to_child, &from_child);
            let (mut writer, mut reader) = (to_child.writer(), from_child.reader(0));
            // Keep up to `depth` messages in flight each way.
            let mut received = 0;
            for seq in 0..MESSAGES {
                send(&mut writer, seq, message_len(seq), None).unwrap();
                if seq >= 3 {
                    assert_eq!(check(reader.read(None).unwrap().data()), received);
                    received += 1;
                }
            }
            drop(writer);
            while received < MESSAGES {
                assert_eq!(check(reader.read(None).unwrap().data()), received);
                received += 1;
            }
            assert!(matches!(reader.read(None), Err(RingError::Closed)));
            wait_child(child, WATCHDOG);
        });
    }

    /// With `ADAG_SHM_BENCH_PIN` set, pins the calling thread to `cpu`: the bench then measures
    /// two ends on two CPUs even on a busy machine (where the scheduler may stack them on one).
    fn pin_for_bench(cpu: usize) {
        if std::env::var_os("ADAG_SHM_BENCH_PIN").is_some() {
            let mut set = rustix::thread::CpuSet::new();
            set.set(cpu);
            rustix::thread::sched_setaffinity(None, &set).unwrap();
        }
    }

    fn percentile(sorted: &[Duration], p: f64) -> Duration {
        sorted[((sorted.len() - 1) as f64 * p) as usize]
    }

    /// Round trips of an 8-byte message through `writer` and back through `reader`.
    fn ping_pong(
        writer: &mut ShmWriter,
        reader: &mut ShmReader,
        rounds: usize,
    ) -> (Duration, Duration) {
        let mut times = Vec::with_capacity(rounds);
        for round in 0..rounds + rounds / 10 {
            let start = Instant::now();
            writer
                .write_framed(
                    PING,
                    &mut |buf: &mut [u8]| {
                        buf[..8].copy_from_slice(&(round as u64).to_le_bytes());
                        Ok(8)
                    },
                    None,
                )
                .unwrap();
            let frame = reader.read(None).unwrap();
            assert_eq!(frame.data()[..8], (round as u64).to_le_bytes());
            drop(frame);
            // The first tenth warms up.
            if round >= rounds / 10 {
                times.push(start.elapsed());
            }
        }
        times.sort();
        (percentile(&times, 0.5), percentile(&times, 0.99))
    }

    /// Copies `message` through the channel `count` times; returns the time per message.
    fn stream(
        writer: &mut ShmWriter,
        reader: &mut ShmReader,
        message: &[u8],
        count: usize,
    ) -> Duration {
        let mut out = vec![0u8; message.len()];
        let start = Instant::now();
        for _ in 0..count {
            write_copy(writer, PING, message, None).unwrap();
            out.copy_from_slice(reader.read(None).unwrap().data());
        }
        start.elapsed() / count as u32
    }

    /// Prints the round trip between threads and between processes, and the time to move a
    /// 64 MiB message:
    /// `[ADAG_SHM_BENCH_PIN=1] cargo test --release --lib channel::shm::tests::bench -- --ignored --nocapture`
    #[test]
    #[ignore = "a measurement, not a test"]
    fn bench() {
        const ROUNDS: usize = 100_000;
        const BIG: usize = 64 << 20;
        with_watchdog(Duration::from_secs(600), || {
            let cfg = config(4, 1, 4096, 128 << 20);
            let big: Vec<u8> = (0..BIG).map(|i| (i * 31 % 251) as u8).collect();

            // Threads: an echo thread between two channels.
            let (there, back) = (
                ShmChannel::create(&cfg, "bench-there").unwrap(),
                ShmChannel::create(&cfg, "bench-back").unwrap(),
            );
            let (mut echo_reader, mut echo_writer) = (there.reader(0), back.writer());
            let echo = thread::spawn(move || {
                pin_for_bench(1);
                echo_until_closed(&mut echo_reader, &mut echo_writer, None);
            });
            let (mut writer, mut reader) = (there.writer(), back.reader(0));
            pin_for_bench(0);
            let (p50, p99) = ping_pong(&mut writer, &mut reader, ROUNDS);
            println!("thread ping-pong: p50 {p50:?}, p99 {p99:?} over {ROUNDS} round trips");
            stream(&mut writer, &mut reader, &big, 2); // grow and warm up
            let per = stream(&mut writer, &mut reader, &big, 10);
            println!(
                "thread echo of 64 MiB (write, echo copy, read copy): {per:?} per message, {:.2} GB/s",
                BIG as f64 / per.as_secs_f64() / 1e9
            );
            drop((writer, reader));
            echo.join().unwrap();

            // One writer thread, one reader thread: write (copy in) and read (copy out).
            let channel = ShmChannel::create(&cfg, "bench-stream").unwrap();
            let (mut writer, mut reader) = (channel.writer(), channel.reader(0));
            let consumer = thread::spawn(move || {
                let mut out = vec![0u8; BIG];
                let mut count = 0;
                let mut start = Instant::now();
                while let Ok(frame) = reader.read(None) {
                    out.copy_from_slice(frame.data());
                    count += 1;
                    if count == 2 {
                        start = Instant::now(); // after growth and warm-up
                    }
                }
                start.elapsed() / (count - 2)
            });
            for _ in 0..22 {
                write_copy(&mut writer, PING, &big, None).unwrap();
            }
            drop(writer);
            let per = consumer.join().unwrap();
            println!(
                "pipelined 64 MiB write+read between threads: {per:?} per message, {:.2} GB/s",
                BIG as f64 / per.as_secs_f64() / 1e9
            );

            // Processes: the echo child.
            let (there, back) = (
                ShmChannel::create(&cfg, "bench-there").unwrap(),
                ShmChannel::create(&cfg, "bench-back").unwrap(),
            );
            let child = spawn_echo_child(&there, &back);
            let (mut writer, mut reader) = (there.writer(), back.reader(0));
            let (p50, p99) = ping_pong(&mut writer, &mut reader, ROUNDS);
            println!("process ping-pong: p50 {p50:?}, p99 {p99:?} over {ROUNDS} round trips");
            stream(&mut writer, &mut reader, &big, 2);
            let per = stream(&mut writer, &mut reader, &big, 10);
            println!(
                "process echo of 64 MiB (write, echo copy, read copy): {per:?} per message, {:.2} GB/s",
                BIG as f64 / per.as_secs_f64() / 1e9
            );
            drop((writer, reader));
            wait_child(child, Duration::from_secs(60));
        });
    }
}
