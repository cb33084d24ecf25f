//! The NCCL communicator: [`NcclGroup`], [`NcclCommunicator`], [`NcclFactory`].
//!
//! # How it runs
//!
//! - The group (in the driver) makes the NCCL unique id with `ncclGetUniqueId`; the
//!   [`GroupTicket`] carries it (with the label, the options and the device of each rank) to
//!   worker processes, which open their rank with [`NcclFactory::open`].
//! - Each rank joins with `ncclCommInitRank` on its first operation (or on
//!   [`NcclCommunicator::init`]). That call blocks until every rank has joined, so it runs on
//!   a helper thread and the rank waits for it with its deadline: a rank that never comes is a
//!   [`CommError::Timeout`], not a hang. Every rank must therefore be driven by its own thread
//!   (as thread actors and worker processes are).
//! - Each rank has its own CUDA stream. An operation enqueues its NCCL calls on it, records an
//!   event, and polls the event (spinning briefly, then yielding, then sleeping) until it
//!   completes, the deadline passes, or the group is destroyed. Past the deadline the rank
//!   aborts the NCCL communicators of the group in this process (`ncclCommAbort`, which stops
//!   their kernels) and returns [`CommError::Timeout`]; the other local ranks then get
//!   [`CommError::Aborted`].
//! - `send` returns once the peer has received the tensor: NCCL's point-to-point operations
//!   are rendezvous, not buffered. A `send` with no matching `recv` times out.
//! - Every `send` is preceded by a 128-byte header (dtype and shape) unless
//!   [`NcclOptions::p2p_header`] is off, so that `recv` checks what it receives: a different
//!   dtype or shape is [`CommError::Mismatch`] and the message is consumed. Collectives are not
//!   checked (NCCL has no way to): ranks that disagree on a collective's shape get garbage or a
//!   timeout.
//!
//! # What NCCL cannot do
//!
//! Reductions of `i16` tensors (NCCL has no 16-bit integer type) and `Average` of `bool`
//! tensors are [`CommError::Unsupported`]. `bool` `Sum`/`Max` reduce as a logical or and
//! `Product`/`Min` as a logical and, like the CPU communicator. `f16`/`bf16` reductions are
//! NCCL's (not always accumulated in `f32`), and NCCL does not promise to combine ranks in
//! rank order, so floating-point results may differ in the last bits from the CPU
//! communicator's (every rank still gets the same result).
use crate::device::{Gpu, alloc, device_count, gpu, require_buffer, tensor_from_alloc};
use crate::error::{CudaError, driver_err, guard};
use crate::libs::check_nccl;
use adag::comm::{
    CommError, CommId, CommOp, Communicator, CommunicatorFactory, CommunicatorGroup,
    DEFAULT_TIMEOUT, GroupTicket, ReduceOp, SendCompletion, StreamId, register_factory,
};
use adag::tensor::{DType, Device, Tensor, TensorError};
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use cudarc::nccl::{result as nccl, sys};
use serde::{Deserialize, Serialize};
use std::ffi::{CStr, c_void};
use std::fmt;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak, mpsc};
use std::time::{Duration, Instant};

/// The transport name of the NCCL communicator.
pub const TRANSPORT: &str = "nccl";

/// The most dimensions of a tensor sent point to point (the header holds 12).
pub const MAX_DIMS: usize = 12;

const HEADER_BYTES: usize = 128;
const HEADER_MAGIC: u32 = u32::from_le_bytes(*b"ANC1");
const TICKET_VERSION: u32 = 1;
const UNIQUE_ID_BYTES: usize = 128;

/// Settings of an NCCL group, fixed when it is made and carried by its ticket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NcclOptions {
    /// The deadline of every operation (and of joining the group). Default
    /// [`DEFAULT_TIMEOUT`] (30 s).
    pub timeout: Duration,
    /// The CUDA device of each rank, as an ordinal in the process that opens the rank. Empty
    /// (the default): rank `r` uses device `r % (devices that process sees)`, which is device
    /// 0 where each worker sees one GPU (`CUDA_VISIBLE_DEVICES`).
    pub devices: Vec<u32>,
    /// Send a 128-byte header (dtype, shape) before each point-to-point message so that `recv`
    /// can check it (default `true`). Off, a `recv` of the wrong size is undefined: it may
    /// time out or receive a part of the message.
    pub p2p_header: bool,
}

impl Default for NcclOptions {
    fn default() -> Self {
        NcclOptions {
            timeout: DEFAULT_TIMEOUT,
            devices: Vec::new(),
            p2p_header: true,
        }
    }
}

/// What a ticket carries for NCCL (postcard-encoded in [`GroupTicket::payload`]).
#[derive(Serialize, Deserialize)]
struct TicketPayload {
    version: u32,
    unique_id: Vec<u8>,
    label: String,
    timeout_ns: u64,
    devices: Vec<u32>,
    p2p_header: bool,
}

/// The NCCL version of the loaded library as (major, minor, patch).
pub fn nccl_version() -> Result<(u32, u32, u32), CudaError> {
    check_nccl()?;
    guard("ncclGetVersion", || {
        let v = nccl::get_nccl_version().map_err(|e| nccl_error("ncclGetVersion", &e))?;
        let v = v.max(0) as u32;
        Ok(if v >= 10000 {
            (v / 10000, (v % 10000) / 100, v % 100)
        } else {
            (v / 1000, (v % 1000) / 100, v % 100)
        })
    })
}

/// Registers the NCCL factory (transport `"nccl"`, default [`NcclOptions`]) with
/// [`adag::comm::register_factory`]. Call it in every process (driver and workers) that makes
/// or opens NCCL groups. Registering needs no GPU; making a group without one is a typed error.
pub fn register() {
    register_factory(linked_factory());
}

fn linked_factory() -> Arc<dyn adag::comm::CommunicatorFactory> {
    Arc::new(NcclFactory::default())
}

// Registered at link time too, so worker processes (which never reach `main`) can open ranks.
adag::communicator_factory!(linked_factory);

fn error_string(code: sys::ncclResult_t) -> String {
    let s = std::panic::catch_unwind(|| {
        // SAFETY: ncclGetErrorString returns a static NUL-terminated string.
        let p = unsafe { sys::ncclGetErrorString(code) };
        if p.is_null() {
            None
        } else {
            // SAFETY: see above.
            Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
        }
    });
    let last = std::panic::catch_unwind(|| {
        // SAFETY: ncclGetLastError (NCCL >= 2.13) ignores its argument and returns a
        // thread-local NUL-terminated string; an older library has no such symbol, and cudarc
        // panics, which is caught.
        let p = unsafe { sys::ncclGetLastError(std::ptr::null_mut()) };
        if p.is_null() {
            None
        } else {
            // SAFETY: see above.
            Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
        }
    });
    let mut msg = format!("{code:?}");
    if let Ok(Some(s)) = s {
        msg.push_str(&format!(" ({s})"));
    }
    if let Ok(Some(l)) = last
        && !l.is_empty()
    {
        msg.push_str(&format!(": {l}"));
    }
    msg
}

fn nccl_error(call: &str, e: &nccl::NcclError) -> CudaError {
    CudaError::Nccl {
        call: call.to_string(),
        message: error_string(e.0),
    }
}

/// A raw NCCL communicator, used under its rank's state lock.
struct RawComm(sys::ncclComm_t);
// SAFETY: an NCCL communicator may be used from any thread; the state lock serializes uses.
unsafe impl Send for RawComm {}
// SAFETY: as above.
unsafe impl Sync for RawComm {}

impl RawComm {
    fn abort(&self) {
        // Best effort: the communicator is unusable whatever NCCL says.
        let _ = guard("ncclCommAbort", || {
            // SAFETY: the communicator is live (made by ncclCommInitRank, never aborted: every
            // caller moves the state out of Ready first).
            unsafe { nccl::comm_abort(self.0) }
                .map(|_| ())
                .map_err(|e| nccl_error("ncclCommAbort", &e))
        });
    }
}

/// Why a group stopped.
#[derive(Debug, Clone)]
enum Stop {
    Destroyed,
    Aborted { by: usize, reason: String },
}

/// What the ranks of a group in this process share.
struct GroupShared {
    id: CommId,
    label: String,
    name: String,
    world_size: usize,
    unique_id: sys::ncclUniqueId,
    options: NcclOptions,
    stopped_flag: AtomicBool,
    stop: Mutex<Option<Stop>>,
    ranks: Mutex<Vec<Weak<RankState>>>,
}

impl fmt::Debug for GroupShared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclGroup")
            .field("group", &self.name)
            .field("world_size", &self.world_size)
            .field("stopped", &self.stopped())
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl GroupShared {
    fn stopped(&self) -> Option<Stop> {
        if !self.stopped_flag.load(Ordering::Acquire) {
            return None;
        }
        lock(&self.stop).clone()
    }

    /// Stops the group (the first reason wins) and aborts every rank of it in this process.
    fn stop(&self, why: Stop) {
        {
            let mut s = lock(&self.stop);
            if s.is_none() {
                *s = Some(why);
            }
            self.stopped_flag.store(true, Ordering::Release);
        }
        let ranks: Vec<Arc<RankState>> =
            lock(&self.ranks).iter().filter_map(Weak::upgrade).collect();
        for r in ranks {
            r.stop_local();
        }
    }

    fn stop_error(&self, stop: &Stop, rank: usize, op: CommOp) -> CommError {
        match stop {
            Stop::Destroyed => CommError::Destroyed {
                group: self.name.clone(),
                rank,
                op,
            },
            Stop::Aborted { by, reason } => CommError::Aborted {
                group: self.name.clone(),
                rank,
                op,
                by: *by,
                reason: reason.clone(),
            },
        }
    }

    fn ticket(&self) -> GroupTicket {
        let payload = TicketPayload {
            version: TICKET_VERSION,
            unique_id: self.unique_id.internal.iter().map(|&c| c as u8).collect(),
            label: self.label.clone(),
            timeout_ns: u64::try_from(self.options.timeout.as_nanos()).unwrap_or(u64::MAX),
            devices: self.options.devices.clone(),
            p2p_header: self.options.p2p_header,
        };
        GroupTicket {
            id: self.id,
            transport: TRANSPORT.to_string(),
            world_size: self.world_size,
            payload: postcard::to_stdvec(&payload).unwrap_or_default(),
        }
    }

    fn communicator(self: &Arc<Self>, rank: usize) -> Result<NcclCommunicator, CommError> {
        if rank >= self.world_size {
            return Err(CommError::InvalidRank {
                group: self.name.clone(),
                rank,
                world_size: self.world_size,
            });
        }
        if let Some(stop) = self.stopped() {
            return Err(self.stop_error(&stop, rank, CommOp::Open));
        }
        let device = match self.options.devices.get(rank) {
            Some(&d) => d,
            None if !self.options.devices.is_empty() => {
                return Err(CommError::Config {
                    message: format!(
                        "NCCL group {} names devices for {} ranks but has {}; give one device per rank or none",
                        self.name,
                        self.options.devices.len(),
                        self.world_size
                    ),
                });
            }
            None => {
                let n = device_count().map_err(|e| e.into_comm(&self.name, rank, CommOp::Open))?;
                if n == 0 {
                    return Err(CudaError::NoSuchDevice {
                        ordinal: 0,
                        count: 0,
                    }
                    .into_comm(&self.name, rank, CommOp::Open));
                }
                (rank % n) as u32
            }
        };
        let mut ranks = lock(&self.ranks);
        if ranks.len() < self.world_size {
            ranks.resize_with(self.world_size, Weak::new);
        }
        if ranks[rank].strong_count() > 0 {
            return Err(CommError::RankInUse {
                group: self.name.clone(),
                rank,
            });
        }
        let state = Arc::new(RankState {
            group: self.clone(),
            rank,
            device,
            timeout_ns: AtomicU64::new(
                u64::try_from(self.options.timeout.as_nanos()).unwrap_or(u64::MAX),
            ),
            state: Mutex::new(State::Uninit),
            ops: Mutex::new(()),
        });
        ranks[rank] = Arc::downgrade(&state);
        Ok(NcclCommunicator { inner: state })
    }
}

/// A group of NCCL ranks. Made in the driver (it makes the NCCL unique id); hands out ranks in
/// this process ([`NcclGroup::communicator`]) and to other processes through its ticket.
///
/// ```no_run
/// use adag::comm::{Communicator, ReduceOp};
/// use adag::tensor::Tensor;
///
/// let group = adag_cuda::NcclGroup::create(2, "doc")?;
/// let comms = [group.communicator(0)?, group.communicator(1)?];
/// std::thread::scope(|s| {
///     for c in &comms {
///         s.spawn(move || {
///             let t = adag_cuda::to_device(&Tensor::from(vec![1.0f32; 4]), c.ordinal()).unwrap();
///             let sum = c.allreduce(&t, ReduceOp::Sum).unwrap();
///             assert_eq!(adag_cuda::to_host(&sum).unwrap().as_slice::<f32>().unwrap(), &[2.0; 4]);
///         });
///     }
/// });
/// # Ok::<(), adag::CommError>(())
/// ```
#[derive(Debug, Clone)]
pub struct NcclGroup {
    shared: Arc<GroupShared>,
}

impl NcclGroup {
    /// A group of `world_size` ranks with default options. `label` names it in errors.
    pub fn create(world_size: usize, label: &str) -> Result<NcclGroup, CommError> {
        Self::with_options(world_size, label, &NcclOptions::default())
    }

    /// A group of `world_size` ranks with these options. Needs NCCL (not a GPU) in this
    /// process: without it, [`CommError::Unsupported`] saying why.
    pub fn with_options(
        world_size: usize,
        label: &str,
        options: &NcclOptions,
    ) -> Result<NcclGroup, CommError> {
        let id = CommId::generate();
        let name = format!("{label} ({id})");
        if world_size == 0 || world_size > i32::MAX as usize {
            return Err(CommError::Config {
                message: format!(
                    "an NCCL group needs 1..={} ranks, not {world_size}",
                    i32::MAX
                ),
            });
        }
        if !options.devices.is_empty() && options.devices.len() != world_size {
            return Err(CommError::Config {
                message: format!(
                    "NcclOptions::devices names {} devices for {world_size} ranks; give one per rank or none",
                    options.devices.len()
                ),
            });
        }
        check_nccl().map_err(|e| e.into_comm(&name, 0, CommOp::Create))?;
        let unique_id = guard("ncclGetUniqueId", || {
            nccl::get_uniqueid().map_err(|e| nccl_error("ncclGetUniqueId", &e))
        })
        .map_err(|e| e.into_comm(&name, 0, CommOp::Create))?;
        Ok(NcclGroup {
            shared: Arc::new(GroupShared {
                id,
                label: label.to_string(),
                name,
                world_size,
                unique_id,
                options: options.clone(),
                stopped_flag: AtomicBool::new(false),
                stop: Mutex::new(None),
                ranks: Mutex::new(Vec::new()),
            }),
        })
    }

    /// The group of a ticket made by [`CommunicatorGroup::ticket`] (in another process),
    /// from which this process opens its ranks.
    pub fn from_ticket(ticket: &GroupTicket) -> Result<NcclGroup, CommError> {
        let bad = |message: String| CommError::Config {
            message: format!("NCCL ticket of group {}: {message}", ticket.id),
        };
        if ticket.transport != TRANSPORT {
            return Err(bad(format!(
                "its transport is {:?}, not {TRANSPORT:?}; open it with the factory of its transport (adag::comm::open_ticket)",
                ticket.transport
            )));
        }
        let p: TicketPayload = postcard::from_bytes(&ticket.payload)
            .map_err(|e| bad(format!("the payload does not decode ({e})")))?;
        if p.version != TICKET_VERSION {
            return Err(bad(format!(
                "payload version {} but this adag-cuda reads version {TICKET_VERSION}; use the same adag-cuda in every process",
                p.version
            )));
        }
        if p.unique_id.len() != UNIQUE_ID_BYTES {
            return Err(bad(format!(
                "the NCCL unique id has {} bytes, not {UNIQUE_ID_BYTES}",
                p.unique_id.len()
            )));
        }
        if ticket.world_size == 0
            || ticket.world_size > i32::MAX as usize
            || (!p.devices.is_empty() && p.devices.len() != ticket.world_size)
        {
            return Err(bad(format!(
                "world size {} with {} devices",
                ticket.world_size,
                p.devices.len()
            )));
        }
        let name = format!("{} ({})", p.label, ticket.id);
        check_nccl().map_err(|e| e.into_comm(&name, 0, CommOp::Open))?;
        let mut unique_id = sys::ncclUniqueId { internal: [0; 128] };
        for (d, s) in unique_id.internal.iter_mut().zip(&p.unique_id) {
            *d = *s as std::ffi::c_char;
        }
        Ok(NcclGroup {
            shared: Arc::new(GroupShared {
                id: ticket.id,
                label: p.label,
                name,
                world_size: ticket.world_size,
                unique_id,
                options: NcclOptions {
                    timeout: Duration::from_nanos(p.timeout_ns),
                    devices: p.devices,
                    p2p_header: p.p2p_header,
                },
                stopped_flag: AtomicBool::new(false),
                stop: Mutex::new(None),
                ranks: Mutex::new(Vec::new()),
            }),
        })
    }

    /// The communicator of `rank` in this process. It joins the NCCL group on its first
    /// operation (or [`NcclCommunicator::init`]), which waits for every rank to join.
    pub fn communicator(&self, rank: usize) -> Result<NcclCommunicator, CommError> {
        self.shared.communicator(rank)
    }

    /// The group's identity.
    pub fn id(&self) -> CommId {
        self.shared.id
    }

    /// The label given at creation.
    pub fn label(&self) -> &str {
        &self.shared.label
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.shared.world_size
    }

    /// The options.
    pub fn options(&self) -> &NcclOptions {
        &self.shared.options
    }

    /// Destroys the group in this process: every rank of it here is aborted, and waiters
    /// and later calls get [`CommError::Destroyed`]. Ranks in other processes are not reached
    /// (destroy them there; they otherwise time out). Idempotent.
    pub fn destroy(&self) {
        self.shared.stop(Stop::Destroyed);
    }

    /// Whether the group was destroyed or aborted (in this process).
    pub fn is_destroyed(&self) -> bool {
        self.shared.stopped().is_some()
    }
}

impl CommunicatorGroup for NcclGroup {
    fn id(&self) -> CommId {
        self.shared.id
    }
    fn world_size(&self) -> usize {
        self.shared.world_size
    }
    fn transport_name(&self) -> &str {
        TRANSPORT
    }
    fn communicator(&self, rank: usize) -> Result<Arc<dyn Communicator>, CommError> {
        Ok(Arc::new(self.shared.communicator(rank)?))
    }
    fn ticket(&self) -> Result<GroupTicket, CommError> {
        Ok(self.shared.ticket())
    }
    fn destroy(&self) {
        NcclGroup::destroy(self);
    }
    /// Rendezvous: an NCCL send completes only once the peer posts the matching receive.
    fn send_completion(&self) -> SendCompletion {
        SendCompletion::Rendezvous
    }
}

/// Makes [`NcclGroup`]s (`transport_name() == "nccl"`) and opens their ranks from tickets.
/// [`register`] registers one with default options.
#[derive(Debug, Clone, Default)]
pub struct NcclFactory {
    /// The options of the groups it makes.
    pub options: NcclOptions,
}

impl CommunicatorFactory for NcclFactory {
    fn transport_name(&self) -> &str {
        TRANSPORT
    }

    /// Rendezvous: an NCCL send completes only once the peer posts the matching receive, so
    /// the compiler schedules every receive to meet its send.
    fn send_completion(&self) -> SendCompletion {
        SendCompletion::Rendezvous
    }

    fn create_group(
        &self,
        world_size: usize,
        label: &str,
    ) -> Result<Arc<dyn CommunicatorGroup>, CommError> {
        Ok(Arc::new(NcclGroup::with_options(
            world_size,
            label,
            &self.options,
        )?))
    }

    fn open(
        &self,
        ticket: &GroupTicket,
        _fds: Vec<OwnedFd>,
        rank: usize,
    ) -> Result<Arc<dyn Communicator>, CommError> {
        Ok(Arc::new(
            NcclGroup::from_ticket(ticket)?.communicator(rank)?,
        ))
    }
}

/// A joined rank: the NCCL communicator and what its operations use.
struct Ready {
    comm: RawComm,
    gpu: Arc<Gpu>,
    stream: Arc<CudaStream>,
    /// Recorded after each operation; polled for completion.
    done: CudaEvent,
    /// The device copy of point-to-point headers (operations of a rank are serialized).
    header: Mutex<CudaSlice<u8>>,
}

enum State {
    /// Not joined yet.
    Uninit,
    /// `ncclCommInitRank` runs on a helper thread that will send the result.
    Pending(mpsc::Receiver<Result<Ready, CudaError>>),
    /// A rank is waiting for the helper thread (the receiver is with it).
    Joining,
    Ready(Arc<Ready>),
    /// Unusable: a failed join, an abort, a destroy.
    Failed(CommError),
}

struct RankState {
    group: Arc<GroupShared>,
    rank: usize,
    device: u32,
    timeout_ns: AtomicU64,
    state: Mutex<State>,
    /// Serializes the operations of this rank.
    ops: Mutex<()>,
}

impl Drop for RankState {
    fn drop(&mut self) {
        let st = std::mem::replace(
            self.state.get_mut().unwrap_or_else(|e| e.into_inner()),
            State::Uninit,
        );
        if let State::Ready(r) = st {
            // Abort rather than destroy: ncclCommDestroy may wait for peers that are gone.
            r.comm.abort();
        }
    }
}

impl RankState {
    fn name(&self) -> &str {
        &self.group.name
    }

    fn timeout(&self) -> Duration {
        Duration::from_nanos(self.timeout_ns.load(Ordering::Relaxed))
    }

    fn cuda_err(&self, op: CommOp) -> impl FnOnce(CudaError) -> CommError + '_ {
        move |e| e.into_comm(self.name(), self.rank, op)
    }

    /// Aborts this rank's communicator because the group stopped.
    fn stop_local(&self) {
        let Some(stop) = self.group.stopped() else {
            return;
        };
        let mut st = lock(&self.state);
        let old = std::mem::replace(
            &mut *st,
            State::Failed(self.group.stop_error(&stop, self.rank, CommOp::Destroy)),
        );
        if let State::Ready(r) = old {
            r.comm.abort();
        }
    }

    fn stop_error(&self, op: CommOp) -> Option<CommError> {
        self.group
            .stopped()
            .map(|s| self.group.stop_error(&s, self.rank, op))
    }

    /// The error of a failed state, re-labelled with this operation.
    fn failed(&self, e: &CommError, op: CommOp) -> CommError {
        match e {
            CommError::Destroyed { group, rank, .. } => CommError::Destroyed {
                group: group.clone(),
                rank: *rank,
                op,
            },
            CommError::Aborted {
                group,
                rank,
                by,
                reason,
                ..
            } => CommError::Aborted {
                group: group.clone(),
                rank: *rank,
                op,
                by: *by,
                reason: reason.clone(),
            },
            other => other.clone(),
        }
    }

    fn spawn_init(&self) -> Result<mpsc::Receiver<Result<Ready, CudaError>>, CommError> {
        let (tx, rx) = mpsc::sync_channel(1);
        let device = self.device;
        let rank = self.rank;
        let world = self.group.world_size;
        let uid = self.group.unique_id;
        std::thread::Builder::new()
            .name(format!("adag-nccl-init-r{rank}"))
            .spawn(move || {
                let r = guard("ncclCommInitRank", || {
                    let g = gpu(device)?;
                    g.ctx
                        .bind_to_thread()
                        .map_err(driver_err("cuCtxSetCurrent"))?;
                    let stream = g.ctx.new_stream().map_err(driver_err("cuStreamCreate"))?;
                    let done = g.ctx.new_event(None).map_err(driver_err("cuEventCreate"))?;
                    let header = alloc(&stream, HEADER_BYTES)?;
                    let mut comm: sys::ncclComm_t = std::ptr::null_mut();
                    // SAFETY: `comm` is written by NCCL on success; world and rank fit in i32
                    // (checked when the group was made).
                    unsafe { nccl::comm_init_rank(&mut comm, world as i32, uid, rank as i32) }
                        .map_err(|e| nccl_error("ncclCommInitRank", &e))?;
                    Ok(Ready {
                        comm: RawComm(comm),
                        gpu: g,
                        stream,
                        done,
                        header: Mutex::new(header),
                    })
                });
                if let Err(mpsc::SendError(Ok(ready))) = tx.send(r) {
                    // Nobody waits any more (the communicator was dropped).
                    ready.comm.abort();
                }
            })
            .map_err(|e| CommError::Io {
                group: self.name().to_string(),
                context: format!("rank {rank}: starting the thread that joins the NCCL group"),
                message: e.to_string(),
            })?;
        Ok(rx)
    }

    /// The joined rank, joining first if needed (waiting for the other ranks until
    /// `deadline`).
    fn ready(&self, op: CommOp, deadline: Instant) -> Result<Arc<Ready>, CommError> {
        let rx = {
            let mut st = lock(&self.state);
            if let Some(e) = self.stop_error(op) {
                return Err(e);
            }
            match std::mem::replace(&mut *st, State::Joining) {
                State::Ready(r) => {
                    *st = State::Ready(r.clone());
                    return Ok(r);
                }
                State::Failed(e) => {
                    let err = self.failed(&e, op);
                    *st = State::Failed(e);
                    return Err(err);
                }
                State::Joining => {
                    return Err(CommError::Protocol {
                        group: self.name().to_string(),
                        message: format!(
                            "rank {} is joining on another thread; operations of one rank are serialized, so this is a bug",
                            self.rank
                        ),
                    });
                }
                State::Pending(rx) => rx,
                State::Uninit => match self.spawn_init() {
                    Ok(rx) => rx,
                    Err(e) => {
                        *st = State::Uninit;
                        return Err(e);
                    }
                },
            }
        };
        loop {
            let now = Instant::now();
            if let Some(e) = self.stop_error(op) {
                // stop_local already set Failed; the helper aborts what it makes.
                return Err(e);
            }
            if now >= deadline {
                let mut st = lock(&self.state);
                if let Some(e) = self.stop_error(op) {
                    return Err(e);
                }
                // The next operation goes on waiting for the same join.
                *st = State::Pending(rx);
                return Err(CommError::Timeout {
                    group: self.name().to_string(),
                    rank: self.rank,
                    op,
                    waiting_for: format!(
                        "every rank of the group to join it (ncclCommInitRank on cuda:{})",
                        self.device
                    ),
                    timeout: self.timeout(),
                });
            }
            let slice = (deadline - now).min(Duration::from_millis(20));
            match rx.recv_timeout(slice) {
                Ok(Ok(ready)) => {
                    let ready = Arc::new(ready);
                    let mut st = lock(&self.state);
                    if let Some(e) = self.stop_error(op) {
                        ready.comm.abort();
                        return Err(e);
                    }
                    *st = State::Ready(ready.clone());
                    return Ok(ready);
                }
                Ok(Err(e)) => {
                    let err = e.into_comm(self.name(), self.rank, op);
                    let mut st = lock(&self.state);
                    if let Some(e) = self.stop_error(op) {
                        return Err(e);
                    }
                    *st = State::Failed(err.clone());
                    return Err(err);
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    let err = CommError::Io {
                        group: self.name().to_string(),
                        context: format!("rank {}: joining the NCCL group", self.rank),
                        message: "the joining thread ended without a result".into(),
                    };
                    let mut st = lock(&self.state);
                    if let Some(e) = self.stop_error(op) {
                        return Err(e);
                    }
                    *st = State::Failed(err.clone());
                    return Err(err);
                }
            }
        }
    }

    /// Enqueues work on the rank's stream under the state lock (so that no abort runs
    /// meanwhile), then records the completion event.
    fn enqueue<T>(
        &self,
        ready: &Arc<Ready>,
        op: CommOp,
        call: &str,
        f: impl FnOnce(&Ready) -> Result<T, CudaError>,
    ) -> Result<T, CommError> {
        let st = lock(&self.state);
        match &*st {
            State::Ready(r) if Arc::ptr_eq(r, ready) => {}
            State::Failed(e) => return Err(self.failed(e, op)),
            _ => {
                return Err(self.stop_error(op).unwrap_or_else(|| CommError::Protocol {
                    group: self.name().to_string(),
                    message: format!("rank {} changed state during {op}", self.rank),
                }));
            }
        }
        let out = guard(call, || {
            ready
                .gpu
                .ctx
                .bind_to_thread()
                .map_err(driver_err("cuCtxSetCurrent"))?;
            let v = f(ready)?;
            ready
                .done
                .record(&ready.stream)
                .map_err(driver_err("cuEventRecord"))?;
            Ok(v)
        });
        drop(st);
        out.map_err(self.cuda_err(op))
    }

    /// Aborts the group in this process because this rank gave up in the middle of `op`.
    fn abort_group(&self, reason: String) {
        self.group.stop(Stop::Aborted {
            by: self.rank,
            reason,
        });
    }

    /// Waits until the work enqueued so far is done, the deadline passes, or the group stops.
    fn wait(
        &self,
        ready: &Arc<Ready>,
        op: CommOp,
        deadline: Instant,
        waiting_for: impl FnOnce() -> String,
    ) -> Result<(), CommError> {
        let start = Instant::now();
        let mut sleep = Duration::from_micros(20);
        let mut next_async_check = start + Duration::from_millis(10);
        loop {
            match ready.done.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => {
                    let err = CudaError::Driver {
                        call: format!("cuEventQuery after {op}"),
                        message: e.to_string(),
                    };
                    self.abort_group(err.to_string());
                    return Err(err.into_comm(self.name(), self.rank, op));
                }
            }
            if let Some(e) = self.stop_error(op) {
                return Err(e);
            }
            let now = Instant::now();
            if now >= deadline {
                let waiting_for = waiting_for();
                self.abort_group(format!(
                    "rank {} timed out in {op} after {:?} waiting for {waiting_for}",
                    self.rank,
                    self.timeout()
                ));
                return Err(CommError::Timeout {
                    group: self.name().to_string(),
                    rank: self.rank,
                    op,
                    waiting_for,
                    timeout: self.timeout(),
                });
            }
            // Spin briefly (small messages finish in microseconds), yield a while, then sleep
            // in short slices so that a long operation is seen done within ~200 µs.
            let waited = now - start;
            if waited < Duration::from_micros(50) {
                std::hint::spin_loop();
            } else if waited < Duration::from_millis(2) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(sleep.min(deadline - now));
                sleep = (sleep * 2).min(Duration::from_micros(200));
            }
            if now >= next_async_check {
                next_async_check = now + Duration::from_millis(10);
                if let Some(msg) = self.async_error(ready) {
                    self.abort_group(msg.clone());
                    return Err(CudaError::Nccl {
                        call: format!("{op} (ncclCommGetAsyncError)"),
                        message: msg,
                    }
                    .into_comm(self.name(), self.rank, op));
                }
            }
        }
    }

    /// An asynchronous NCCL error of the communicator (a peer failed...), if any.
    fn async_error(&self, ready: &Arc<Ready>) -> Option<String> {
        let st = lock(&self.state);
        match &*st {
            State::Ready(r) if Arc::ptr_eq(r, ready) => {}
            _ => return None,
        }
        let r = guard("ncclCommGetAsyncError", || {
            let mut code = sys::ncclResult_t::ncclSuccess;
            // SAFETY: the communicator is live (checked under the state lock, held).
            unsafe { sys::ncclCommGetAsyncError(ready.comm.0, &mut code) }
                .result()
                .map_err(|e| nccl_error("ncclCommGetAsyncError", &e))?;
            Ok(code)
        });
        drop(st);
        match r {
            Ok(sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress) => None,
            Ok(code) => Some(error_string(code)),
            Err(e) => Some(e.to_string()),
        }
    }

    fn deadline(&self) -> Instant {
        let now = Instant::now();
        now.checked_add(self.timeout())
            .unwrap_or_else(|| now + Duration::from_secs(86400 * 365))
    }

    fn check_peer(&self, peer: usize, op: CommOp) -> Result<(), CommError> {
        if peer >= self.group.world_size || peer == self.rank {
            return Err(CommError::InvalidPeer {
                group: self.name().to_string(),
                rank: self.rank,
                peer,
                op,
                world_size: self.group.world_size,
            });
        }
        Ok(())
    }

    /// The CUDA buffer of an input tensor, which must be on this rank's device.
    fn input<'t>(&self, tensor: &'t Tensor, op: CommOp) -> Result<&'t CudaSlice<u8>, CommError> {
        let here = Device::Cuda(self.device);
        if tensor.device() != here {
            return Err(CudaError::WrongDevice {
                found: tensor.device(),
                expected: here,
            }
            .into_comm(self.name(), self.rank, op));
        }
        require_buffer(tensor, here)
            .map(|b| b.slice())
            .map_err(self.cuda_err(op))
    }

    fn tensor_err(&self, op: CommOp) -> impl FnOnce(TensorError) -> CommError + '_ {
        move |source| CommError::Tensor {
            group: self.name().to_string(),
            rank: self.rank,
            op,
            source,
        }
    }
}

/// The NCCL data type and op of a reduction of `dtype` with `op`.
fn reduction(
    dtype: DType,
    op: ReduceOp,
) -> Result<(sys::ncclDataType_t, sys::ncclRedOp_t), String> {
    use sys::ncclDataType_t as T;
    use sys::ncclRedOp_t as O;
    let rop = match op {
        ReduceOp::Sum => O::ncclSum,
        ReduceOp::Product => O::ncclProd,
        ReduceOp::Min => O::ncclMin,
        ReduceOp::Max => O::ncclMax,
        ReduceOp::Average => O::ncclAvg,
    };
    let t = match dtype {
        DType::F16 => T::ncclFloat16,
        DType::BF16 => T::ncclBfloat16,
        DType::F32 => T::ncclFloat32,
        DType::F64 => T::ncclFloat64,
        DType::I8 => T::ncclInt8,
        DType::I32 => T::ncclInt32,
        DType::I64 => T::ncclInt64,
        DType::U8 => T::ncclUint8,
        DType::I16 => {
            return Err("NCCL has no 16-bit integer type; reduce an i32 copy of the tensor".into());
        }
        DType::Bool => {
            let o = match op {
                ReduceOp::Sum | ReduceOp::Max => O::ncclMax,
                ReduceOp::Product | ReduceOp::Min => O::ncclMin,
                ReduceOp::Average => {
                    return Err(
                        "the average of bool tensors (true where at least half of the ranks hold true) has no NCCL operation; reduce a u8 or f32 copy".into(),
                    );
                }
            };
            return Ok((T::ncclUint8, o));
        }
    };
    Ok((t, rop))
}

fn describe(dtype: DType, shape: &[usize]) -> String {
    format!("a {dtype} tensor of shape {shape:?}")
}

fn encode_header(dtype: DType, shape: &[usize], nbytes: usize) -> [u8; HEADER_BYTES] {
    let mut h = [0u8; HEADER_BYTES];
    let code = DType::ALL.iter().position(|&d| d == dtype).unwrap_or(0) as u32;
    h[0..4].copy_from_slice(&HEADER_MAGIC.to_le_bytes());
    h[4..8].copy_from_slice(&code.to_le_bytes());
    h[8..12].copy_from_slice(&(shape.len() as u32).to_le_bytes());
    h[16..24].copy_from_slice(&(nbytes as u64).to_le_bytes());
    for (i, &d) in shape.iter().enumerate() {
        h[32 + 8 * i..40 + 8 * i].copy_from_slice(&(d as u64).to_le_bytes());
    }
    h
}

/// The dtype, shape and byte count of a header, or what is wrong with it.
fn decode_header(h: &[u8; HEADER_BYTES]) -> Result<(DType, Vec<usize>, usize), String> {
    let u32_at = |o: usize| u32::from_le_bytes(h[o..o + 4].try_into().unwrap_or_default());
    let u64_at = |o: usize| u64::from_le_bytes(h[o..o + 8].try_into().unwrap_or_default());
    if u32_at(0) != HEADER_MAGIC {
        return Err(format!(
            "the point-to-point header has magic {:#x}, not {HEADER_MAGIC:#x}: the peer sent without a header (NcclOptions::p2p_header differs) or the ranks are out of step",
            u32_at(0)
        ));
    }
    let dtype = *DType::ALL
        .get(u32_at(4) as usize)
        .ok_or_else(|| format!("unknown dtype code {} in the header", u32_at(4)))?;
    let ndim = u32_at(8) as usize;
    if ndim > MAX_DIMS {
        return Err(format!("{ndim} dimensions in the header"));
    }
    let shape: Vec<usize> = (0..ndim).map(|i| u64_at(32 + 8 * i) as usize).collect();
    let nbytes = u64_at(16) as usize;
    let expect = shape
        .iter()
        .try_fold(dtype.size(), |a, &d| a.checked_mul(d))
        .ok_or_else(|| format!("shape {shape:?} overflows"))?;
    if expect != nbytes {
        return Err(format!(
            "the header says {nbytes} bytes for {}",
            describe(dtype, &shape)
        ));
    }
    Ok((dtype, shape, nbytes))
}

fn nccl_stream(s: &CudaStream) -> sys::cudaStream_t {
    s.cu_stream() as sys::cudaStream_t
}

fn nccl_call(call: &'static str) -> impl Fn(nccl::NcclError) -> CudaError {
    move |e| nccl_error(call, &e)
}

/// One rank of an [`NcclGroup`], in this process or another: moves CUDA tensors of its device
/// with NCCL. See the [module documentation](crate::nccl) for how it waits and fails.
pub struct NcclCommunicator {
    inner: Arc<RankState>,
}

impl fmt::Debug for NcclCommunicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclCommunicator")
            .field("group", &self.inner.group.name)
            .field("rank", &self.inner.rank)
            .field("world_size", &self.inner.group.world_size)
            .field("device", &Device::Cuda(self.inner.device))
            .finish()
    }
}

impl NcclCommunicator {
    /// Opens `rank` of the group of a ticket (in a worker process); the same as
    /// [`NcclFactory::open`] without the trait object.
    pub fn open(ticket: &GroupTicket, rank: usize) -> Result<NcclCommunicator, CommError> {
        NcclGroup::from_ticket(ticket)?.communicator(rank)
    }

    /// Joins the NCCL group now (otherwise the first operation does), waiting until every
    /// rank has joined or the deadline passes. Every rank must call it (or an operation) at
    /// about the same time, each from its own thread.
    pub fn init(&self) -> Result<(), CommError> {
        let _serial = lock(&self.inner.ops);
        self.inner
            .ready(CommOp::Open, self.inner.deadline())
            .map(|_| ())
    }

    /// Whether this rank has joined the NCCL group.
    pub fn is_initialized(&self) -> bool {
        matches!(*lock(&self.inner.state), State::Ready(_))
    }

    /// The CUDA device ordinal of this rank (in this process).
    pub fn ordinal(&self) -> u32 {
        self.inner.device
    }

    /// The stream the rank's NCCL operations run on, once joined.
    pub fn stream(&self) -> Option<Arc<CudaStream>> {
        match &*lock(&self.inner.state) {
            State::Ready(r) => Some(r.stream.clone()),
            _ => None,
        }
    }

    /// The deadline of each operation from now on (this rank only).
    pub fn set_timeout(&self, timeout: Duration) {
        self.inner.timeout_ns.store(
            u64::try_from(timeout.as_nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }

    /// The deadline of each operation.
    pub fn timeout(&self) -> Duration {
        self.inner.timeout()
    }

    /// The group's label.
    pub fn label(&self) -> &str {
        &self.inner.group.label
    }

    /// A collective that makes one output of `out_bytes` from one input.
    fn collective(
        &self,
        tensor: &Tensor,
        op: CommOp,
        call: &'static str,
        out_bytes: usize,
        launch: impl FnOnce(&Ready, *const c_void, *mut c_void) -> Result<(), CudaError>,
    ) -> Result<CudaSlice<u8>, CommError> {
        let s = &*self.inner;
        let input = s.input(tensor, op)?;
        let _serial = lock(&s.ops);
        let deadline = s.deadline();
        let ready = s.ready(op, deadline)?;
        let out = s.enqueue(&ready, op, call, |r| {
            let mut out = alloc(&r.stream, out_bytes)?;
            if tensor.nbytes() > 0 {
                let (src, _read) = input.device_ptr(&r.stream);
                let (dst, _write) = out.device_ptr_mut(&r.stream);
                launch(r, src as *const c_void, dst as *mut c_void)?;
            }
            Ok(out)
        })?;
        s.wait(&ready, op, deadline, || {
            format!("every rank of the group to call {op}")
        })?;
        Ok(out)
    }

    /// Receives `nbytes` from `peer` into a new buffer.
    fn recv_bytes(
        &self,
        ready: &Arc<Ready>,
        nbytes: usize,
        peer: usize,
        deadline: Instant,
    ) -> Result<CudaSlice<u8>, CommError> {
        let s = &*self.inner;
        let op = CommOp::Recv;
        let out = s.enqueue(ready, op, "ncclRecv", |r| {
            let mut out = alloc(&r.stream, nbytes)?;
            if nbytes > 0 {
                let (dst, _write) = out.device_ptr_mut(&r.stream);
                // SAFETY: `dst` holds `nbytes`; the communicator is live (state lock held).
                unsafe {
                    nccl::recv(
                        dst as *mut c_void,
                        nbytes,
                        sys::ncclDataType_t::ncclUint8,
                        peer as i32,
                        r.comm.0,
                        nccl_stream(&r.stream),
                    )
                }
                .map_err(nccl_call("ncclRecv"))?;
            }
            Ok(out)
        })?;
        s.wait(ready, op, deadline, || format!("rank {peer} to send"))?;
        Ok(out)
    }
}

impl Communicator for NcclCommunicator {
    fn rank(&self) -> usize {
        self.inner.rank
    }

    fn world_size(&self) -> usize {
        self.inner.group.world_size
    }

    fn send(&self, tensor: &Tensor, peer: usize) -> Result<(), CommError> {
        let s = &*self.inner;
        let op = CommOp::Send;
        s.check_peer(peer, op)?;
        let input = s.input(tensor, op)?;
        if s.group.options.p2p_header && tensor.ndim() > MAX_DIMS {
            return Err(CommError::Unsupported {
                transport: TRANSPORT.into(),
                op,
                reason: format!(
                    "a tensor of {} dimensions; the NCCL communicator sends at most {MAX_DIMS} point to point; reshape it",
                    tensor.ndim()
                ),
            });
        }
        let nbytes = tensor.nbytes();
        let header = encode_header(tensor.dtype(), tensor.shape(), nbytes);
        let _serial = lock(&s.ops);
        let deadline = s.deadline();
        let ready = s.ready(op, deadline)?;
        s.enqueue(&ready, op, "ncclSend", |r| {
            if s.group.options.p2p_header {
                let mut h = lock(&r.header);
                // From pageable memory: returns once `header` is staged, ordered on the stream.
                r.stream
                    .memcpy_htod(&header[..], &mut *h)
                    .map_err(driver_err("cuMemcpyHtoDAsync"))?;
                let (src, _read) = h.device_ptr(&r.stream);
                // SAFETY: the header buffer holds HEADER_BYTES; the communicator is live.
                unsafe {
                    nccl::send(
                        src as *const c_void,
                        HEADER_BYTES,
                        sys::ncclDataType_t::ncclUint8,
                        peer as i32,
                        r.comm.0,
                        nccl_stream(&r.stream),
                    )
                }
                .map_err(nccl_call("ncclSend(header)"))?;
            }
            if nbytes > 0 {
                let (src, _read) = input.device_ptr(&r.stream);
                // SAFETY: the input holds `nbytes` (checked when the tensor was made).
                unsafe {
                    nccl::send(
                        src as *const c_void,
                        nbytes,
                        sys::ncclDataType_t::ncclUint8,
                        peer as i32,
                        r.comm.0,
                        nccl_stream(&r.stream),
                    )
                }
                .map_err(nccl_call("ncclSend"))?;
            }
            Ok(())
        })?;
        s.wait(&ready, op, deadline, || format!("rank {peer} to receive"))
    }

    fn recv(&self, shape: &[usize], dtype: DType, peer: usize) -> Result<Tensor, CommError> {
        let s = &*self.inner;
        let op = CommOp::Recv;
        s.check_peer(peer, op)?;
        let nbytes = shape
            .iter()
            .try_fold(dtype.size(), |a, &d| a.checked_mul(d))
            .ok_or_else(|| {
                (s.tensor_err(op))(TensorError::ShapeOverflow {
                    dtype,
                    shape: shape.to_vec(),
                })
            })?;
        let _serial = lock(&s.ops);
        let deadline = s.deadline();
        let ready = s.ready(op, deadline)?;
        if s.group.options.p2p_header {
            s.enqueue(&ready, op, "ncclRecv(header)", |r| {
                let mut h = lock(&r.header);
                let (dst, _write) = h.device_ptr_mut(&r.stream);
                // SAFETY: the header buffer holds HEADER_BYTES; the communicator is live.
                unsafe {
                    nccl::recv(
                        dst as *mut c_void,
                        HEADER_BYTES,
                        sys::ncclDataType_t::ncclUint8,
                        peer as i32,
                        r.comm.0,
                        nccl_stream(&r.stream),
                    )
                }
                .map_err(nccl_call("ncclRecv(header)"))?;
                Ok(())
            })?;
            s.wait(&ready, op, deadline, || format!("rank {peer} to send"))?;
            // The header has arrived: this copy does not wait on the peer.
            let mut host = [0u8; HEADER_BYTES];
            guard("cuMemcpyDtoHAsync(header)", || {
                let h = lock(&ready.header);
                ready
                    .stream
                    .memcpy_dtoh(&*h, &mut host[..])
                    .map_err(driver_err("cuMemcpyDtoHAsync"))?;
                ready
                    .stream
                    .synchronize()
                    .map_err(driver_err("cuStreamSynchronize"))
            })
            .map_err(s.cuda_err(op))?;
            let (sent_dtype, sent_shape, sent_bytes) = match decode_header(&host) {
                Ok(h) => h,
                Err(message) => {
                    s.abort_group(format!("rank {} received a bad header: {message}", s.rank));
                    return Err(CommError::Protocol {
                        group: s.name().to_string(),
                        message: format!("rank {} receiving from rank {peer}: {message}", s.rank),
                    });
                }
            };
            if sent_dtype != dtype || sent_shape != shape {
                // Consume the message so that the next one lines up.
                drop(self.recv_bytes(&ready, sent_bytes, peer, deadline)?);
                return Err(CommError::Mismatch {
                    group: s.name().to_string(),
                    rank: s.rank,
                    peer,
                    op,
                    expected: describe(dtype, shape),
                    found: describe(sent_dtype, &sent_shape),
                });
            }
        }
        let out = self.recv_bytes(&ready, nbytes, peer, deadline)?;
        tensor_from_alloc(out, dtype, shape.to_vec()).map_err(s.cuda_err(op))
    }

    fn allreduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor, CommError> {
        let cop = CommOp::AllReduce(op);
        let (dt, rop) = reduction(tensor.dtype(), op).map_err(|reason| CommError::Unsupported {
            transport: TRANSPORT.into(),
            op: cop,
            reason,
        })?;
        let count = tensor.numel();
        let out = self.collective(
            tensor,
            cop,
            "ncclAllReduce",
            tensor.nbytes(),
            |r, src, dst| {
                // SAFETY: both buffers hold `count` elements of the dtype; the comm is live.
                unsafe {
                    nccl::all_reduce(src, dst, count, dt, rop, r.comm.0, nccl_stream(&r.stream))
                }
                .map(|_| ())
                .map_err(nccl_call("ncclAllReduce"))
            },
        )?;
        tensor_from_alloc(out, tensor.dtype(), tensor.shape().to_vec())
            .map_err(self.inner.cuda_err(cop))
    }

    fn allgather(&self, tensor: &Tensor) -> Result<Tensor, CommError> {
        let s = &*self.inner;
        let op = CommOp::AllGather;
        let world = s.group.world_size;
        let mut shape = tensor.shape().to_vec();
        match shape.first_mut() {
            Some(d0) => *d0 *= world,
            None => shape = vec![world],
        }
        let nbytes = tensor.nbytes();
        let out_bytes = nbytes.checked_mul(world).ok_or_else(|| {
            (s.tensor_err(op))(TensorError::ShapeOverflow {
                dtype: tensor.dtype(),
                shape: tensor.shape().to_vec(),
            })
        })?;
        let out = self.collective(tensor, op, "ncclAllGather", out_bytes, |r, src, dst| {
            // SAFETY: src holds `nbytes`, dst `nbytes * world`; the comm is live.
            unsafe {
                nccl::all_gather(
                    src,
                    dst,
                    nbytes,
                    sys::ncclDataType_t::ncclUint8,
                    r.comm.0,
                    nccl_stream(&r.stream),
                )
            }
            .map(|_| ())
            .map_err(nccl_call("ncclAllGather"))
        })?;
        tensor_from_alloc(out, tensor.dtype(), shape).map_err(s.cuda_err(op))
    }

    fn reducescatter(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor, CommError> {
        let s = &*self.inner;
        let cop = CommOp::ReduceScatter(op);
        let world = s.group.world_size;
        let shape = tensor.shape();
        let Some(&d0) = shape.first().filter(|&&d| d % world == 0) else {
            return Err(CommError::Uneven {
                group: s.name().to_string(),
                rank: s.rank,
                op: cop,
                shape: shape.to_vec(),
                world_size: world,
            });
        };
        let (dt, rop) = reduction(tensor.dtype(), op).map_err(|reason| CommError::Unsupported {
            transport: TRANSPORT.into(),
            op: cop,
            reason,
        })?;
        let mut out_shape = shape.to_vec();
        out_shape[0] = d0 / world;
        let count = tensor.numel() / world;
        let out_bytes = tensor.nbytes() / world;
        let out = self.collective(
            tensor,
            cop,
            "ncclReduceScatter",
            out_bytes,
            |r, src, dst| {
                // SAFETY: src holds `count * world` elements, dst `count`; the comm is live.
                unsafe {
                    nccl::reduce_scatter(src, dst, count, dt, rop, r.comm.0, nccl_stream(&r.stream))
                }
                .map(|_| ())
                .map_err(nccl_call("ncclReduceScatter"))
            },
        )?;
        tensor_from_alloc(out, tensor.dtype(), out_shape).map_err(s.cuda_err(cop))
    }

    fn destroy(&self) -> Result<(), CommError> {
        self.inner.group.stop(Stop::Destroyed);
        Ok(())
    }

    fn transport_name(&self) -> &str {
        TRANSPORT
    }

    fn comm_id(&self) -> Option<CommId> {
        Some(self.inner.group.id)
    }

    fn send_completion(&self) -> SendCompletion {
        SendCompletion::Rendezvous
    }

    fn device(&self) -> Device {
        Device::Cuda(self.inner.device)
    }

    fn recv_stream(&self) -> Option<StreamId> {
        self.stream().map(|s| StreamId(s.cu_stream() as u64))
    }

    fn send_stream(&self) -> Option<StreamId> {
        self.recv_stream()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_reject_garbage() {
        let h = encode_header(DType::BF16, &[3, 4, 5], 120);
        assert_eq!(
            decode_header(&h).unwrap(),
            (DType::BF16, vec![3, 4, 5], 120)
        );
        let s = encode_header(DType::Bool, &[], 1);
        assert_eq!(decode_header(&s).unwrap(), (DType::Bool, vec![], 1));
        assert!(
            decode_header(&[0u8; HEADER_BYTES])
                .unwrap_err()
                .contains("magic")
        );
        let bad = encode_header(DType::F32, &[3], 11);
        assert!(decode_header(&bad).unwrap_err().contains("11 bytes"));
        for d in DType::ALL {
            let h = encode_header(d, &[2; MAX_DIMS], d.size() << MAX_DIMS);
            assert_eq!(decode_header(&h).unwrap().0, d);
        }
    }

    #[test]
    fn reductions_map_to_nccl_or_say_why_not() {
        for d in DType::ALL {
            for op in ReduceOp::ALL {
                let r = reduction(d, op);
                match (d, op) {
                    (DType::I16, _) | (DType::Bool, ReduceOp::Average) => {
                        assert!(r.unwrap_err().contains("copy"))
                    }
                    _ => assert!(r.is_ok(), "{d} {op}"),
                }
            }
        }
        assert_eq!(
            reduction(DType::Bool, ReduceOp::Sum).unwrap(),
            (sys::ncclDataType_t::ncclUint8, sys::ncclRedOp_t::ncclMax)
        );
        assert_eq!(
            reduction(DType::Bool, ReduceOp::Product).unwrap(),
            (sys::ncclDataType_t::ncclUint8, sys::ncclRedOp_t::ncclMin)
        );
    }

    #[test]
    fn tickets_decode_and_check() {
        let shared = GroupShared {
            id: CommId::from_u128(7),
            label: "t".into(),
            name: "t (7)".into(),
            world_size: 2,
            unique_id: sys::ncclUniqueId { internal: [3; 128] },
            options: NcclOptions {
                devices: vec![1, 0],
                ..NcclOptions::default()
            },
            stopped_flag: AtomicBool::new(false),
            stop: Mutex::new(None),
            ranks: Mutex::new(Vec::new()),
        };
        let t = shared.ticket();
        assert_eq!(t.transport, TRANSPORT);
        assert_eq!(t.world_size, 2);
        let p: TicketPayload = postcard::from_bytes(&t.payload).unwrap();
        assert_eq!(p.unique_id, vec![3u8; 128]);
        assert_eq!(p.devices, vec![1, 0]);
        assert!(p.p2p_header);
        // A ticket of another transport or a garbled one is a Config error before any
        // library is touched.
        let mut other = t.clone();
        other.transport = "cpu".into();
        assert!(matches!(
            NcclGroup::from_ticket(&other),
            Err(CommError::Config { .. })
        ));
        let mut garbled = t.clone();
        garbled.payload = vec![1, 2, 3];
        assert!(matches!(
            NcclGroup::from_ticket(&garbled),
            Err(CommError::Config { .. })
        ));
    }
}
