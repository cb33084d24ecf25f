//! Communicators: groups of ranks that move tensors point to point and run collectives.
//!
//! A [`Communicator`] is one rank's handle on a group of `world_size` ranks (one per actor of
//! a collective or of a tensor edge). It is the counterpart of Ray Compiled Graphs'
//! `Communicator`: `send`/`recv` between two ranks, and the collectives `allreduce`,
//! `allgather` and `reducescatter` that every rank of the group calls in the same order.
//!
//! Backends:
//! - [`cpu::CpuCommunicator`] (`transport_name() == "cpu"`): CPU tensors between threads of
//!   one process and between processes of one host, over a shared-memory region. It lets
//!   every scheduling path that a GPU group would take run without a GPU.
//! - The NCCL backend for CUDA tensors lives in its own crate and registers a
//!   [`CommunicatorFactory`] with [`register_factory`].
//!
//! Groups are made by a [`CommunicatorFactory`] (what `default_communicator = Create` uses):
//! [`CommunicatorFactory::create_group`] returns a [`CommunicatorGroup`] identified by a
//! [`CommId`], which hands out per-rank communicators in this process
//! ([`CommunicatorGroup::communicator`]) or a [`GroupTicket`] plus file descriptors with which
//! another process opens its rank ([`open_ticket`]).
//!
//! Every blocking call has a deadline ([`DEFAULT_TIMEOUT`] unless configured) and returns
//! [`CommError::Timeout`] past it; [`Communicator::destroy`] wakes every rank blocked in the
//! group, which then returns [`CommError::Destroyed`]. Nothing hangs.
//!
//! ```
//! use adag::comm::{Communicator, ReduceOp, cpu::CpuGroup};
//! use adag::tensor::Tensor;
//!
//! let group = CpuGroup::create(2, "doc")?;
//! let comms = [group.communicator(0)?, group.communicator(1)?];
//! let sums: Vec<Tensor> = std::thread::scope(|s| {
//!     let handles: Vec<_> = comms
//!         .iter()
//!         .map(|c| {
//!             s.spawn(move || {
//!                 let t = Tensor::from(vec![c.rank() as f32 + 1.0; 4]);
//!                 c.allreduce(&t, ReduceOp::Sum)
//!             })
//!         })
//!         .collect();
//!     handles.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
//! });
//! assert_eq!(sums[0].as_slice::<f32>()?, &[3.0; 4]);
//! assert_eq!(sums[0], sums[1]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
use crate::tensor::{DType, Device, Tensor, TensorError};
use half::{bf16, f16};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Once, RwLock};
use std::time::Duration;
use zerocopy::FromBytes;

pub mod cpu;
pub mod tcp;

#[cfg(test)]
mod tests;

/// The deadline of every blocking communicator call unless configured otherwise.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// How a reduction combines the ranks' elements, element-wise.
///
/// Every dtype takes every op. Integers wrap on overflow (like NCCL) for `Sum` and `Product`;
/// `Average` of integers is the exact mean rounded toward zero. `f16`/`bf16` are reduced in
/// `f32` and rounded once. For `bool`, `Sum` and `Max` are a logical or, `Product` and `Min` a
/// logical and, and `Average` is true when at least half of the ranks hold true. Ranks are
/// always combined in rank order, so every rank gets bit-identical results.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ReduceOp {
    /// The sum.
    Sum,
    /// The product.
    Product,
    /// The minimum.
    Min,
    /// The maximum.
    Max,
    /// The mean over the ranks.
    Average,
}

impl ReduceOp {
    /// Every op.
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Product,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Average,
    ];

    /// The lower-case name (`"sum"`, `"avg"`...), as in Ray's method names `allreduce.{op}`.
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Product => "product",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Average => "avg",
        }
    }

    pub(crate) const fn code(self) -> u32 {
        match self {
            ReduceOp::Sum => 1,
            ReduceOp::Product => 2,
            ReduceOp::Min => 3,
            ReduceOp::Max => 4,
            ReduceOp::Average => 5,
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The operation a [`CommError`] happened in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CommOp {
    /// Making the group.
    Create,
    /// Opening a rank of an existing group.
    Open,
    /// A point-to-point send.
    Send,
    /// A point-to-point receive.
    Recv,
    /// An allreduce.
    AllReduce(ReduceOp),
    /// An allgather.
    AllGather,
    /// A reducescatter.
    ReduceScatter(ReduceOp),
    /// Destroying the group.
    Destroy,
}

impl fmt::Display for CommOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CommOp::Create => f.write_str("create"),
            CommOp::Open => f.write_str("open"),
            CommOp::Send => f.write_str("send"),
            CommOp::Recv => f.write_str("recv"),
            CommOp::AllReduce(op) => write!(f, "allreduce({op})"),
            CommOp::AllGather => f.write_str("allgather"),
            CommOp::ReduceScatter(op) => write!(f, "reducescatter({op})"),
            CommOp::Destroy => f.write_str("destroy"),
        }
    }
}

/// What went wrong in a communicator. Each message names the group, the rank, the operation,
/// the peer where there is one, and what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CommError {
    /// A blocking call passed its deadline.
    #[error(
        "rank {rank} of communicator group {group}: {op} timed out after {timeout:?} waiting for {waiting_for}; check that every rank of the group calls the same operations in the same order and that none died, or raise the communicator timeout"
    )]
    Timeout {
        /// The group (label and id).
        group: String,
        /// This rank.
        rank: usize,
        /// The operation.
        op: CommOp,
        /// What was waited on (which ranks, which peer).
        waiting_for: String,
        /// The deadline that passed.
        timeout: Duration,
    },
    /// The group was destroyed (by any rank or its owner) before or during the call.
    #[error(
        "rank {rank} of communicator group {group}: {op} failed because the group was destroyed; make a new communicator group"
    )]
    Destroyed {
        /// The group.
        group: String,
        /// This rank.
        rank: usize,
        /// The operation.
        op: CommOp,
    },
    /// Another rank left the group in an inconsistent state (a timeout in the middle of a
    /// collective or message) and aborted it.
    #[error(
        "rank {rank} of communicator group {group}: {op} failed because rank {by} aborted the group ({reason}); the group is unusable, make a new one"
    )]
    Aborted {
        /// The group.
        group: String,
        /// This rank.
        rank: usize,
        /// The operation.
        op: CommOp,
        /// The rank that aborted it.
        by: usize,
        /// Why.
        reason: String,
    },
    /// The ranks disagree on the operation, shape or dtype.
    #[error(
        "rank {rank} of communicator group {group}: {op} with peer rank {peer}: this rank has {expected} but the peer has {found}; every rank must call the same collective with tensors of the same shape and dtype, and recv must name the shape and dtype that the peer sends"
    )]
    Mismatch {
        /// The group.
        group: String,
        /// This rank.
        rank: usize,
        /// The peer that differs.
        peer: usize,
        /// The operation.
        op: CommOp,
        /// This rank's side (operation, dtype, shape).
        expected: String,
        /// The peer's side.
        found: String,
    },
    /// `reducescatter` of a tensor whose first dimension does not divide by the world size.
    #[error(
        "rank {rank} of communicator group {group}: {op} needs the first dimension of shape {shape:?} to be divisible by the world size {world_size}; pad the tensor or use allreduce"
    )]
    Uneven {
        /// The group.
        group: String,
        /// This rank.
        rank: usize,
        /// The operation.
        op: CommOp,
        /// The tensor's shape.
        shape: Vec<usize>,
        /// The world size.
        world_size: usize,
    },
    /// A peer rank out of range, or this rank's own.
    #[error(
        "rank {rank} of communicator group {group}: {op} named peer {peer}, which is not another rank of this group of world size {world_size}; pass a rank in 0..{world_size} other than {rank}"
    )]
    InvalidPeer {
        /// The group.
        group: String,
        /// This rank.
        rank: usize,
        /// The peer named.
        peer: usize,
        /// The operation.
        op: CommOp,
        /// The world size.
        world_size: usize,
    },
    /// A rank out of range for the group.
    #[error(
        "communicator group {group} has world size {world_size}, so rank {rank} does not exist; open a rank in 0..{world_size}"
    )]
    InvalidRank {
        /// The group.
        group: String,
        /// The rank asked for.
        rank: usize,
        /// The world size.
        world_size: usize,
    },
    /// The rank is already open in a live communicator.
    #[error(
        "rank {rank} of communicator group {group} is already open; each rank is held by one communicator at a time (drop the other one first)"
    )]
    RankInUse {
        /// The group.
        group: String,
        /// The rank.
        rank: usize,
    },
    /// This rank's tensor cannot be used (on a device the backend cannot reach, too many
    /// dimensions...).
    #[error("rank {rank} of communicator group {group}: {op}: {source}")]
    Tensor {
        /// The group.
        group: String,
        /// This rank.
        rank: usize,
        /// The operation.
        op: CommOp,
        /// The tensor error.
        #[source]
        source: TensorError,
    },
    /// A peer could not take part in a collective (its own tensor was unusable); every rank
    /// returns an error for that call and the group stays usable.
    #[error(
        "rank {rank} of communicator group {group}: {op} failed because rank {peer} could not take part: {reason}"
    )]
    PeerFailed {
        /// The group.
        group: String,
        /// This rank.
        rank: usize,
        /// The operation.
        op: CommOp,
        /// The rank that failed.
        peer: usize,
        /// Its error.
        reason: String,
    },
    /// The backend does not do this.
    #[error("the {transport} communicator does not support {op}: {reason}")]
    Unsupported {
        /// The backend's transport name.
        transport: String,
        /// The operation.
        op: CommOp,
        /// Why, and what to use instead.
        reason: String,
    },
    /// A bad argument when making or opening a group.
    #[error("invalid communicator configuration: {message}")]
    Config {
        /// What is wrong and how to fix it.
        message: String,
    },
    /// No factory is registered for a ticket's transport.
    #[error(
        "no communicator factory is registered for transport {transport:?}; register it with adag::comm::register_factory in every process before opening its groups"
    )]
    UnknownTransport {
        /// The transport name.
        transport: String,
    },
    /// The shared state of the group is corrupt or of another version.
    #[error("communicator group {group}: {message}; the group is unusable, make a new one")]
    Protocol {
        /// The group.
        group: String,
        /// What was found.
        message: String,
    },
    /// An operating-system call failed.
    #[error("communicator group {group}: {context}: {message}")]
    Io {
        /// The group.
        group: String,
        /// What was being done.
        context: String,
        /// The OS error.
        message: String,
    },
}

/// An opaque stream handle of a device backend (a CUDA stream), for overlapping communication
/// with compute. The CPU backend has none.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StreamId(pub u64);

/// The identity of a communicator group, unique across processes and time. The compiler keys
/// the groups it made by their actor set and records this id; every rank of a group reports
/// the same id.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct CommId(u128);

impl CommId {
    /// A fresh random id.
    ///
    /// ```
    /// # use adag::comm::CommId;
    /// assert_ne!(CommId::generate(), CommId::generate());
    /// ```
    pub fn generate() -> CommId {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let word = |salt: u64| {
            // RandomState is seeded from the OS's randomness once per thread.
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u64(salt);
            h.write_u64(n);
            h.write_u128(nanos);
            h.write_u32(std::process::id());
            h.finish()
        };
        CommId((u128::from(word(1)) << 64) | u128::from(word(2)))
    }

    /// The id of this number.
    pub const fn from_u128(v: u128) -> CommId {
        CommId(v)
    }

    /// The id as a number.
    pub const fn as_u128(self) -> u128 {
        self.0
    }
}

impl fmt::Display for CommId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl fmt::Debug for CommId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CommId({self})")
    }
}

/// Whether a [`Communicator::send`] completes without its receiver: what the compiler's
/// scheduler and deadlock check assume of a group's point-to-point sends.
///
/// `Rendezvous` (the default, and the conservative answer) means a send may wait until the
/// peer has started the matching `recv` (NCCL: the send kernel does not finish before the
/// receive is posted). The scheduler then places every receive where its send is issued, so
/// that the two meet. `Buffered` means a send returns once the tensor is copied into the
/// backend's buffer, whether or not the peer is receiving yet (the CPU communicator's
/// mailboxes); receives then stay where the receiver first needs the tensor, and the
/// deadlock check lets a send complete alone. Collectives always wait for every rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum SendCompletion {
    /// A send may wait for the matching receive.
    #[default]
    Rendezvous,
    /// A send completes once its tensor is buffered, without the receiver.
    Buffered,
}

/// One rank's handle on a group of ranks that exchange tensors.
///
/// Every method that waits for other ranks has a deadline and returns
/// [`CommError::Timeout`] past it; [`Communicator::destroy`] on any rank (or on the group's
/// owner) wakes every waiter of the group with [`CommError::Destroyed`]. Collectives must be
/// called by every rank in the same order with tensors of the same dtype and shape; a
/// mismatch is a [`CommError::Mismatch`] on every rank, not a hang.
///
/// Object safe: the compiler holds `Arc<dyn Communicator>`.
pub trait Communicator: Send + Sync + fmt::Debug {
    /// This rank, in `0..world_size()`.
    fn rank(&self) -> usize;

    /// The number of ranks of the group.
    fn world_size(&self) -> usize;

    /// Sends `tensor` to rank `peer`. Messages from one rank to another arrive in the order
    /// sent. May return before the peer received it (the tensor is copied out first).
    fn send(&self, tensor: &Tensor, peer: usize) -> Result<(), CommError>;

    /// Receives the next tensor that rank `peer` sent to this rank, which must have this shape
    /// and dtype ([`CommError::Mismatch`] otherwise; the message is then consumed).
    fn recv(&self, shape: &[usize], dtype: DType, peer: usize) -> Result<Tensor, CommError>;

    /// Reduces the tensors of all ranks element-wise with `op`; every rank gets the result.
    fn allreduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor, CommError>;

    /// Concatenates the tensors of all ranks along dimension 0 in rank order (a 0-dimensional
    /// tensor of each rank gives a tensor of shape `[world_size]`); every rank gets it.
    fn allgather(&self, tensor: &Tensor) -> Result<Tensor, CommError>;

    /// Reduces the tensors of all ranks with `op` and gives rank `r` the `r`-th of
    /// `world_size` equal parts of the result along dimension 0. The first dimension must
    /// divide by the world size ([`CommError::Uneven`] otherwise).
    fn reducescatter(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor, CommError>;

    /// Destroys the group for every rank: waiters wake with [`CommError::Destroyed`] and later
    /// calls fail. Idempotent.
    fn destroy(&self) -> Result<(), CommError>;

    /// The transport's name (`"cpu"`, `"nccl"`...), used as the tensor transport of edges
    /// that use this communicator.
    fn transport_name(&self) -> &str;

    /// The group's identity, shared by all its ranks, where the backend has one.
    fn comm_id(&self) -> Option<CommId> {
        None
    }

    /// The device whose tensors this communicator moves ([`Device::Cpu`] by default); `recv`
    /// allocates there.
    fn device(&self) -> Device {
        Device::Cpu
    }

    /// The stream that receives run on, for a backend with streams.
    fn recv_stream(&self) -> Option<StreamId> {
        None
    }

    /// The stream that sends run on, for a backend with streams.
    fn send_stream(&self) -> Option<StreamId> {
        None
    }

    /// Whether [`send`](Communicator::send) completes without the receiver
    /// ([`SendCompletion::Rendezvous`] unless the backend says otherwise).
    fn send_completion(&self) -> SendCompletion {
        SendCompletion::Rendezvous
    }
}

/// What another process needs, besides the group's file descriptors, to open one rank of a
/// group: serializable, so the driver can send it over its control channel (and the
/// descriptors alongside with `SCM_RIGHTS`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupTicket {
    /// The group.
    pub id: CommId,
    /// The transport, to find the factory ([`factory`]).
    pub transport: String,
    /// The number of ranks.
    pub world_size: usize,
    /// Backend-specific data (an NCCL unique id...). Empty for the CPU backend.
    pub payload: Vec<u8>,
}

/// A group of `world_size` ranks made by a [`CommunicatorFactory`]. It hands out the
/// per-rank communicators: in this process, or to other processes through a ticket.
pub trait CommunicatorGroup: Send + Sync + fmt::Debug {
    /// The group's identity.
    fn id(&self) -> CommId;

    /// The number of ranks.
    fn world_size(&self) -> usize;

    /// The transport's name.
    fn transport_name(&self) -> &str;

    /// The communicator of `rank` for use in this process (a thread actor). Each rank is
    /// handed out once at a time.
    fn communicator(&self, rank: usize) -> Result<Arc<dyn Communicator>, CommError>;

    /// The ticket with which another process opens a rank ([`open_ticket`]), or
    /// [`CommError::Unsupported`] for a group that lives in one process only.
    fn ticket(&self) -> Result<GroupTicket, CommError>;

    /// The file descriptors to pass along with the ticket, in order.
    fn fds(&self) -> Vec<BorrowedFd<'_>> {
        Vec::new()
    }

    /// Destroys the group, waking every rank blocked in it.
    fn destroy(&self);

    /// Whether the sends of this group's communicators complete without the receiver; the
    /// compiler records it per group and schedules by it ([`SendCompletion::Rendezvous`],
    /// the conservative answer, unless the backend says otherwise).
    fn send_completion(&self) -> SendCompletion {
        SendCompletion::Rendezvous
    }
}

/// Makes groups of one transport (the CPU backend, NCCL...) and opens their ranks in other
/// processes. `default_communicator = Create` uses the factory of the edge's transport.
pub trait CommunicatorFactory: Send + Sync + fmt::Debug {
    /// The transport's name; [`register_factory`] keys factories by it.
    fn transport_name(&self) -> &str;

    /// A new group of `world_size` ranks. `label` names it in errors and debugging (the actor
    /// set, for example).
    fn create_group(
        &self,
        world_size: usize,
        label: &str,
    ) -> Result<Arc<dyn CommunicatorGroup>, CommError>;

    /// Opens `rank` of the group of `ticket` in this process, with the descriptors that came
    /// with the ticket.
    fn open(
        &self,
        ticket: &GroupTicket,
        fds: Vec<OwnedFd>,
        rank: usize,
    ) -> Result<Arc<dyn Communicator>, CommError>;

    /// Whether the sends of the groups this factory makes complete without the receiver
    /// (what `default_communicator = Create` records at compile time, before any group
    /// exists). [`SendCompletion::Rendezvous`] unless the backend says otherwise.
    fn send_completion(&self) -> SendCompletion {
        SendCompletion::Rendezvous
    }
}

static FACTORIES: RwLock<Vec<Arc<dyn CommunicatorFactory>>> = RwLock::new(Vec::new());

/// Registers a factory under its transport name, replacing one of the same name. The CPU
/// factory (`"cpu"`) is built in. Register in every process (driver and workers) that makes
/// or opens groups of that transport.
pub fn register_factory(factory: Arc<dyn CommunicatorFactory>) {
    let mut list = FACTORIES.write().unwrap_or_else(|e| e.into_inner());
    list.retain(|f| f.transport_name() != factory.transport_name());
    list.push(factory);
}

/// The factory of a transport: a registered one, else the built-in CPU factory for `"cpu"`
/// or TCP factory for `"tcp"`.
pub fn factory(transport: &str) -> Option<Arc<dyn CommunicatorFactory>> {
    let list = FACTORIES.read().unwrap_or_else(|e| e.into_inner());
    if let Some(f) = list.iter().find(|f| f.transport_name() == transport) {
        return Some(f.clone());
    }
    match transport {
        cpu::TRANSPORT => Some(Arc::new(cpu::CpuFactory::default())),
        tcp::TRANSPORT => Some(Arc::new(tcp::TcpFactory)),
        _ => None,
    }
}

/// Communicator factories linked into this executable ([`communicator_factory!`]), registered
/// in every process (driver and workers) before a group is made or opened.
///
/// [`communicator_factory!`]: crate::communicator_factory
#[linkme::distributed_slice]
pub static COMM_FACTORIES: [fn() -> Arc<dyn CommunicatorFactory>];

/// Register a [`CommunicatorFactory`] at link time, so that worker processes (which never
/// reach `main`) can open ranks of its groups too. Takes a function
/// `fn() -> Arc<dyn CommunicatorFactory>`; the factory is registered (as with
/// [`register_factory`](crate::comm::register_factory)) the first time a graph with
/// communicators is compiled or installed in each process.
///
/// ```
/// use std::sync::Arc;
/// use adag::comm::{CommunicatorFactory, cpu::CpuFactory};
///
/// // Your own factory here; the CPU one stands in for it.
/// fn make() -> Arc<dyn CommunicatorFactory> {
///     Arc::new(CpuFactory::default())
/// }
/// adag::communicator_factory!(make);
///
/// fn main() {
///     // Registered in this process (and in every worker) before the first graph needs it.
///     let linked = adag::__private::COMM_FACTORIES.iter().any(|f| f().transport_name() == "cpu");
///     assert!(linked);
/// }
/// ```
#[macro_export]
macro_rules! communicator_factory {
    ($make:path) => {
        const _: () = {
            #[$crate::__private::linkme::distributed_slice($crate::__private::COMM_FACTORIES)]
            #[linkme(crate = $crate::__private::linkme)]
            static REGISTER: fn() -> ::std::sync::Arc<dyn $crate::comm::CommunicatorFactory> =
                $make;
        };
    };
}

/// Registers the link-time factories once per process.
pub(crate) fn register_linked_factories() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        for make in COMM_FACTORIES {
            register_factory(make());
        }
    });
}

/// Opens `rank` of the group of `ticket` with the factory of its transport.
pub fn open_ticket(
    ticket: &GroupTicket,
    fds: Vec<OwnedFd>,
    rank: usize,
) -> Result<Arc<dyn Communicator>, CommError> {
    let f = factory(&ticket.transport).ok_or_else(|| CommError::UnknownTransport {
        transport: ticket.transport.clone(),
    })?;
    f.open(ticket, fds, rank)
}

/// A group over communicators that the user made, one per rank, all in this process (thread
/// actors): the way to hand one's own [`Communicator`] to the compiler.
///
/// ```
/// use std::sync::Arc;
/// use adag::comm::{Communicator, CommunicatorGroup, LocalGroup, cpu::CpuGroup};
///
/// let cpu = CpuGroup::create(2, "mine")?;
/// let comms: Vec<Arc<dyn Communicator>> =
///     vec![Arc::new(cpu.communicator(0)?), Arc::new(cpu.communicator(1)?)];
/// let group = LocalGroup::new(comms)?;
/// assert_eq!(group.world_size(), 2);
/// assert_eq!(group.communicator(1)?.rank(), 1);
/// # Ok::<(), adag::comm::CommError>(())
/// ```
#[derive(Debug)]
pub struct LocalGroup {
    id: CommId,
    transport: String,
    comms: Vec<Arc<dyn Communicator>>,
}

impl LocalGroup {
    /// A group of these communicators: `comms[r]` must be rank `r` of a group of world size
    /// `comms.len()`.
    pub fn new(comms: Vec<Arc<dyn Communicator>>) -> Result<LocalGroup, CommError> {
        let Some(first) = comms.first() else {
            return Err(CommError::Config {
                message: "a LocalGroup needs at least one communicator".into(),
            });
        };
        for (i, c) in comms.iter().enumerate() {
            if c.rank() != i || c.world_size() != comms.len() {
                return Err(CommError::Config {
                    message: format!(
                        "communicator {i} of a LocalGroup of {} is rank {} of world size {}; pass rank r of a group of the same size at index r",
                        comms.len(),
                        c.rank(),
                        c.world_size()
                    ),
                });
            }
        }
        Ok(LocalGroup {
            id: first.comm_id().unwrap_or_else(CommId::generate),
            transport: first.transport_name().to_string(),
            comms,
        })
    }
}

impl CommunicatorGroup for LocalGroup {
    fn id(&self) -> CommId {
        self.id
    }
    fn world_size(&self) -> usize {
        self.comms.len()
    }
    fn transport_name(&self) -> &str {
        &self.transport
    }
    fn communicator(&self, rank: usize) -> Result<Arc<dyn Communicator>, CommError> {
        self.comms
            .get(rank)
            .cloned()
            .ok_or_else(|| CommError::InvalidRank {
                group: self.id.to_string(),
                rank,
                world_size: self.comms.len(),
            })
    }
    fn ticket(&self) -> Result<GroupTicket, CommError> {
        Err(CommError::Unsupported {
            transport: self.transport.clone(),
            op: CommOp::Open,
            reason: "a LocalGroup's communicators live in one process; place its actors on threads of the driver, or give a CommunicatorFactory instead".into(),
        })
    }
    fn destroy(&self) {
        for c in &self.comms {
            // Destroy is best effort on teardown; each communicator reports its own errors.
            let _ = c.destroy();
        }
    }
    fn send_completion(&self) -> SendCompletion {
        // Buffered only if every rank's sends are: one rendezvous rank makes the group's
        // sends wait for their receivers.
        if self
            .comms
            .iter()
            .all(|c| c.send_completion() == SendCompletion::Buffered)
        {
            SendCompletion::Buffered
        } else {
            SendCompletion::Rendezvous
        }
    }
}

/// Reduces equal-length byte slices holding `dtype` elements into `out`, element-wise, in
/// the order of `inputs` (the reference kernel that every CPU collective uses).
///
/// Each slice must be aligned for the dtype and as long as `out`; a bool input byte counts as
/// true when non-zero.
///
/// ```
/// use adag::comm::{ReduceOp, reduce_bytes};
/// use adag::tensor::DType;
///
/// let a = 3i32.to_ne_bytes();
/// let b = 5i32.to_ne_bytes();
/// let mut out = [0u8; 4];
/// reduce_bytes(DType::I32, ReduceOp::Max, &[&a[..], &b[..]], &mut out)?;
/// assert_eq!(i32::from_ne_bytes(out), 5);
/// # Ok::<(), adag::tensor::TensorError>(())
/// ```
pub fn reduce_bytes(
    dtype: DType,
    op: ReduceOp,
    inputs: &[&[u8]],
    out: &mut [u8],
) -> Result<(), TensorError> {
    let out_len = out.len();
    let bad_len = |actual: usize| TensorError::ByteLength {
        dtype,
        shape: vec![out_len / dtype.size()],
        expected: out_len,
        actual,
    };
    if inputs.is_empty() {
        return Err(bad_len(0));
    }
    if let Some(i) = inputs.iter().find(|i| i.len() != out.len()) {
        return Err(bad_len(i.len()));
    }
    if !out_len.is_multiple_of(dtype.size()) {
        return Err(bad_len(out_len));
    }
    let n = inputs.len();
    macro_rules! cast {
        ($t:ty) => {{
            let ins: Option<Vec<&[$t]>> = inputs
                .iter()
                .map(|b| <[$t]>::ref_from_bytes(b).ok())
                .collect();
            let ins = ins.ok_or_else(|| bad_len(out_len))?;
            let o = <[$t]>::mut_from_bytes(out).map_err(|_| bad_len(out_len))?;
            (ins, o)
        }};
    }
    match dtype {
        DType::F32 => {
            let (ins, o) = cast!(f32);
            reduce_float(&ins, o, op, n as f32);
        }
        DType::F64 => {
            let (ins, o) = cast!(f64);
            reduce_float(&ins, o, op, n as f64);
        }
        DType::F16 => {
            let (ins, o) = cast!(f16);
            reduce_via_f32(&ins, o, op, f16::to_f32, f16::from_f32);
        }
        DType::BF16 => {
            let (ins, o) = cast!(bf16);
            reduce_via_f32(&ins, o, op, bf16::to_f32, bf16::from_f32);
        }
        DType::I8 => {
            let (ins, o) = cast!(i8);
            reduce_int(&ins, o, op, |x| x as i128, |a| a as i8);
        }
        DType::I16 => {
            let (ins, o) = cast!(i16);
            reduce_int(&ins, o, op, |x| x as i128, |a| a as i16);
        }
        DType::I32 => {
            let (ins, o) = cast!(i32);
            reduce_int(&ins, o, op, |x| x as i128, |a| a as i32);
        }
        DType::I64 => {
            let (ins, o) = cast!(i64);
            reduce_int(&ins, o, op, |x| x as i128, |a| a as i64);
        }
        DType::U8 => {
            let (ins, o) = cast!(u8);
            reduce_int(&ins, o, op, |x| x as i128, |a| a as u8);
        }
        DType::Bool => {
            let (ins, o) = cast!(u8);
            for (i, y) in o.iter_mut().enumerate() {
                let trues = ins.iter().filter(|s| s[i] != 0).count();
                let v = match op {
                    ReduceOp::Sum | ReduceOp::Max => trues > 0,
                    ReduceOp::Product | ReduceOp::Min => trues == n,
                    ReduceOp::Average => 2 * trues >= n,
                };
                *y = u8::from(v);
            }
        }
    }
    Ok(())
}

trait Float: Copy + std::ops::Add<Output = Self> + std::ops::Mul<Output = Self> {
    fn fmin(self, o: Self) -> Self;
    fn fmax(self, o: Self) -> Self;
    fn div(self, o: Self) -> Self;
}
impl Float for f32 {
    fn fmin(self, o: Self) -> Self {
        self.min(o)
    }
    fn fmax(self, o: Self) -> Self {
        self.max(o)
    }
    fn div(self, o: Self) -> Self {
        self / o
    }
}
impl Float for f64 {
    fn fmin(self, o: Self) -> Self {
        self.min(o)
    }
    fn fmax(self, o: Self) -> Self {
        self.max(o)
    }
    fn div(self, o: Self) -> Self {
        self / o
    }
}

/// Input-major loops (vectorizable), accumulating in the output.
fn reduce_float<T: Float>(ins: &[&[T]], out: &mut [T], op: ReduceOp, n: T) {
    out.copy_from_slice(ins[0]);
    let fold = |f: fn(T, T) -> T, out: &mut [T]| {
        for s in &ins[1..] {
            for (y, &x) in out.iter_mut().zip(s.iter()) {
                *y = f(*y, x);
            }
        }
    };
    match op {
        ReduceOp::Sum | ReduceOp::Average => fold(|a, b| a + b, out),
        ReduceOp::Product => fold(|a, b| a * b, out),
        ReduceOp::Min => fold(T::fmin, out),
        ReduceOp::Max => fold(T::fmax, out),
    }
    if op == ReduceOp::Average {
        for y in out.iter_mut() {
            *y = y.div(n);
        }
    }
}

/// `f16`/`bf16`: accumulate each element in `f32` and round once.
fn reduce_via_f32<T: Copy>(
    ins: &[&[T]],
    out: &mut [T],
    op: ReduceOp,
    to: fn(T) -> f32,
    from: fn(f32) -> T,
) {
    let n = ins.len() as f32;
    for (i, y) in out.iter_mut().enumerate() {
        let mut acc = to(ins[0][i]);
        for s in &ins[1..] {
            let x = to(s[i]);
            acc = match op {
                ReduceOp::Sum | ReduceOp::Average => acc + x,
                ReduceOp::Product => acc * x,
                ReduceOp::Min => acc.min(x),
                ReduceOp::Max => acc.max(x),
            };
        }
        if op == ReduceOp::Average {
            acc /= n;
        }
        *y = from(acc);
    }
}

/// Integers: sum and product wrap (computed wide, then truncated: the same as wrapping in the
/// type); the average is the exact mean rounded toward zero.
fn reduce_int<T: Copy + Ord>(
    ins: &[&[T]],
    out: &mut [T],
    op: ReduceOp,
    wide: fn(T) -> i128,
    narrow: fn(i128) -> T,
) {
    match op {
        ReduceOp::Min | ReduceOp::Max => {
            out.copy_from_slice(ins[0]);
            for s in &ins[1..] {
                for (y, &x) in out.iter_mut().zip(s.iter()) {
                    *y = if op == ReduceOp::Min {
                        (*y).min(x)
                    } else {
                        (*y).max(x)
                    };
                }
            }
        }
        ReduceOp::Sum | ReduceOp::Product | ReduceOp::Average => {
            let n = ins.len() as i128;
            for (i, y) in out.iter_mut().enumerate() {
                let mut acc = wide(ins[0][i]);
                for s in &ins[1..] {
                    let x = wide(s[i]);
                    acc = if op == ReduceOp::Product {
                        // The low 64 bits of the product are all that the result keeps.
                        (acc as i64).wrapping_mul(x as i64) as i128
                    } else {
                        acc.wrapping_add(x)
                    };
                }
                if op == ReduceOp::Average {
                    acc /= n;
                }
                *y = narrow(acc);
            }
        }
    }
}

/// Reduces whole CPU tensors (all of one dtype and shape) with `op`: what an allreduce over
/// these ranks' tensors returns. A reference for tests and simple backends.
///
/// ```
/// use adag::comm::{ReduceOp, reduce_tensors};
/// use adag::tensor::Tensor;
///
/// let r = reduce_tensors(&[Tensor::from(vec![1i32, 5]), Tensor::from(vec![3i32, 2])], ReduceOp::Min)?;
/// assert_eq!(r.as_slice::<i32>()?, &[1, 2]);
/// # Ok::<(), adag::tensor::TensorError>(())
/// ```
pub fn reduce_tensors(tensors: &[Tensor], op: ReduceOp) -> Result<Tensor, TensorError> {
    let Some(first) = tensors.first() else {
        return Err(TensorError::Dim0 {
            op: "reduce",
            message: "no tensors to reduce".into(),
        });
    };
    let mut inputs = Vec::with_capacity(tensors.len());
    for t in tensors {
        if t.dtype() != first.dtype() {
            return Err(TensorError::DTypeMismatch {
                expected: first.dtype(),
                actual: t.dtype(),
            });
        }
        if t.shape() != first.shape() {
            return Err(TensorError::Reshape {
                from: t.shape().to_vec(),
                numel: t.numel(),
                to: first.shape().to_vec(),
            });
        }
        inputs.push(t.as_bytes()?);
    }
    let mut err = None;
    let out = Tensor::from_fill(first.dtype(), first.shape().to_vec(), |out| {
        err = reduce_bytes(first.dtype(), op, &inputs, out).err();
    })?;
    match err {
        Some(e) => Err(e),
        None => Ok(out),
    }
}
