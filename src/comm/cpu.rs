//! The CPU communicator: CPU tensors between threads of one process and between processes of
//! one host, over one shared-memory region per group.
//!
//! [`CpuGroup::create`] makes the region (a sealed memfd, so nothing is left in `/dev/shm`
//! even after a crash); [`CpuGroup::communicator`] hands out a rank in this process, and
//! [`CpuGroup::fd`] + [`CpuCommunicator::open`] open a rank in another process that received
//! the descriptor (inherited, or passed with `SCM_RIGHTS`).
//!
//! # The shared-memory protocol
//!
//! The region holds a header (parameters, the group's `state` word), one control block per
//! rank, two collective slots per rank, one mailbox per ordered pair of ranks, and one
//! *single-copy area* per rank. A slot or a mailbox entry is a 256-byte `Meta` header followed
//! by `chunk_bytes` of data; larger tensors move in chunks, so any size works with a fixed
//! region. Every process maps the region whole up to the single-copy areas, and an area the
//! first time it sends from it or receives from it.
//!
//! - **Collectives** run in *rounds*, numbered the same on every rank. Rank `r` has two
//!   counters: `ready[r]` (rounds whose data it published) and `done[r]` (rounds it finished
//!   reading). In round `k` rank `r` waits until every `done[q] >= k - 1` (everyone finished
//!   round `k - 2`, the last user of slot `k % 2`), writes its meta and chunk into its slot
//!   `k % 2`, sets `ready[r] = k + 1`, waits until every `ready[q] >= k + 1`, reads the
//!   chunks of all ranks in rank order (reducing or gathering what it needs), and sets
//!   `done[r] = k + 1`. Two slots per rank mean the "slots free again" barrier of round `k`
//!   is only waited for in round `k + 2`. Round 0 of an operation also carries each rank's
//!   meta (operation, dtype, shape, or "my tensor was unusable"); every rank checks all of
//!   them after the first barrier, so all ranks reach the same verdict and a mismatch is an
//!   error on every rank while the group stays usable.
//! - **Point to point**: the mailbox `src -> dst` is a single-producer single-consumer ring of
//!   `DEPTH` (8) entries with `head` (entries written) and `tail` (entries consumed). A message is
//!   one or more chunk entries, each carrying the message's sequence number, dtype, shape,
//!   total size and offset; a receiver that finds another shape or dtype than it asked for
//!   consumes the whole message and returns [`CommError::Mismatch`], keeping later messages in
//!   order. A `send` returns once its last chunk is in the ring.
//! - **Single copy**: a point-to-point tensor of at least [`BULK_MIN_BYTES`] (64 KiB) is
//!   written once, by its sender, into a *block* of the sender's single-copy area
//!   ([`CpuGroupOptions::bulk_bytes`] of address space, pages allocated as used), and the
//!   message is one mailbox entry naming the block. The receiver's tensor reads the block in
//!   place (no copy, no allocation) for as long as it lives. Each block starts with a header:
//!   `BUSY` (set by the sender before it publishes the entry, cleared by the receiver with a
//!   Release store when the last clone of its tensor is dropped, or at once when the receive
//!   fails) and its size. The sender writes only blocks it saw free (`BUSY == 0`, loaded with
//!   Acquire) or carves new ones at the top of its area (recorded in its control block, so a
//!   rank opened again reads its blocks back and never writes one still held). It keeps the
//!   memory of a few free blocks for reuse and gives the rest back (`FALLOC_FL_PUNCH_HOLE`).
//!   When its area has no room (receivers keep many tensors) the tensor goes through the
//!   mailbox in chunks instead: slower, never blocked. The ordering, the mailbox bound, the
//!   errors and the waits are those of the chunked path; a mismatched receive frees the block
//!   and keeps later messages in order.
//! - **Waiting**: spin (`spin`, default 20 µs), then `sched_yield` (`yield_for`, 200 µs), then
//!   sleep on a process-shared futex word with a sleeper count, in bounded slices of 100 ms,
//!   until the deadline. Publishers bump the event word and call `FUTEX_WAKE` only when a
//!   sleeper is registered (sequentially consistent counter/word pair: no lost wake-up).
//! - **Destroy** sets `state = destroyed` and bumps and wakes every event word: every waiter
//!   of every process returns [`CommError::Destroyed`]. A timeout in the middle of a
//!   collective or of a chunked message would leave the counters inconsistent, so it
//!   *aborts* the group (`state` records the rank and the reason); the others get
//!   [`CommError::Aborted`]. A timeout before anything was written (a `recv` with nothing
//!   sent, a `send` to a full mailbox) leaves the group usable.
//!
//! Each rank may be held by one communicator at a time (an `attached` flag in its control
//! block). Calls on one communicator from several threads are serialized per collective and
//! per mailbox.
use super::{
    CommError, CommId, CommOp, Communicator, CommunicatorFactory, CommunicatorGroup,
    DEFAULT_TIMEOUT, GroupTicket, ReduceOp, SendCompletion, reduce_bytes,
};
use crate::tensor::{AlignedBuf, DType, Tensor, TensorError};
use bytes::Bytes;
use memmap2::{MmapOptions, MmapRaw};
use parking_lot::Mutex;
use rustix::fs::{MemfdFlags, SealFlags};
use rustix::thread::futex;
use std::fmt;
use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use zerocopy::{FromBytes, FromZeros, Immutable, IntoBytes, KnownLayout};

#[cfg(test)]
mod bulk_tests;

/// The transport name of the CPU communicator.
pub const TRANSPORT: &str = "cpu";

/// The most ranks of one CPU group.
pub const MAX_WORLD_SIZE: usize = 1024;

/// The most dimensions of a tensor moved by the CPU communicator.
pub const MAX_DIMS: usize = 16;

/// Settings of a CPU group, fixed when it is made and shared by every process that opens it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpuGroupOptions {
    /// Bytes of one chunk (one collective slot, one mailbox entry), rounded up to 128.
    /// Tensors larger than this move in several chunks. Default 1 MiB.
    pub chunk_bytes: usize,
    /// The deadline of every blocking call. Default [`DEFAULT_TIMEOUT`] (30 s).
    pub timeout: Duration,
    /// How long a waiter spins before yielding. Default 20 µs.
    pub spin: Duration,
    /// How long a waiter yields before sleeping on the futex. Default 200 µs.
    pub yield_for: Duration,
    /// Address space of each rank's *single-copy area*: a point-to-point tensor of at least
    /// [`BULK_MIN_BYTES`] is written there once by its sender and read in place by its
    /// receiver (see the module docs). Pages are allocated only as they are used. Default
    /// 4 GiB, and at most 1 TiB divided by the world size; 0 turns the area off (every tensor
    /// then moves through the mailboxes, in chunks, copied twice).
    pub bulk_bytes: usize,
}

impl Default for CpuGroupOptions {
    fn default() -> Self {
        CpuGroupOptions {
            chunk_bytes: 1 << 20,
            timeout: DEFAULT_TIMEOUT,
            spin: Duration::from_micros(20),
            yield_for: Duration::from_micros(200),
            bulk_bytes: 4 << 30,
        }
    }
}

const MAGIC: u64 = u64::from_le_bytes(*b"ADAGCPU\x01");
const VERSION: u32 = 2;
/// Cache-line padding of words written by different ranks (128: adjacent-line prefetch).
const LINE: usize = 128;
const PAGE: usize = 4096;
/// Mailbox ring depth (entries): how many messages one rank may send another before the
/// other receives. The scheduler treats this group's sends as buffered (they complete
/// before the matching receive), which holds while fewer than this many are queued per pair;
/// 8 covers the schedules the random-graph test generates (2 did not: a third queued send
/// blocked its rank's communication thread ahead of a collective). Pages of the region are
/// touched only as they are used.
pub(crate) const DEPTH: u32 = 8;
const LABEL_MAX: usize = 96;
/// The smallest point-to-point tensor sent through the sender's single-copy area (when the
/// group has one, [`CpuGroupOptions::bulk_bytes`]); smaller ones go through the mailboxes.
pub const BULK_MIN_BYTES: usize = 64 << 10;
/// Bytes before a block's data in a single-copy area: its header ([`block`]).
const BLOCK_HEADER: usize = 64;
/// The most free blocks of a rank's single-copy area whose memory it keeps for reuse; the
/// memory of the others is given back to the kernel (their headers stay).
const KEEP_FREE: usize = 4;
/// The most address space of all the single-copy areas of a group together.
const BULK_TOTAL_MAX: usize = 1 << 40;
/// Longest futex sleep before rechecking state and deadline.
const SLEEP_SLICE: Duration = Duration::from_millis(100);

/// Header offsets.
mod hdr {
    pub const MAGIC: usize = 0;
    pub const VERSION: usize = 8;
    pub const WORLD: usize = 12;
    pub const CHUNK: usize = 16;
    pub const TOTAL: usize = 24;
    pub const TIMEOUT_NS: usize = 32;
    pub const SPIN_NS: usize = 40;
    pub const YIELD_NS: usize = 48;
    pub const ID_HI: usize = 56;
    pub const ID_LO: usize = 64;
    pub const LABEL_LEN: usize = 72;
    pub const LABEL: usize = 80;
    /// Bytes of each rank's single-copy area (0: none).
    pub const ARENA: usize = 176;
    pub const STATE: usize = 256;
    pub const COLL_EVENT: usize = 384;
    pub const COLL_SLEEPERS: usize = 388;
    pub const SIZE: usize = 512;
}

/// Per-rank control block offsets.
mod rank_ctrl {
    pub const READY: usize = 0;
    pub const DONE: usize = 128;
    pub const ATTACHED: usize = 256;
    /// The end of the blocks carved in the rank's single-copy area (written by the rank).
    pub const BULK_TOP: usize = 264;
    pub const STRIDE: usize = 384;
}

/// Offsets in the header of a block of a single-copy area.
mod block {
    /// 1 while the block holds a tensor on its way or held by its receiver, 0 when free:
    /// set by the sender before it publishes the message, cleared by the receiver (Release)
    /// once the tensor it read in place is dropped.
    pub const BUSY: usize = 0;
    /// The block's size in bytes, header included (a multiple of the page): written by the
    /// sender when it carves the block, never changed.
    pub const SIZE: usize = 8;
}

/// Per-mailbox control block offsets (sender-written words apart from receiver-written ones).
mod mbox {
    pub const HEAD: usize = 0;
    pub const SEND_SEQ: usize = 8;
    pub const TAIL: usize = 128;
    pub const RECV_SEQ: usize = 136;
    pub const RX_EVENT: usize = 256;
    pub const RX_SLEEPERS: usize = 260;
    pub const TX_EVENT: usize = 384;
    pub const TX_SLEEPERS: usize = 388;
    pub const STRIDE: usize = 512;
}

const STATE_LIVE: u32 = 0;
const STATE_DESTROYED: u32 = 1;
const STATE_ABORTED: u32 = 1 << 31;

const ABORT_COLLECTIVE_TIMEOUT: u32 = 1;
const ABORT_SEND_TIMEOUT: u32 = 2;
const ABORT_RECV_TIMEOUT: u32 = 3;
const ABORT_PROTOCOL: u32 = 4;

fn abort_reason(code: u32) -> &'static str {
    match code {
        ABORT_COLLECTIVE_TIMEOUT => "it timed out in the middle of a collective",
        ABORT_SEND_TIMEOUT => "it timed out in the middle of sending a chunked message",
        ABORT_RECV_TIMEOUT => "it timed out in the middle of receiving a chunked message",
        ABORT_PROTOCOL => "it found the shared state inconsistent",
        _ => "unknown reason",
    }
}

const KIND_P2P: u32 = 0;
const KIND_ALLREDUCE: u32 = 1;
const KIND_ALLGATHER: u32 = 2;
const KIND_REDUCESCATTER: u32 = 3;
/// A point-to-point message whose data lies in the sender's single-copy area (`Meta::block`).
const KIND_P2P_BULK: u32 = 8;

/// The 256-byte header of a collective slot or a mailbox entry.
#[derive(Clone, Copy, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
struct Meta {
    /// Collective: the round; mailbox: the message's sequence number.
    seq: u64,
    /// Total bytes of the tensor.
    nbytes: u64,
    /// Offset of this chunk in the tensor's bytes.
    offset: u64,
    /// Bytes of this chunk.
    len: u64,
    kind: u32,
    op: u32,
    dtype: u32,
    ndim: u32,
    /// 0: the tensor is usable; 1: it is not, and the data area holds why (`len` bytes of
    /// UTF-8).
    status: u32,
    reserved: u32,
    shape: [u64; MAX_DIMS],
    /// `KIND_P2P_BULK`: the offset of the block in the sender's single-copy area.
    block: u64,
    padding: [u8; 64],
}

const META: usize = std::mem::size_of::<Meta>();
const _: () = assert!(META == 256);

impl Meta {
    fn describe(&self) -> String {
        let dtype = DType::from_code(self.dtype).map_or("?", DType::name);
        let tensor = format!("dtype {dtype}, shape {:?}", self.shape_vec());
        match self.kind {
            KIND_ALLREDUCE => format!("allreduce({}) of {tensor}", op_name(self.op)),
            KIND_ALLGATHER => format!("allgather of {tensor}"),
            KIND_REDUCESCATTER => format!("reducescatter({}) of {tensor}", op_name(self.op)),
            _ => tensor,
        }
    }

    fn shape_vec(&self) -> Vec<usize> {
        let n = (self.ndim as usize).min(MAX_DIMS);
        self.shape[..n].iter().map(|&d| d as usize).collect()
    }

    fn same_call(&self, o: &Meta) -> bool {
        self.kind == o.kind
            && self.op == o.op
            && self.dtype == o.dtype
            && self.ndim == o.ndim
            && self.shape == o.shape
            && self.nbytes == o.nbytes
    }
}

fn op_name(code: u32) -> &'static str {
    ReduceOp::ALL
        .into_iter()
        .find(|o| o.code() == code)
        .map_or("?", ReduceOp::name)
}

fn align_up(x: usize, a: usize) -> Option<usize> {
    Some(x.checked_add(a - 1)? / a * a)
}

/// Where everything is in the region, computed from the world size, the chunk size and the
/// size of each rank's single-copy area.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Layout {
    world: usize,
    chunk: usize,
    slots: usize,
    slot_stride: usize,
    mbox_ctrl: usize,
    mbox_data: usize,
    /// Where the single-copy areas start: the end of what every rank maps whole.
    arenas: usize,
    /// Bytes of each rank's single-copy area (a multiple of the page; 0: none).
    arena: usize,
    total: usize,
}

impl Layout {
    fn new(world: usize, chunk: usize, arena: usize) -> Option<Layout> {
        let ranks_end = hdr::SIZE.checked_add(world.checked_mul(rank_ctrl::STRIDE)?)?;
        let slots = align_up(ranks_end, PAGE)?;
        let slot_stride = META.checked_add(align_up(chunk, LINE)?)?;
        let mbox_ctrl = slots.checked_add(world.checked_mul(2)?.checked_mul(slot_stride)?)?;
        let pairs = world.checked_mul(world - 1)?;
        let mbox_data = align_up(
            mbox_ctrl.checked_add(pairs.checked_mul(mbox::STRIDE)?)?,
            PAGE,
        )?;
        let arenas = align_up(
            mbox_data.checked_add(
                pairs
                    .checked_mul(DEPTH as usize)?
                    .checked_mul(slot_stride)?,
            )?,
            PAGE,
        )?;
        if !arena.is_multiple_of(PAGE) || world.checked_mul(arena)? > BULK_TOTAL_MAX {
            return None;
        }
        let total = arenas.checked_add(world * arena)?;
        // Keep offsets well inside isize for pointer arithmetic.
        (total <= isize::MAX as usize / 2).then_some(Layout {
            world,
            chunk,
            slots,
            slot_stride,
            mbox_ctrl,
            mbox_data,
            arenas,
            arena,
            total,
        })
    }

    /// The size of each rank's single-copy area for `bulk_bytes` asked for
    /// ([`CpuGroupOptions::bulk_bytes`]).
    fn arena_for(world: usize, bulk_bytes: usize) -> usize {
        let arena = bulk_bytes.min(BULK_TOTAL_MAX / world.max(1)) / PAGE * PAGE;
        if arena < BLOCK_HEADER + BULK_MIN_BYTES {
            0
        } else {
            arena
        }
    }

    fn rank_ctrl(&self, r: usize) -> usize {
        hdr::SIZE + r * rank_ctrl::STRIDE
    }

    /// The collective slot of rank `r` for rounds of this parity.
    fn slot(&self, r: usize, parity: u64) -> usize {
        self.slots + (r * 2 + parity as usize) * self.slot_stride
    }

    /// The index of the mailbox `src -> dst` (`src != dst`).
    fn pair(&self, src: usize, dst: usize) -> usize {
        src * (self.world - 1) + if dst < src { dst } else { dst - 1 }
    }

    fn mbox_ctrl(&self, pair: usize) -> usize {
        self.mbox_ctrl + pair * mbox::STRIDE
    }

    fn entry(&self, pair: usize, index: u32) -> usize {
        self.mbox_data + (pair * DEPTH as usize + (index % DEPTH) as usize) * self.slot_stride
    }
}

/// Why a wait ended without its condition.
#[derive(Debug, Clone, Copy)]
enum Stop {
    Timeout,
    Destroyed,
    Aborted { by: usize, code: u32 },
}

/// A futex word and its sleeper count.
#[derive(Clone, Copy)]
struct Event {
    word: usize,
    sleepers: usize,
}

/// One mapping of a group's region in this process.
struct Region {
    /// The region up to the single-copy areas (`layout.arenas` bytes).
    map: MmapRaw,
    /// The single-copy area of each rank, mapped the first time this process sends from it
    /// or receives from it.
    arena_maps: Box<[OnceLock<MmapRaw>]>,
    file: File,
    layout: Layout,
    id: CommId,
    label: String,
    /// `label (id)`, for messages.
    name: String,
    timeout: Duration,
    spin: Duration,
    yield_for: Duration,
}

impl fmt::Debug for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Region")
            .field("group", &self.name)
            .field("world_size", &self.layout.world)
            .field("chunk_bytes", &self.layout.chunk)
            .field("bytes", &self.layout.total)
            .finish()
    }
}

fn io_err(group: &str, context: &str, e: impl fmt::Display) -> CommError {
    CommError::Io {
        group: group.to_string(),
        context: context.to_string(),
        message: e.to_string(),
    }
}

fn duration_ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl Region {
    fn create(world: usize, label: &str, opts: &CpuGroupOptions) -> Result<Region, CommError> {
        if world == 0 || world > MAX_WORLD_SIZE {
            return Err(CommError::Config {
                message: format!(
                    "a CPU communicator group needs 1 to {MAX_WORLD_SIZE} ranks, not {world}"
                ),
            });
        }
        let chunk = align_up(opts.chunk_bytes.max(LINE), LINE).unwrap_or(usize::MAX);
        let arena = Layout::arena_for(world, opts.bulk_bytes);
        let layout = Layout::new(world, chunk, arena).ok_or_else(|| CommError::Config {
            message: format!(
                "a CPU group of {world} ranks with chunk_bytes = {} does not fit in memory; lower CpuGroupOptions::chunk_bytes",
                opts.chunk_bytes
            ),
        })?;
        let mut label: String = label
            .chars()
            .map(|c| if c == '\0' { '_' } else { c })
            .collect();
        let mut n = label.len().min(LABEL_MAX);
        while !label.is_char_boundary(n) {
            n -= 1;
        }
        label.truncate(n);
        let id = CommId::generate();
        let name = format!("{label} ({id})");
        let fd = rustix::fs::memfd_create(
            format!("adag-comm-{label}"),
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
        )
        .map_err(|e| io_err(&name, "memfd_create for the group's shared memory", e))?;
        rustix::fs::ftruncate(&fd, layout.total as u64).map_err(|e| {
            io_err(
                &name,
                &format!("sizing the group's shared memory to {} bytes", layout.total),
                e,
            )
        })?;
        // Sealed against resizing: a shrink by anyone would make every mapping fault.
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
            .map_err(|e| io_err(&name, "sealing the group's shared memory", e))?;
        let file = File::from(fd);
        let map = MmapOptions::new()
            .len(layout.arenas)
            .map_raw(&file)
            .map_err(|e| io_err(&name, "mapping the group's shared memory", e))?;
        let region = Region {
            map,
            arena_maps: (0..world).map(|_| OnceLock::new()).collect(),
            file,
            layout,
            id,
            label,
            name,
            timeout: opts.timeout,
            spin: opts.spin,
            yield_for: opts.yield_for,
        };
        region
            .u32_at(hdr::VERSION)
            .store(VERSION, Ordering::Relaxed);
        region
            .u32_at(hdr::WORLD)
            .store(world as u32, Ordering::Relaxed);
        region
            .u64_at(hdr::CHUNK)
            .store(chunk as u64, Ordering::Relaxed);
        region
            .u64_at(hdr::ARENA)
            .store(arena as u64, Ordering::Relaxed);
        region
            .u64_at(hdr::TOTAL)
            .store(layout.total as u64, Ordering::Relaxed);
        region
            .u64_at(hdr::TIMEOUT_NS)
            .store(duration_ns(opts.timeout), Ordering::Relaxed);
        region
            .u64_at(hdr::SPIN_NS)
            .store(duration_ns(opts.spin), Ordering::Relaxed);
        region
            .u64_at(hdr::YIELD_NS)
            .store(duration_ns(opts.yield_for), Ordering::Relaxed);
        region
            .u64_at(hdr::ID_HI)
            .store((id.as_u128() >> 64) as u64, Ordering::Relaxed);
        region
            .u64_at(hdr::ID_LO)
            .store(id.as_u128() as u64, Ordering::Relaxed);
        region
            .u32_at(hdr::LABEL_LEN)
            .store(region.label.len() as u32, Ordering::Relaxed);
        // SAFETY: the label area (LABEL_MAX bytes at hdr::LABEL, inside the header) is written
        // only here, before the region is shared with any other thread or process.
        unsafe { region.write(hdr::LABEL, region.label.as_bytes()) };
        // Publishes the header: openers check the magic first.
        region.u64_at(hdr::MAGIC).store(MAGIC, Ordering::Release);
        Ok(region)
    }

    fn open(fd: BorrowedFd<'_>) -> Result<Region, CommError> {
        let unknown = "(opening by fd)";
        let owned = fd
            .try_clone_to_owned()
            .map_err(|e| io_err(unknown, "duplicating the group's descriptor", e))?;
        let file = File::from(owned);
        let size = rustix::fs::fstat(&file)
            .map_err(|e| io_err(unknown, "fstat of the group's descriptor", e))?
            .st_size;
        let size = usize::try_from(size).unwrap_or(0);
        let not_ours = |message: String| CommError::Protocol {
            group: unknown.to_string(),
            message,
        };
        if size < hdr::SIZE {
            return Err(not_ours(format!(
                "the descriptor is {size} bytes long, not an adag CPU communicator region"
            )));
        }
        // The header first; the rest once the header says how much every rank maps whole.
        let map = MmapOptions::new()
            .len(hdr::SIZE)
            .map_raw(&file)
            .map_err(|e| io_err(unknown, "mapping the group's shared memory", e))?;
        let mut region = Region {
            map,
            arena_maps: Box::new([]),
            file,
            layout: Layout {
                world: 1,
                chunk: LINE,
                slots: 0,
                slot_stride: 0,
                mbox_ctrl: 0,
                mbox_data: 0,
                arenas: hdr::SIZE,
                arena: 0,
                total: size,
            },
            id: CommId::from_u128(0),
            label: String::new(),
            name: unknown.to_string(),
            timeout: DEFAULT_TIMEOUT,
            spin: Duration::ZERO,
            yield_for: Duration::ZERO,
        };
        if region.u64_at(hdr::MAGIC).load(Ordering::Acquire) != MAGIC {
            return Err(not_ours(
                "the descriptor is not an adag CPU communicator region (bad magic)".into(),
            ));
        }
        let version = region.u32_at(hdr::VERSION).load(Ordering::Relaxed);
        if version != VERSION {
            return Err(not_ours(format!(
                "the region has protocol version {version} but this build speaks {VERSION}; run the same adag build in every process"
            )));
        }
        let world = region.u32_at(hdr::WORLD).load(Ordering::Relaxed) as usize;
        let chunk = region.u64_at(hdr::CHUNK).load(Ordering::Relaxed) as usize;
        let total = region.u64_at(hdr::TOTAL).load(Ordering::Relaxed) as usize;
        let arena = region.u64_at(hdr::ARENA).load(Ordering::Relaxed) as usize;
        let layout = (1..=MAX_WORLD_SIZE)
            .contains(&world)
            .then(|| Layout::new(world, chunk, arena))
            .flatten()
            .filter(|l| l.total == total && total == size && l.chunk == chunk)
            .ok_or_else(|| {
                not_ours(format!(
                    "inconsistent header (world {world}, chunk {chunk}, single-copy areas of {arena} bytes, {total} bytes in a {size}-byte region)"
                ))
            })?;
        let id = CommId::from_u128(
            (u128::from(region.u64_at(hdr::ID_HI).load(Ordering::Relaxed)) << 64)
                | u128::from(region.u64_at(hdr::ID_LO).load(Ordering::Relaxed)),
        );
        let label_len =
            (region.u32_at(hdr::LABEL_LEN).load(Ordering::Relaxed) as usize).min(LABEL_MAX);
        let mut label = vec![0u8; label_len];
        // SAFETY: the label area is written once by the creator before the magic is stored
        // (Release, loaded above with Acquire) and never again.
        unsafe { region.read(hdr::LABEL, &mut label) };
        let ns = |off| Duration::from_nanos(region.u64_at(off).load(Ordering::Relaxed));
        let (timeout, spin, yield_for) = (ns(hdr::TIMEOUT_NS), ns(hdr::SPIN_NS), ns(hdr::YIELD_NS));
        region.map = MmapOptions::new()
            .len(layout.arenas)
            .map_raw(&region.file)
            .map_err(|e| io_err(unknown, "mapping the group's shared memory", e))?;
        region.arena_maps = (0..world).map(|_| OnceLock::new()).collect();
        region.timeout = timeout;
        region.spin = spin;
        region.yield_for = yield_for;
        region.layout = layout;
        region.id = id;
        region.label = String::from_utf8_lossy(&label).into_owned();
        region.name = format!("{} ({id})", region.label);
        Ok(region)
    }

    fn u32_at(&self, off: usize) -> &AtomicU32 {
        assert!(off.is_multiple_of(4) && off + 4 <= self.map.len());
        // SAFETY: the mapping is at least `off + 4` bytes long (checked), page aligned, so
        // `off % 4 == 0` makes the pointer aligned for AtomicU32; it lives as long as `self`;
        // and every access of every process to this word is atomic (the protocol's control
        // words are only ever touched through these accessors).
        unsafe { AtomicU32::from_ptr(self.map.as_mut_ptr().add(off).cast()) }
    }

    fn u64_at(&self, off: usize) -> &AtomicU64 {
        assert!(off.is_multiple_of(8) && off + 8 <= self.map.len());
        // SAFETY: as in `u32_at`, with 8-byte alignment.
        unsafe { AtomicU64::from_ptr(self.map.as_mut_ptr().add(off).cast()) }
    }

    /// Copies `src` into the region at `off`.
    ///
    /// # Safety
    /// No other thread or process may access `off..off + src.len()` during the copy: the
    /// caller owns that slot or entry under the protocol.
    unsafe fn write(&self, off: usize, src: &[u8]) {
        assert!(
            off.checked_add(src.len())
                .is_some_and(|e| e <= self.map.len())
        );
        // SAFETY: in bounds (checked); exclusive access is the caller's contract; `src` is
        // a separate allocation, so the ranges do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.map.as_mut_ptr().add(off), src.len())
        }
    }

    /// Copies from the region at `off` into `dst`.
    ///
    /// # Safety
    /// No other thread or process may write `off..off + dst.len()` during the copy.
    unsafe fn read(&self, off: usize, dst: &mut [u8]) {
        assert!(
            off.checked_add(dst.len())
                .is_some_and(|e| e <= self.map.len())
        );
        // SAFETY: in bounds (checked); no concurrent writer is the caller's contract.
        unsafe {
            std::ptr::copy_nonoverlapping(self.map.as_ptr().add(off), dst.as_mut_ptr(), dst.len())
        }
    }

    /// Borrows `len` bytes of the region at `off`.
    ///
    /// # Safety
    /// No other thread or process may write those bytes while the slice lives.
    unsafe fn slice(&self, off: usize, len: usize) -> &[u8] {
        assert!(off.checked_add(len).is_some_and(|e| e <= self.map.len()));
        // SAFETY: in bounds (checked) of a mapping that lives as long as `self`; no concurrent
        // writer is the caller's contract.
        unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(off), len) }
    }

    /// The single-copy area of `rank`, mapped on first use.
    fn arena(&self, rank: usize) -> Result<&MmapRaw, CommError> {
        let cell = &self.arena_maps[rank];
        if let Some(map) = cell.get() {
            return Ok(map);
        }
        let l = &self.layout;
        let map = MmapOptions::new()
            .offset((l.arenas + rank * l.arena) as u64)
            .len(l.arena)
            .map_raw(&self.file)
            .map_err(|e| {
                io_err(
                    &self.name,
                    &format!("mapping the single-copy area of rank {rank}"),
                    e,
                )
            })?;
        // Another thread may have mapped it meanwhile: then ours is unmapped here.
        let _ = cell.set(map);
        Ok(cell.get().expect("set above"))
    }

    /// A word of a block header in a single-copy area.
    fn arena_u32(map: &MmapRaw, off: usize) -> &AtomicU32 {
        assert!(off.is_multiple_of(4) && off + 4 <= map.len());
        // SAFETY: in bounds (checked) of a page-aligned mapping, so aligned for AtomicU32; it
        // lives as long as `map`; and every process touches the words of block headers only
        // through these accessors (atomically).
        unsafe { AtomicU32::from_ptr(map.as_mut_ptr().add(off).cast()) }
    }

    /// See [`Region::arena_u32`].
    fn arena_u64(map: &MmapRaw, off: usize) -> &AtomicU64 {
        assert!(off.is_multiple_of(8) && off + 8 <= map.len());
        // SAFETY: as in `arena_u32`, with 8-byte alignment.
        unsafe { AtomicU64::from_ptr(map.as_mut_ptr().add(off).cast()) }
    }

    /// Gives the memory of `len` bytes of `rank`'s single-copy area at `off` back to the
    /// kernel: they read as zeros from then on, in every process.
    fn punch(&self, rank: usize, off: usize, len: usize) {
        if len == 0 {
            return;
        }
        let at = self.layout.arenas + rank * self.layout.arena + off;
        let flags = rustix::fs::FallocateFlags::PUNCH_HOLE | rustix::fs::FallocateFlags::KEEP_SIZE;
        if let Err(err) = rustix::fs::fallocate(&self.file, flags, at as u64, len as u64) {
            // Only memory use: the range stays valid.
            tracing::debug!(%err, at, len, "could not give back memory of a CPU group");
        }
    }

    /// Copies the header of a slot or entry.
    ///
    /// # Safety
    /// As [`Region::read`]: its owner published it (observed with Acquire) and does not
    /// rewrite it before the caller releases it.
    unsafe fn read_meta(&self, off: usize) -> Meta {
        let mut m = Meta::new_zeroed();
        // SAFETY: the caller's contract.
        unsafe { self.read(off, m.as_mut_bytes()) };
        m
    }

    fn state(&self) -> u32 {
        self.u32_at(hdr::STATE).load(Ordering::SeqCst)
    }

    fn stopped(&self) -> Option<Stop> {
        match self.state() {
            STATE_LIVE => None,
            STATE_DESTROYED => Some(Stop::Destroyed),
            s => Some(Stop::Aborted {
                by: (s & 0xffff) as usize,
                code: (s >> 16) & 0x7fff,
            }),
        }
    }

    fn coll_event(&self) -> Event {
        Event {
            word: hdr::COLL_EVENT,
            sleepers: hdr::COLL_SLEEPERS,
        }
    }

    fn notify(&self, ev: Event) {
        let word = self.u32_at(ev.word);
        word.fetch_add(1, Ordering::SeqCst);
        if self.u32_at(ev.sleepers).load(Ordering::SeqCst) != 0 {
            let _ = futex::wake(word, futex::Flags::empty(), i32::MAX as u32);
        }
    }

    fn wake_all(&self) {
        let l = &self.layout;
        let mut events = vec![self.coll_event()];
        for p in 0..l.world * (l.world - 1) {
            let c = l.mbox_ctrl(p);
            events.push(Event {
                word: c + mbox::RX_EVENT,
                sleepers: c + mbox::RX_SLEEPERS,
            });
            events.push(Event {
                word: c + mbox::TX_EVENT,
                sleepers: c + mbox::TX_SLEEPERS,
            });
        }
        for ev in events {
            let word = self.u32_at(ev.word);
            word.fetch_add(1, Ordering::SeqCst);
            let _ = futex::wake(word, futex::Flags::empty(), i32::MAX as u32);
        }
    }

    fn destroy(&self) {
        let _ = self.u32_at(hdr::STATE).compare_exchange(
            STATE_LIVE,
            STATE_DESTROYED,
            Ordering::SeqCst,
            Ordering::SeqCst,
        );
        self.wake_all();
    }

    fn abort(&self, rank: usize, code: u32) {
        let s = STATE_ABORTED | (code << 16) | (rank as u32 & 0xffff);
        let _ = self.u32_at(hdr::STATE).compare_exchange(
            STATE_LIVE,
            s,
            Ordering::SeqCst,
            Ordering::SeqCst,
        );
        self.wake_all();
    }

    /// Waits until `ready()` holds: spin, then yield, then sleep on the event's futex in
    /// bounded slices, until `deadline`; stops early when the group is destroyed or aborted.
    fn wait(
        &self,
        ev: Event,
        deadline: Instant,
        mut ready: impl FnMut() -> bool,
    ) -> Result<(), Stop> {
        if ready() {
            return Ok(());
        }
        let start = Instant::now();
        let mut round = 0u32;
        while start.elapsed() < self.spin {
            for _ in 0..(1u32 << round.min(6)) {
                std::hint::spin_loop();
            }
            round += 1;
            if ready() {
                return Ok(());
            }
            if let Some(s) = self.stopped() {
                return Err(s);
            }
        }
        let yield_until = start + self.spin + self.yield_for;
        loop {
            if ready() {
                return Ok(());
            }
            if let Some(s) = self.stopped() {
                return Err(s);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Stop::Timeout);
            }
            if now >= yield_until {
                break;
            }
            std::thread::yield_now();
        }
        let word = self.u32_at(ev.word);
        let sleepers = self.u32_at(ev.sleepers);
        loop {
            let now = Instant::now();
            if now >= deadline {
                return if ready() { Ok(()) } else { Err(Stop::Timeout) };
            }
            // Register as a sleeper, then read the word, then recheck: a publisher that
            // changed the condition after our check bumps the word (so the futex wait returns
            // at once) and sees our registration (so it calls wake).
            sleepers.fetch_add(1, Ordering::SeqCst);
            let seen = word.load(Ordering::SeqCst);
            let stop = self.stopped();
            if ready() || stop.is_some() {
                sleepers.fetch_sub(1, Ordering::SeqCst);
                return match stop {
                    Some(s) if !ready() => Err(s),
                    _ => Ok(()),
                };
            }
            let slice = (deadline - now).min(SLEEP_SLICE);
            let ts = futex::Timespec {
                tv_sec: slice.as_secs() as _,
                tv_nsec: slice.subsec_nanos() as _,
            };
            let r = futex::wait(word, futex::Flags::empty(), seen, Some(&ts));
            sleepers.fetch_sub(1, Ordering::SeqCst);
            if let Err(e) = r
                && e != rustix::io::Errno::AGAIN
                && e != rustix::io::Errno::TIMEDOUT
                && e != rustix::io::Errno::INTR
            {
                // No futex (a seccomp filter, an exotic kernel): poll slowly instead.
                std::thread::sleep(slice.min(Duration::from_millis(1)));
            }
            if ready() {
                return Ok(());
            }
            if let Some(s) = self.stopped() {
                return Err(s);
            }
        }
    }
}

/// A group of CPU communicators over one shared-memory region; it owns the region's
/// descriptor. Cheap to clone (shared).
///
/// ```
/// use adag::comm::{Communicator, cpu::CpuGroup};
/// use adag::tensor::{DType, Tensor};
///
/// let group = CpuGroup::create(2, "pair")?;
/// let (a, b) = (group.communicator(0)?, group.communicator(1)?);
/// a.send(&Tensor::from(vec![1u8, 2, 3]), 1)?;
/// assert_eq!(b.recv(&[3], DType::U8, 0)?.as_slice::<u8>()?, &[1, 2, 3]);
/// group.destroy();
/// assert!(a.send(&Tensor::from(vec![1u8]), 1).is_err());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct CpuGroup {
    region: Arc<Region>,
}

impl CpuGroup {
    /// A group of `world_size` ranks with default options. `label` names the group in errors
    /// and in `/proc/*/fd` (the memfd's name).
    pub fn create(world_size: usize, label: &str) -> Result<CpuGroup, CommError> {
        Self::with_options(world_size, label, &CpuGroupOptions::default())
    }

    /// A group of `world_size` ranks with these options.
    pub fn with_options(
        world_size: usize,
        label: &str,
        options: &CpuGroupOptions,
    ) -> Result<CpuGroup, CommError> {
        Ok(CpuGroup {
            region: Arc::new(Region::create(world_size, label, options)?),
        })
    }

    /// The communicator of `rank` in this process.
    pub fn communicator(&self, rank: usize) -> Result<CpuCommunicator, CommError> {
        CpuCommunicator::attach(self.region.clone(), rank)
    }

    /// The region's descriptor (close-on-exec), for another process to open a rank with
    /// [`CpuCommunicator::open`]: pass it with `SCM_RIGHTS`, or `dup` it (which clears
    /// close-on-exec) before spawning a child that inherits it.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.region.file.as_fd()
    }

    /// The group's identity.
    pub fn id(&self) -> CommId {
        self.region.id
    }

    /// The label given at creation (truncated to 96 bytes).
    pub fn label(&self) -> &str {
        &self.region.label
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.region.layout.world
    }

    /// The chunk size in bytes (after rounding).
    pub fn chunk_bytes(&self) -> usize {
        self.region.layout.chunk
    }

    /// The size of the shared-memory region in bytes, single-copy areas included (virtual;
    /// pages are allocated on use).
    pub fn region_bytes(&self) -> usize {
        self.region.layout.total
    }

    /// Destroys the group: every rank, in every process, blocked or not, gets
    /// [`CommError::Destroyed`] from then on. Idempotent.
    pub fn destroy(&self) {
        self.region.destroy();
    }

    /// Whether the group was destroyed or aborted.
    pub fn is_destroyed(&self) -> bool {
        self.region.stopped().is_some()
    }
}

impl CommunicatorGroup for CpuGroup {
    fn id(&self) -> CommId {
        self.region.id
    }
    fn world_size(&self) -> usize {
        self.region.layout.world
    }
    fn transport_name(&self) -> &str {
        TRANSPORT
    }
    fn communicator(&self, rank: usize) -> Result<Arc<dyn Communicator>, CommError> {
        Ok(Arc::new(CpuGroup::communicator(self, rank)?))
    }
    fn ticket(&self) -> Result<GroupTicket, CommError> {
        Ok(GroupTicket {
            id: self.region.id,
            transport: TRANSPORT.to_string(),
            world_size: self.region.layout.world,
            payload: Vec::new(),
        })
    }
    fn fds(&self) -> Vec<BorrowedFd<'_>> {
        vec![self.fd()]
    }
    fn destroy(&self) {
        self.region.destroy();
    }
    fn send_completion(&self) -> SendCompletion {
        SendCompletion::Buffered
    }
}

/// Makes [`CpuGroup`]s (`transport_name() == "cpu"`) and opens their ranks from tickets.
#[derive(Debug, Clone, Default)]
pub struct CpuFactory {
    /// The options of the groups it makes.
    pub options: CpuGroupOptions,
}

impl CommunicatorFactory for CpuFactory {
    fn transport_name(&self) -> &str {
        TRANSPORT
    }

    fn send_completion(&self) -> SendCompletion {
        SendCompletion::Buffered
    }

    fn create_group(
        &self,
        world_size: usize,
        label: &str,
    ) -> Result<Arc<dyn CommunicatorGroup>, CommError> {
        Ok(Arc::new(CpuGroup::with_options(
            world_size,
            label,
            &self.options,
        )?))
    }

    fn open(
        &self,
        ticket: &GroupTicket,
        fds: Vec<OwnedFd>,
        rank: usize,
    ) -> Result<Arc<dyn Communicator>, CommError> {
        let Some(fd) = fds.first() else {
            return Err(CommError::Config {
                message: format!(
                    "opening rank {rank} of CPU group {} needs the group's descriptor, and none came with the ticket",
                    ticket.id
                ),
            });
        };
        let c = CpuCommunicator::open(fd, rank)?;
        if c.region.id != ticket.id || c.world_size() != ticket.world_size {
            return Err(CommError::Config {
                message: format!(
                    "the descriptor is CPU group {} of {} ranks but the ticket names group {} of {} ranks",
                    c.region.id,
                    c.world_size(),
                    ticket.id,
                    ticket.world_size
                ),
            });
        }
        Ok(Arc::new(c))
    }
}

/// One rank of a [`CpuGroup`], in this process or another.
pub struct CpuCommunicator {
    region: Arc<Region>,
    rank: usize,
    timeout_ns: AtomicU64,
    coll: Mutex<()>,
    send_locks: Box<[Mutex<()>]>,
    recv_locks: Box<[Mutex<()>]>,
    /// The blocks of this rank's single-copy area, read from their headers on first use.
    blocks: Mutex<Option<Blocks>>,
}

impl fmt::Debug for CpuCommunicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CpuCommunicator")
            .field("group", &self.region.name)
            .field("rank", &self.rank)
            .field("world_size", &self.region.layout.world)
            .finish()
    }
}

impl Drop for CpuCommunicator {
    fn drop(&mut self) {
        self.region
            .u32_at(self.region.layout.rank_ctrl(self.rank) + rank_ctrl::ATTACHED)
            .store(0, Ordering::Release);
    }
}

/// A chunk's place in a collective: which bytes of the tensor it carries.
struct Chunk {
    offset: usize,
    len: usize,
}

/// One block of a rank's single-copy area, as its sender knows it.
#[derive(Debug, Clone, Copy)]
struct BlockInfo {
    /// Offset in the area.
    off: usize,
    /// Bytes, header included (a multiple of the page).
    size: usize,
    /// Whether its data pages are (probably) allocated: false once given back.
    resident: bool,
    /// When it was last taken (`Blocks::tick`).
    used: u64,
}

/// The index of a rank's single-copy area, kept by the communicator that holds the rank.
/// The headers in shared memory are the truth (a rank opened again reads them back, so a
/// block that a receiver still holds is never reused); this index only spares the walk.
#[derive(Debug, Default)]
struct Blocks {
    /// In offset order, back to back from 0 to `top`.
    list: Vec<BlockInfo>,
    top: usize,
    tick: u64,
}

impl Blocks {
    /// The blocks that `rank`'s area holds, from their headers (walked from 0 to the
    /// rank's `BULK_TOP`).
    fn read(region: &Region, rank: usize, map: &MmapRaw) -> Blocks {
        let top_word = region.u64_at(region.layout.rank_ctrl(rank) + rank_ctrl::BULK_TOP);
        let top = (top_word.load(Ordering::Acquire) as usize).min(map.len());
        let mut list = Vec::new();
        let mut off = 0;
        while off < top {
            let size = Region::arena_u64(map, off + block::SIZE).load(Ordering::Acquire) as usize;
            if size == 0 || !size.is_multiple_of(PAGE) || off + size > top {
                break;
            }
            list.push(BlockInfo {
                off,
                size,
                resident: true,
                used: 0,
            });
            off += size;
        }
        // Anything past a header that does not add up is never read again.
        top_word.store(off as u64, Ordering::Release);
        Blocks {
            list,
            top: off,
            tick: 0,
        }
    }
}

/// A tensor's bytes read in place from a sender's single-copy area: frees the block (its
/// header's `BUSY` word) when the last tensor sharing them is dropped.
struct BulkLease {
    region: Arc<Region>,
    /// The sender: whose area.
    rank: usize,
    /// The block's offset in the area.
    off: usize,
    len: usize,
}

impl AsRef<[u8]> for BulkLease {
    fn as_ref(&self) -> &[u8] {
        let map = self.region.arena_maps[self.rank]
            .get()
            .expect("mapped before the lease was made");
        assert!(self.off + BLOCK_HEADER + self.len <= map.len());
        // SAFETY: in bounds (checked) of a mapping that `self.region` keeps alive. Nobody
        // writes these bytes while the lease lives: the sender wrote them before publishing
        // the message (its Release store of the mailbox's head, which the receiver loaded
        // with Acquire before making the lease), set the block's BUSY word first, and writes
        // a block again only after loading BUSY == 0 (Acquire), which only the lease's drop
        // stores (Release), after its last read.
        unsafe { std::slice::from_raw_parts(map.as_ptr().add(self.off + BLOCK_HEADER), self.len) }
    }
}

impl Drop for BulkLease {
    fn drop(&mut self) {
        if let Some(map) = self.region.arena_maps[self.rank].get() {
            Region::arena_u32(map, self.off + block::BUSY).store(0, Ordering::Release);
        }
    }
}

impl CpuCommunicator {
    /// Opens `rank` of the group whose region is `fd` (received from the process that made
    /// the group). The descriptor is duplicated; the caller may close its own.
    ///
    /// ```
    /// use adag::comm::cpu::{CpuCommunicator, CpuGroup};
    /// use adag::comm::{Communicator, CommunicatorGroup, ReduceOp};
    /// use adag::Tensor;
    ///
    /// // A process that received the group's descriptor (here: the one that made it).
    /// let group = CpuGroup::create(1, "doc")?;
    /// let comm = CpuCommunicator::open(group.fds()[0], 0)?;
    /// let t = Tensor::from_vec(vec![1.0f32, 2.0], [2])?;
    /// let sum = comm.allreduce(&t, ReduceOp::Sum)?;
    /// assert_eq!(sum.to_vec::<f32>()?, vec![1.0, 2.0]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn open(fd: impl AsFd, rank: usize) -> Result<CpuCommunicator, CommError> {
        Self::attach(Arc::new(Region::open(fd.as_fd())?), rank)
    }

    fn attach(region: Arc<Region>, rank: usize) -> Result<CpuCommunicator, CommError> {
        let world = region.layout.world;
        if rank >= world {
            return Err(CommError::InvalidRank {
                group: region.name.clone(),
                rank,
                world_size: world,
            });
        }
        if region
            .u32_at(region.layout.rank_ctrl(rank) + rank_ctrl::ATTACHED)
            .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return Err(CommError::RankInUse {
                group: region.name.clone(),
                rank,
            });
        }
        let timeout_ns = AtomicU64::new(duration_ns(region.timeout));
        Ok(CpuCommunicator {
            rank,
            timeout_ns,
            coll: Mutex::new(()),
            send_locks: (0..world).map(|_| Mutex::new(())).collect(),
            recv_locks: (0..world).map(|_| Mutex::new(())).collect(),
            blocks: Mutex::new(None),
            region,
        })
    }

    /// The deadline of each blocking call from now on (this communicator only).
    pub fn set_timeout(&self, timeout: Duration) {
        self.timeout_ns
            .store(duration_ns(timeout), Ordering::Relaxed);
    }

    /// The deadline of each blocking call.
    pub fn timeout(&self) -> Duration {
        Duration::from_nanos(self.timeout_ns.load(Ordering::Relaxed))
    }

    /// The group's label.
    pub fn label(&self) -> &str {
        &self.region.label
    }

    fn deadline(&self) -> Instant {
        let now = Instant::now();
        now.checked_add(self.timeout())
            .unwrap_or_else(|| now + Duration::from_secs(86_400 * 365))
    }

    fn group(&self) -> String {
        self.region.name.clone()
    }

    fn stop_error(
        &self,
        stop: Stop,
        op: CommOp,
        waiting_for: impl FnOnce() -> String,
    ) -> CommError {
        match stop {
            Stop::Timeout => CommError::Timeout {
                group: self.group(),
                rank: self.rank,
                op,
                waiting_for: waiting_for(),
                timeout: self.timeout(),
            },
            Stop::Destroyed => CommError::Destroyed {
                group: self.group(),
                rank: self.rank,
                op,
            },
            Stop::Aborted { by, code } => CommError::Aborted {
                group: self.group(),
                rank: self.rank,
                op,
                by,
                reason: abort_reason(code).to_string(),
            },
        }
    }

    fn check_live(&self, op: CommOp) -> Result<(), CommError> {
        match self.region.stopped() {
            None => Ok(()),
            Some(s) => Err(self.stop_error(s, op, String::new)),
        }
    }

    fn check_peer(&self, peer: usize, op: CommOp) -> Result<(), CommError> {
        if peer >= self.region.layout.world || peer == self.rank {
            return Err(CommError::InvalidPeer {
                group: self.group(),
                rank: self.rank,
                peer,
                op,
                world_size: self.region.layout.world,
            });
        }
        Ok(())
    }

    fn protocol_error(&self, code: u32, message: String) -> CommError {
        self.region.abort(self.rank, code);
        CommError::Protocol {
            group: self.group(),
            message: format!("rank {}: {message}", self.rank),
        }
    }

    fn rank_word(&self, q: usize, which: usize) -> &AtomicU64 {
        self.region.u64_at(self.region.layout.rank_ctrl(q) + which)
    }

    /// Waits until every rank's counter `which` is at least `target`. A timeout aborts the
    /// group (the ranks that did arrive cannot tell this rank left).
    fn wait_ranks(
        &self,
        which: usize,
        target: u64,
        deadline: Instant,
        op: CommOp,
    ) -> Result<(), CommError> {
        let world = self.region.layout.world;
        let all = || (0..world).all(|q| self.rank_word(q, which).load(Ordering::Acquire) >= target);
        self.region
            .wait(self.region.coll_event(), deadline, all)
            .map_err(|stop| {
                if matches!(stop, Stop::Timeout) {
                    self.region.abort(self.rank, ABORT_COLLECTIVE_TIMEOUT);
                }
                self.stop_error(stop, op, || {
                    let late: Vec<usize> = (0..world)
                        .filter(|&q| self.rank_word(q, which).load(Ordering::Acquire) < target)
                        .collect();
                    if which == rank_ctrl::READY {
                        format!("ranks {late:?} to call {op}")
                    } else {
                        format!("ranks {late:?} to finish the previous collective round")
                    }
                })
            })
    }

    /// This rank's meta for round 0, and its local error with the text peers will see.
    fn local_meta(
        &self,
        kind: u32,
        op: CommOp,
        reduce: Option<ReduceOp>,
        t: &Tensor,
    ) -> (Meta, Option<(CommError, String)>) {
        let mut m = Meta::new_zeroed();
        m.kind = kind;
        m.op = reduce.map_or(0, ReduceOp::code);
        m.dtype = t.dtype().code();
        m.ndim = t.ndim().min(MAX_DIMS) as u32;
        for (s, &d) in m.shape.iter_mut().zip(t.shape()) {
            *s = d as u64;
        }
        let err = match t.as_bytes() {
            Err(source) => {
                let text = format!("its tensor: {source}");
                Some((
                    CommError::Tensor {
                        group: self.group(),
                        rank: self.rank,
                        op,
                        source,
                    },
                    text,
                ))
            }
            Ok(_) if t.ndim() > MAX_DIMS => {
                let reason = format!(
                    "rank {} passed a tensor of {} dimensions; the CPU communicator takes at most {MAX_DIMS}; reshape it",
                    self.rank,
                    t.ndim()
                );
                Some((
                    CommError::Unsupported {
                        transport: TRANSPORT.into(),
                        op,
                        reason: reason.clone(),
                    },
                    reason,
                ))
            }
            Ok(b) => {
                m.nbytes = b.len() as u64;
                None
            }
        };
        if err.is_some() {
            m.status = 1;
        }
        (m, err)
    }

    /// The verdict of round 0, the same on every rank (up to which peer it names).
    fn check_round0(
        &self,
        op: CommOp,
        mine: &Meta,
        metas: &[Meta],
        parity: u64,
        local: Option<CommError>,
        t: &Tensor,
    ) -> Result<(), CommError> {
        if let Some(e) = local {
            return Err(e);
        }
        if let Some((q, m)) = metas.iter().enumerate().find(|(_, m)| m.status != 0) {
            let len = (m.len as usize).min(self.region.layout.chunk);
            let mut text = vec![0u8; len];
            // SAFETY: rank q published this slot for the current round (ready[q] observed
            // with Acquire by the caller) and does not rewrite it before this rank's done.
            unsafe {
                self.region
                    .read(self.region.layout.slot(q, parity) + META, &mut text)
            };
            return Err(CommError::PeerFailed {
                group: self.group(),
                rank: self.rank,
                op,
                peer: q,
                reason: String::from_utf8_lossy(&text).into_owned(),
            });
        }
        if let Some((q, m)) = metas.iter().enumerate().find(|(_, m)| !m.same_call(mine)) {
            return Err(CommError::Mismatch {
                group: self.group(),
                rank: self.rank,
                peer: q,
                op,
                expected: mine.describe(),
                found: m.describe(),
            });
        }
        let world = self.region.layout.world;
        if mine.kind == KIND_REDUCESCATTER && t.shape().first().is_none_or(|&d0| d0 % world != 0) {
            return Err(CommError::Uneven {
                group: self.group(),
                rank: self.rank,
                op,
                shape: t.shape().to_vec(),
                world_size: world,
            });
        }
        Ok(())
    }

    fn collective(
        &self,
        kind: u32,
        reduce: Option<ReduceOp>,
        t: &Tensor,
    ) -> Result<Tensor, CommError> {
        let op = match kind {
            KIND_ALLREDUCE => CommOp::AllReduce(reduce.unwrap_or(ReduceOp::Sum)),
            KIND_ALLGATHER => CommOp::AllGather,
            _ => CommOp::ReduceScatter(reduce.unwrap_or(ReduceOp::Sum)),
        };
        let _serial = self.coll.lock();
        self.check_live(op)?;
        let deadline = self.deadline();
        let region = &*self.region;
        let (world, chunk, r) = (region.layout.world, region.layout.chunk, self.rank);
        let (mut meta, local) = self.local_meta(kind, op, reduce, t);
        let (mut local, text) = match local {
            Some((e, text)) => (Some(e), Some(text)),
            None => (None, None),
        };
        // A rank whose tensor is unusable sends the reason instead, in one round.
        let (data, nbytes): (&[u8], usize) = match &text {
            None => {
                let d = t.as_bytes().unwrap_or(&[]);
                (d, d.len())
            }
            Some(text) => {
                let mut n = text.len().min(chunk);
                while !text.is_char_boundary(n) {
                    n -= 1;
                }
                (&text.as_bytes()[..n], 0)
            }
        };
        let nchunks = nbytes.div_ceil(chunk).max(1);
        let base = self.rank_word(r, rank_ctrl::READY).load(Ordering::Relaxed);
        let mut out: Option<(AlignedBuf, Vec<usize>)> = None;
        for c in 0..nchunks {
            let k = base + c as u64;
            let parity = k % 2;
            let ch = Chunk {
                offset: c * chunk,
                len: (data.len() - c * chunk).min(chunk),
            };
            // Slot k % 2 was last read in round k - 2: wait until every rank finished it.
            if k >= 1 {
                self.wait_ranks(rank_ctrl::DONE, k - 1, deadline, op)?;
            }
            meta.seq = k;
            meta.offset = ch.offset as u64;
            meta.len = ch.len as u64;
            let slot = region.layout.slot(r, parity);
            // SAFETY: this rank owns its slot k % 2 now: every rank finished reading round
            // k - 2 (waited above) and none reads round k before `ready[r] = k + 1` below.
            unsafe {
                region.write(slot, meta.as_bytes());
                region.write(slot + META, &data[ch.offset..ch.offset + ch.len]);
            }
            self.rank_word(r, rank_ctrl::READY)
                .store(k + 1, Ordering::SeqCst);
            region.notify(region.coll_event());
            self.wait_ranks(rank_ctrl::READY, k + 1, deadline, op)?;
            if c == 0 {
                // SAFETY: every rank q published round k (ready[q] >= k + 1, Acquire) and
                // does not rewrite slot k % 2 before this rank's done[r] = k + 1.
                let metas: Vec<Meta> = (0..world)
                    .map(|q| unsafe { region.read_meta(region.layout.slot(q, parity)) })
                    .collect();
                if let Some(q) = metas.iter().position(|m| m.seq != k) {
                    return Err(self.protocol_error(
                        ABORT_PROTOCOL,
                        format!(
                            "rank {q} is at collective round {} where this rank is at {k}",
                            metas[q].seq
                        ),
                    ));
                }
                let verdict = self.check_round0(op, &meta, &metas, parity, local.take(), t);
                if let Err(e) = verdict {
                    self.rank_word(r, rank_ctrl::DONE)
                        .store(k + 1, Ordering::SeqCst);
                    region.notify(region.coll_event());
                    return Err(e);
                }
                out = Some(self.output_for(kind, t, nbytes));
            }
            let (buf, _) = out.as_mut().expect("allocated in round 0");
            // SAFETY: every rank q published round k into its slot k % 2 (ready[q] >= k + 1,
            // observed with Acquire) and does not write that slot again before this rank sets
            // done[r] = k + 1 below, after the last use of these slices.
            let inputs: Vec<&[u8]> = (0..world)
                .map(|q| unsafe { region.slice(region.layout.slot(q, parity) + META, ch.len) })
                .collect();
            self.combine(
                kind,
                reduce,
                t.dtype(),
                &inputs,
                &ch,
                nbytes,
                buf.as_mut_bytes(),
            )
            .map_err(|source| CommError::Tensor {
                group: self.group(),
                rank: r,
                op,
                source,
            })?;
            drop(inputs);
            self.rank_word(r, rank_ctrl::DONE)
                .store(k + 1, Ordering::SeqCst);
            region.notify(region.coll_event());
        }
        let (buf, shape) = out.expect("allocated in round 0");
        Tensor::from_aligned(t.dtype(), shape, buf).map_err(|source| CommError::Tensor {
            group: self.group(),
            rank: r,
            op,
            source,
        })
    }

    fn output_for(&self, kind: u32, t: &Tensor, nbytes: usize) -> (AlignedBuf, Vec<usize>) {
        let world = self.region.layout.world;
        let mut shape = t.shape().to_vec();
        let len = match kind {
            KIND_ALLREDUCE => nbytes,
            KIND_ALLGATHER => {
                if shape.is_empty() {
                    shape = vec![world];
                } else {
                    shape[0] *= world;
                }
                nbytes * world
            }
            _ => {
                shape[0] /= world;
                nbytes / world
            }
        };
        (AlignedBuf::zeroed(len), shape)
    }

    #[allow(clippy::too_many_arguments)]
    fn combine(
        &self,
        kind: u32,
        reduce: Option<ReduceOp>,
        dtype: DType,
        inputs: &[&[u8]],
        ch: &Chunk,
        nbytes: usize,
        out: &mut [u8],
    ) -> Result<(), TensorError> {
        let op = reduce.unwrap_or(ReduceOp::Sum);
        match kind {
            KIND_ALLREDUCE => {
                reduce_bytes(dtype, op, inputs, &mut out[ch.offset..ch.offset + ch.len])
            }
            KIND_ALLGATHER => {
                for (q, input) in inputs.iter().enumerate() {
                    let at = q * nbytes + ch.offset;
                    out[at..at + ch.len].copy_from_slice(input);
                }
                Ok(())
            }
            _ => {
                let seg = nbytes / self.region.layout.world;
                let (seg_lo, seg_hi) = (self.rank * seg, (self.rank + 1) * seg);
                let lo = seg_lo.max(ch.offset);
                let hi = seg_hi.min(ch.offset + ch.len);
                if lo < hi {
                    let parts: Vec<&[u8]> = inputs
                        .iter()
                        .map(|i| &i[lo - ch.offset..hi - ch.offset])
                        .collect();
                    reduce_bytes(dtype, op, &parts, &mut out[lo - seg_lo..hi - seg_lo])?;
                }
                Ok(())
            }
        }
    }

    /// A block of this rank's single-copy area for `n` bytes of data, marked busy: a free one
    /// that fits (the smallest), else a new one carved at the top (after taking back the free
    /// blocks there). `None` when the group has no such area, the tensor is smaller than
    /// [`BULK_MIN_BYTES`], or the area has no room (the mailboxes carry the tensor then).
    /// Keeps the memory of the [`KEEP_FREE`] most recently used free blocks and gives back
    /// that of the others.
    fn take_block(&self, n: usize) -> Option<usize> {
        let region = &*self.region;
        let arena = region.layout.arena;
        if arena == 0 || n < BULK_MIN_BYTES {
            return None;
        }
        let need = align_up(n.checked_add(BLOCK_HEADER)?, PAGE)?;
        if need > arena {
            return None;
        }
        let map = match region.arena(self.rank) {
            Ok(map) => map,
            Err(e) => {
                tracing::debug!(error = %e, "no single-copy area: the tensor goes through the mailbox");
                return None;
            }
        };
        let mut guard = self.blocks.lock();
        let blocks = guard.get_or_insert_with(|| Blocks::read(region, self.rank, map));
        blocks.tick += 1;
        // Only this rank marks a block busy, so a block seen free stays free until taken.
        let mut free: Vec<bool> = blocks
            .list
            .iter()
            .map(|b| Region::arena_u32(map, b.off + block::BUSY).load(Ordering::Acquire) == 0)
            .collect();
        let fit = (0..blocks.list.len())
            .filter(|&i| free[i] && blocks.list[i].size >= need)
            .min_by_key(|&i| (blocks.list[i].size, blocks.list[i].off));
        let chosen = match fit {
            Some(i) => i,
            None => {
                let mut keep = blocks.list.len();
                while keep > 0 && free[keep - 1] {
                    keep -= 1;
                }
                let at = blocks.list.get(keep).map_or(blocks.top, |b| b.off);
                if at.checked_add(need).is_none_or(|end| end > arena) {
                    return None;
                }
                let old_top = blocks.top;
                blocks.list.truncate(keep);
                free.truncate(keep);
                Region::arena_u32(map, at + block::BUSY).store(0, Ordering::Relaxed);
                Region::arena_u64(map, at + block::SIZE).store(need as u64, Ordering::Release);
                blocks.list.push(BlockInfo {
                    off: at,
                    size: need,
                    resident: true,
                    used: 0,
                });
                free.push(true);
                blocks.top = at + need;
                region
                    .u64_at(region.layout.rank_ctrl(self.rank) + rank_ctrl::BULK_TOP)
                    .store(blocks.top as u64, Ordering::Release);
                if old_top > blocks.top {
                    // What the free blocks taken back held past the new one.
                    region.punch(self.rank, blocks.top, old_top - blocks.top);
                }
                blocks.list.len() - 1
            }
        };
        let tick = blocks.tick;
        let b = &mut blocks.list[chosen];
        Region::arena_u32(map, b.off + block::BUSY).store(1, Ordering::Relaxed);
        b.used = tick;
        b.resident = true;
        let off = b.off;
        let mut idle: Vec<usize> = (0..blocks.list.len())
            .filter(|&i| i != chosen && free[i] && blocks.list[i].resident)
            .collect();
        if idle.len() > KEEP_FREE {
            idle.sort_by_key(|&i| std::cmp::Reverse(blocks.list[i].used));
            for &i in &idle[KEEP_FREE..] {
                let b = &mut blocks.list[i];
                // Not its header page: a rank opened again walks the headers.
                region.punch(self.rank, b.off + PAGE, b.size - PAGE);
                b.resident = false;
            }
        }
        Some(off)
    }

    fn mbox_event(&self, pair: usize, rx: bool) -> Event {
        let c = self.region.layout.mbox_ctrl(pair);
        if rx {
            Event {
                word: c + mbox::RX_EVENT,
                sleepers: c + mbox::RX_SLEEPERS,
            }
        } else {
            Event {
                word: c + mbox::TX_EVENT,
                sleepers: c + mbox::TX_SLEEPERS,
            }
        }
    }
}

impl Communicator for CpuCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    /// Buffered: a send returns once its chunks are in the pair's mailbox (`DEPTH` (8) entries
    /// of `chunk_bytes`), or its tensor in a block of the sender's single-copy area and the
    /// one entry naming it in the mailbox, before the peer receives. A larger tensor that goes
    /// in chunks, or more messages queued to the same peer, wait for the receiver to drain
    /// the mailbox.
    fn send_completion(&self) -> SendCompletion {
        SendCompletion::Buffered
    }

    fn world_size(&self) -> usize {
        self.region.layout.world
    }

    fn send(&self, tensor: &Tensor, peer: usize) -> Result<(), CommError> {
        let op = CommOp::Send;
        self.check_peer(peer, op)?;
        let data = tensor.as_bytes().map_err(|source| CommError::Tensor {
            group: self.group(),
            rank: self.rank,
            op,
            source,
        })?;
        if tensor.ndim() > MAX_DIMS {
            return Err(CommError::Unsupported {
                transport: TRANSPORT.into(),
                op,
                reason: format!(
                    "a tensor of {} dimensions; the CPU communicator takes at most {MAX_DIMS}; reshape it",
                    tensor.ndim()
                ),
            });
        }
        let _serial = self.send_locks[peer].lock();
        self.check_live(op)?;
        let deadline = self.deadline();
        let region = &*self.region;
        let layout = &region.layout;
        let pair = layout.pair(self.rank, peer);
        let ctrl = layout.mbox_ctrl(pair);
        let head = region.u32_at(ctrl + mbox::HEAD);
        let tail = region.u32_at(ctrl + mbox::TAIL);
        let seq_word = region.u64_at(ctrl + mbox::SEND_SEQ);
        let seq = seq_word.load(Ordering::Relaxed);
        let mut meta = Meta::new_zeroed();
        meta.seq = seq;
        meta.kind = KIND_P2P;
        meta.nbytes = data.len() as u64;
        meta.dtype = tensor.dtype().code();
        meta.ndim = tensor.ndim() as u32;
        for (s, &d) in meta.shape.iter_mut().zip(tensor.shape()) {
            *s = d as u64;
        }
        // Waits for a free entry for chunk `c`; its index.
        let room_for = |c: usize| -> Result<u32, CommError> {
            let h = head.load(Ordering::Relaxed);
            let room = || h.wrapping_sub(tail.load(Ordering::Acquire)) < DEPTH;
            region
                .wait(self.mbox_event(pair, false), deadline, room)
                .map_err(|stop| {
                    if matches!(stop, Stop::Timeout) && c > 0 {
                        region.abort(self.rank, ABORT_SEND_TIMEOUT);
                    }
                    self.stop_error(stop, op, || {
                        format!(
                            "rank {peer} to receive (its mailbox from rank {} is full)",
                            self.rank
                        )
                    })
                })?;
            Ok(h)
        };
        if data.len() >= BULK_MIN_BYTES && layout.arena > 0 {
            let h = room_for(0)?;
            if let Some(off) = self.take_block(data.len()) {
                let map = region.arena(self.rank)?;
                assert!(off + BLOCK_HEADER + data.len() <= map.len());
                // SAFETY: in bounds (checked). The block is this rank's alone: new, or seen
                // free (BUSY == 0, loaded with Acquire after its last reader's Release store)
                // and marked busy by `take_block`, and no receiver reads it before the
                // Release store of head = h + 1 below. `data` is not in this mapping (a
                // tensor read in place from a single-copy area is another rank's, or a busy
                // block of this one), so the ranges do not overlap.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        data.as_ptr(),
                        map.as_mut_ptr().add(off + BLOCK_HEADER),
                        data.len(),
                    )
                };
                meta.kind = KIND_P2P_BULK;
                meta.block = off as u64;
                let entry = layout.entry(pair, h);
                // SAFETY: entry h % DEPTH is free (as for chunks below).
                unsafe { region.write(entry, meta.as_bytes()) };
                head.store(h.wrapping_add(1), Ordering::SeqCst);
                region.notify(self.mbox_event(pair, true));
                seq_word.store(seq + 1, Ordering::Relaxed);
                return Ok(());
            }
        }
        let nchunks = data.len().div_ceil(layout.chunk).max(1);
        for c in 0..nchunks {
            let h = room_for(c)?;
            let offset = c * layout.chunk;
            let len = (data.len() - offset).min(layout.chunk);
            meta.offset = offset as u64;
            meta.len = len as u64;
            let entry = layout.entry(pair, h);
            // SAFETY: entry h % DEPTH is free: the receiver consumed entry h - DEPTH
            // (tail > h - DEPTH, observed with Acquire) and reads entry h only after the
            // Release store of head = h + 1 below.
            unsafe {
                region.write(entry, meta.as_bytes());
                region.write(entry + META, &data[offset..offset + len]);
            }
            head.store(h.wrapping_add(1), Ordering::SeqCst);
            region.notify(self.mbox_event(pair, true));
        }
        seq_word.store(seq + 1, Ordering::Relaxed);
        Ok(())
    }

    fn recv(&self, shape: &[usize], dtype: DType, peer: usize) -> Result<Tensor, CommError> {
        let op = CommOp::Recv;
        self.check_peer(peer, op)?;
        let tensor_err = |source| CommError::Tensor {
            group: self.group(),
            rank: self.rank,
            op,
            source,
        };
        if shape.len() > MAX_DIMS {
            return Err(CommError::Unsupported {
                transport: TRANSPORT.into(),
                op,
                reason: format!(
                    "a shape of {} dimensions; the CPU communicator takes at most {MAX_DIMS}",
                    shape.len()
                ),
            });
        }
        let expected_bytes = shape
            .iter()
            .try_fold(dtype.size(), |a, &d| a.checked_mul(d))
            .ok_or_else(|| {
                tensor_err(TensorError::ShapeOverflow {
                    dtype,
                    shape: shape.to_vec(),
                })
            })?;
        let _serial = self.recv_locks[peer].lock();
        self.check_live(op)?;
        let deadline = self.deadline();
        let region = &*self.region;
        let layout = &region.layout;
        let pair = layout.pair(peer, self.rank);
        let ctrl = layout.mbox_ctrl(pair);
        let head = region.u32_at(ctrl + mbox::HEAD);
        let tail = region.u32_at(ctrl + mbox::TAIL);
        let seq_word = region.u64_at(ctrl + mbox::RECV_SEQ);
        let seq = seq_word.load(Ordering::Relaxed);
        let mut mine = Meta::new_zeroed();
        mine.dtype = dtype.code();
        mine.ndim = shape.len() as u32;
        mine.nbytes = expected_bytes as u64;
        for (s, &d) in mine.shape.iter_mut().zip(shape) {
            *s = d as u64;
        }
        // A send of another dtype or shape than this recv asks for: the call's error.
        let same_tensor =
            |m: &Meta| m.dtype == mine.dtype && m.ndim == mine.ndim && m.shape == mine.shape;
        let mismatched = |m: &Meta| CommError::Mismatch {
            group: self.group(),
            rank: self.rank,
            peer,
            op,
            expected: format!("a recv of {}", mine.describe()),
            found: format!("a send of {}", m.describe()),
        };
        let mut buf: Option<AlignedBuf> = None;
        let mut mismatch: Option<Meta> = None;
        let mut got = 0usize;
        loop {
            let t = tail.load(Ordering::Relaxed);
            let first = got == 0 && buf.is_none() && mismatch.is_none();
            let has = || head.load(Ordering::Acquire) != t;
            region
                .wait(self.mbox_event(pair, true), deadline, has)
                .map_err(|stop| {
                    if matches!(stop, Stop::Timeout) && !first {
                        region.abort(self.rank, ABORT_RECV_TIMEOUT);
                    }
                    self.stop_error(stop, op, || {
                        format!("rank {peer} to send a {dtype} tensor of shape {shape:?}")
                    })
                })?;
            let entry = layout.entry(pair, t);
            // SAFETY: the sender published entry t (head != t, Acquire) and does not rewrite
            // it before this rank's tail = t + 1.
            let m = unsafe { region.read_meta(entry) };
            let total = m.nbytes as usize;
            if m.kind == KIND_P2P_BULK {
                if !first || m.seq != seq {
                    return Err(self.protocol_error(
                        ABORT_PROTOCOL,
                        format!(
                            "mailbox {peer} -> {}: expected chunk at byte {got} of message {seq}, found message {} in a single-copy block",
                            self.rank, m.seq
                        ),
                    ));
                }
                // The entry is consumed whatever follows: the block is this rank's now.
                tail.store(t.wrapping_add(1), Ordering::SeqCst);
                region.notify(self.mbox_event(pair, false));
                seq_word.store(seq + 1, Ordering::Relaxed);
                let map = region.arena(peer)?;
                let off = m.block as usize;
                let in_area = off.is_multiple_of(PAGE)
                    && off
                        .checked_add(BLOCK_HEADER)
                        .and_then(|e| e.checked_add(total))
                        .is_some_and(|e| e <= map.len());
                if !in_area {
                    return Err(self.protocol_error(
                        ABORT_PROTOCOL,
                        format!(
                            "mailbox {peer} -> {}: message {seq} names {total} bytes at {off}, outside rank {peer}'s single-copy area",
                            self.rank
                        ),
                    ));
                }
                // Frees the block when dropped: on every error below, and once the tensor and
                // its clones are gone.
                let lease = BulkLease {
                    region: self.region.clone(),
                    rank: peer,
                    off,
                    len: total,
                };
                if !same_tensor(&m) {
                    drop(lease);
                    return Err(mismatched(&m));
                }
                if total != expected_bytes {
                    drop(lease);
                    return Err(self.protocol_error(
                        ABORT_PROTOCOL,
                        format!(
                            "mailbox {peer} -> {}: a message of shape {shape:?} announced {total} bytes instead of {expected_bytes}",
                            self.rank
                        ),
                    ));
                }
                return Tensor::from_bytes(dtype, shape.to_vec(), Bytes::from_owner(lease))
                    .map_err(tensor_err);
            }
            if m.seq != seq || m.offset as usize != got || m.len as usize > layout.chunk {
                return Err(self.protocol_error(
                    ABORT_PROTOCOL,
                    format!(
                        "mailbox {peer} -> {}: expected chunk at byte {got} of message {seq}, found byte {} of message {}",
                        self.rank, m.offset, m.seq
                    ),
                ));
            }
            if first {
                if !same_tensor(&m) {
                    mismatch = Some(m);
                } else if total != expected_bytes {
                    return Err(self.protocol_error(
                        ABORT_PROTOCOL,
                        format!(
                            "mailbox {peer} -> {}: a message of shape {shape:?} announced {total} bytes instead of {expected_bytes}",
                            self.rank
                        ),
                    ));
                } else {
                    buf = Some(AlignedBuf::zeroed(expected_bytes));
                }
            }
            let len = m.len as usize;
            if let Some(b) = buf.as_mut() {
                if got + len > b.as_mut_bytes().len() {
                    return Err(self.protocol_error(
                        ABORT_PROTOCOL,
                        format!(
                            "mailbox {peer} -> {}: message longer than its shape",
                            self.rank
                        ),
                    ));
                }
                // SAFETY: the sender published entry t (head != t, observed with Acquire) and
                // does not rewrite it before the Release store of tail = t + 1 below.
                unsafe { region.read(entry + META, &mut b.as_mut_bytes()[got..got + len]) };
            }
            got += len;
            tail.store(t.wrapping_add(1), Ordering::SeqCst);
            region.notify(self.mbox_event(pair, false));
            if got >= total {
                break;
            }
        }
        seq_word.store(seq + 1, Ordering::Relaxed);
        if let Some(m) = mismatch {
            return Err(mismatched(&m));
        }
        let buf = buf.unwrap_or_else(|| AlignedBuf::zeroed(0));
        Tensor::from_aligned(dtype, shape.to_vec(), buf).map_err(tensor_err)
    }

    fn allreduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor, CommError> {
        self.collective(KIND_ALLREDUCE, Some(op), tensor)
    }

    fn allgather(&self, tensor: &Tensor) -> Result<Tensor, CommError> {
        self.collective(KIND_ALLGATHER, None, tensor)
    }

    fn reducescatter(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor, CommError> {
        self.collective(KIND_REDUCESCATTER, Some(op), tensor)
    }

    fn destroy(&self) -> Result<(), CommError> {
        self.region.destroy();
        Ok(())
    }

    fn transport_name(&self) -> &str {
        TRANSPORT
    }

    fn comm_id(&self) -> Option<CommId> {
        Some(self.region.id)
    }
}
