//! The channels of one compiled graph in one process, opened from the plan: each end of an
//! edge gets the kind the plan chose for it (where its writer and readers live). This is the
//! one place that maps a [`ChannelKind`] to its module; the actor loop and the driver then see
//! only [`ChannelWriter`](crate::channel::ChannelWriter) and
//! [`ChannelReader`](crate::channel::ChannelReader).
use super::observe::EdgeCount;
use crate::channel::local::LocalHub;
use crate::channel::shm::{ShmChannel, ShmConfig, ShmGroup, ShmRx, ShmTx};
use crate::channel::{ChanError, EndCounters, FanOut, Msg, Reader, Writer};
use crate::compile::plan::{ChannelKind, GraphPlan, Loc};
use crate::error::{Error, Result};
use crate::value::{AnyValue, Value};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// How the driver sizes the channels of a graph (from the compile options).
pub(crate) struct ChannelSizes {
    /// Initial bytes of each slot.
    pub slot_bytes: usize,
    /// Ceiling of one message.
    pub max_message_bytes: usize,
    /// How long a waiting end spins before it sleeps.
    pub spin: Duration,
}

/// Where an edge's endpoints are found in this process.
pub(crate) struct GraphChannels {
    local: LocalHub,
    /// The shared-memory channels mapped here, by channel id.
    shm: HashMap<u64, ShmChannel>,
    /// In the driver, which created them: every shared-memory channel of the graph, where a
    /// reader finds the payloads written to it by reference (empty in a worker).
    group: ShmGroup,
    /// The counters of every writer opened here, by edge (read by the graph's statistics;
    /// locked only when a writer is opened and when statistics are read).
    counters: EdgeCounters,
}

/// The counters of the writers a process opened for one graph, by edge: shared, so that a
/// worker can report them after the graph's channels are unmapped.
#[derive(Clone, Default)]
pub(crate) struct EdgeCounters(Arc<Mutex<Vec<EdgeEnd>>>);

/// One writer's counters and the edge it writes.
type EdgeEnd = (u64, Arc<EndCounters>);

impl EdgeCounters {
    /// What every writer has sent so far, by edge.
    pub(crate) fn counts(&self) -> Vec<(u64, EdgeCount)> {
        self.0
            .lock()
            .iter()
            .map(|(edge, c)| {
                (
                    *edge,
                    EdgeCount {
                        messages: c.messages.load(Ordering::Relaxed),
                        bytes: c.bytes.load(Ordering::Relaxed),
                        growths: c.growths.load(Ordering::Relaxed),
                    },
                )
            })
            .collect()
    }
}

impl GraphChannels {
    /// The channels of a graph in a process that maps the shared-memory channels `shm`; the
    /// in-process channels' waits spin up to `spin` before they sleep.
    fn new(shm: HashMap<u64, ShmChannel>, spin: Duration) -> Self {
        GraphChannels {
            local: LocalHub::new(spin),
            shm,
            group: ShmGroup::default(),
            counters: EdgeCounters::default(),
        }
    }

    /// The driver's channels of `plan`: makes every channel that crosses a process.
    pub(crate) fn create(plan: &GraphPlan, sizes: &ChannelSizes) -> Result<Self> {
        let mut shm = HashMap::new();
        // The driver maps every channel it makes until the graph is torn down, so a channel
        // read only by the driver may carry payloads that lie in any of them by reference.
        let group = loop {
            let mut id = [0u8; 8];
            getrandom::fill(&mut id).map_err(|e| Error::io("a graph's channel group id", e))?;
            let id = u64::from_le_bytes(id);
            if id != 0 {
                break id;
            }
        };
        for edge in plan.edges.values() {
            if let Some(s) = edge.channel(ChannelKind::SharedMemory) {
                let cfg = ShmConfig {
                    depth: plan.depth as u32,
                    readers: s.readers.len() as u32,
                    slot_bytes: sizes.slot_bytes,
                    max_message_bytes: sizes.max_message_bytes,
                    spin: sizes.spin,
                    group,
                    readers_map_group: s.readers.iter().all(|r| *r == Loc::Driver),
                };
                let ch = ShmChannel::create(&cfg, &format!("adag-g{}-e{}", plan.graph, edge.id))
                    .map_err(|e| {
                        Error::io(
                            format!("creating the shared-memory channel of {}", edge.label),
                            e,
                        )
                    })?;
                shm.insert(s.id, ch);
            }
        }
        let mut chans = Self::new(shm, sizes.spin);
        chans.group = ShmGroup::new(chans.shm.values());
        Ok(chans)
    }

    /// The channels that endpoint `me` (in another process) writes or reads: their ids and
    /// descriptors, to send along with its schedule.
    pub(crate) fn handed_to(
        &self,
        plan: &GraphPlan,
        me: Loc,
    ) -> Result<(Vec<u64>, Vec<BorrowedFd<'_>>)> {
        let mut ids = Vec::new();
        let mut fds = Vec::new();
        for e in plan.edges.values() {
            if let Some(s) = e.channel(ChannelKind::SharedMemory)
                && (e.writer == me || s.readers.contains(&me))
            {
                let fd = self.shm.get(&s.id).map(ShmChannel::fd).ok_or_else(|| {
                    Error::compile(
                        e.label.clone(),
                        "its shared-memory channel is not mapped in the driver (a bug)",
                    )
                })?;
                ids.push(s.id);
                fds.push(fd);
            }
        }
        Ok((ids, fds))
    }

    /// A worker's channels: the ones named `ids`, whose descriptors `fds` came in that order.
    pub(crate) fn open(
        ids: &[u64],
        fds: Vec<OwnedFd>,
        spin: Duration,
    ) -> std::result::Result<Self, String> {
        if fds.len() != ids.len() {
            return Err(format!(
                "expected {} channel fds, got {}",
                ids.len(),
                fds.len()
            ));
        }
        let mut shm = HashMap::new();
        for (id, fd) in ids.iter().zip(fds) {
            let ch = ShmChannel::open(fd).map_err(|e| format!("cannot map channel {id}: {e}"))?;
            shm.insert(*id, ch);
        }
        Ok(Self::new(shm, spin))
    }

    fn shm(&self, edge: u64, chan: u64) -> std::result::Result<&ShmChannel, String> {
        self.shm
            .get(&chan)
            .ok_or_else(|| format!("edge {edge}: shared-memory channel {chan} is not mapped here"))
    }

    /// The writing end of `edge` for the endpoint `me`: one end per channel of the edge.
    pub(crate) fn writer<T: Value>(
        &self,
        plan: &GraphPlan,
        edge: u64,
        me: Loc,
    ) -> std::result::Result<FanOut<T>, String> {
        let e = plan.edge(edge)?;
        if e.writer != me {
            return Err(format!("{me:?} does not write edge {}", e.label));
        }
        let counters = Arc::new(EndCounters::default());
        let mut ends: Vec<Writer<T>> = Vec::new();
        for chan in &e.channels {
            match chan.kind {
                ChannelKind::InProcess => {
                    for end in self
                        .local
                        .writers::<T>(chan.id, chan.readers.len(), plan.depth)
                        .map_err(|err| format!("edge {}: {err}", e.label))?
                    {
                        ends.push(Box::new(end));
                    }
                }
                ChannelKind::SharedMemory => {
                    ends.push(Box::new(
                        ShmTx::<T>::new(self.shm(edge, chan.id)?.writer())
                            .counted(counters.clone()),
                    ));
                }
            }
        }
        self.counters.0.lock().push((edge, counters.clone()));
        Ok(FanOut::new(ends).counted(counters))
    }

    /// The reading end of `edge` for the endpoint `me`.
    pub(crate) fn reader<T: Value>(
        &self,
        plan: &GraphPlan,
        edge: u64,
        me: Loc,
    ) -> std::result::Result<Reader<T>, String> {
        let e = plan.edge(edge)?;
        let Some((chan, index)) = e.read_by(me) else {
            return Err(format!("{me:?} does not read edge {}", e.label));
        };
        Ok(match chan.kind {
            ChannelKind::InProcess => Box::new(
                self.local
                    .reader::<T>(chan.id, index, chan.readers.len(), plan.depth)
                    .map_err(|err| format!("edge {}: {err}", e.label))?,
            ),
            ChannelKind::SharedMemory => Box::new(ShmRx::<T>::new(
                self.shm(edge, chan.id)?
                    .reader(index as u32)
                    .in_group(self.group.clone()),
            )),
        })
    }

    /// The counters of every writer opened in this process (and of those opened later).
    pub(crate) fn counters(&self) -> EdgeCounters {
        self.counters.clone()
    }

    /// Close every channel of the graph in this process (teardown, death of a peer): wakes
    /// every end that waits.
    pub(crate) fn close_all(&self) {
        for ch in self.shm.values() {
            ch.close();
        }
        self.local.close();
    }
}

/// A reader of one edge whose type the caller does not know statically (a by-name output):
/// values come out as [`AnyValue`].
pub(crate) trait ErasedReader: Send {
    /// Read the next message, waiting until `deadline` (`None`: until the channel closes).
    fn read(&mut self, deadline: Option<Instant>) -> Result<Msg<AnyValue>, ChanError>;
}

/// Opens the reading end of an edge for the endpoint `me` as an [`ErasedReader`]; made where
/// the edge's type is known (the method table of an actor type).
pub(crate) type ErasedReaderFn =
    fn(&GraphChannels, &GraphPlan, u64, Loc) -> std::result::Result<Box<dyn ErasedReader>, String>;

struct Erased<T>(Reader<T>);

impl<T: Value> ErasedReader for Erased<T> {
    fn read(&mut self, deadline: Option<Instant>) -> Result<Msg<AnyValue>, ChanError> {
        Ok(match self.0.read(deadline)? {
            Msg::Value(v) => Msg::Value(AnyValue::new(v)),
            Msg::Error(e) => Msg::Error(e),
        })
    }
}

/// The [`ErasedReaderFn`] of an edge carrying `T`.
pub(crate) fn erased_reader<T: Value>(
    chans: &GraphChannels,
    plan: &GraphPlan,
    edge: u64,
    me: Loc,
) -> std::result::Result<Box<dyn ErasedReader>, String> {
    Ok(Box::new(Erased(chans.reader::<T>(plan, edge, me)?)))
}
