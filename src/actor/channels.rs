//! The channels of one compiled graph in one process, opened from the plan: each end of an
//! edge gets the kind the plan chose for it (where its writer and readers live). This is the
//! one place that maps a [`ChannelKind`] to its module; the actor loop and the driver then see
//! only [`ChannelWriter`](crate::channel::ChannelWriter) and
//! [`ChannelReader`](crate::channel::ChannelReader).
use super::observe::EdgeCounters;
use crate::channel::local::LocalHub;
use crate::channel::net::{self, NetRx, NetTx};
use crate::channel::shm::{ShmChannel, ShmConfig, ShmGroup, ShmRx, ShmTx};
use crate::channel::{ChanError, EndCounters, FanOut, Msg, Reader, Writer};
use crate::cluster::data::DataPlane;
use crate::compile::plan::{ChannelKind, GraphPlan, Loc};
use crate::error::{Error, Result};
use crate::value::{AnyValue, Value};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::OwnedFd;
use std::sync::Arc;
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
    /// The shared-memory channels mapped here, by channel id (a relayed network channel's
    /// ring on its readers' host has the network channel's id).
    shm: HashMap<u64, ShmChannel>,
    /// The connections of network channels whose end is in this process (or that this host
    /// hands to one of its workers), by channel id, until that end is opened.
    net: Mutex<HashMap<u64, TcpStream>>,
    /// Every connection this process opened or received, kept to shut it down at close:
    /// shutting a socket down wakes its ends in every process that holds it.
    net_all: Mutex<Vec<TcpStream>>,
    /// The ceiling of one message (network ends check it themselves).
    max_message_bytes: usize,
    spin: Duration,
    /// In the process that created them (the driver, an agent): every shared-memory channel
    /// of the graph it made, where a reader finds the payloads written to it by reference
    /// (empty in a worker).
    group: ShmGroup,
    /// The counters of every writer opened here, by edge (read by the graph's statistics;
    /// locked only when a writer is opened and when statistics are read).
    counters: EdgeCounters,
}

/// What a host hands one of its workers for a graph: the ids of its shared-memory channels
/// and network connections, and their descriptors in that order.
#[derive(Default)]
pub(crate) struct Handed {
    pub shm: Vec<u64>,
    pub net: Vec<u64>,
    pub fds: Vec<OwnedFd>,
}

impl GraphChannels {
    /// The channels of a graph in a process that maps the shared-memory channels `shm`; the
    /// in-process channels' waits spin up to `spin` before they sleep.
    fn new(shm: HashMap<u64, ShmChannel>, spin: Duration, max_message_bytes: usize) -> Self {
        GraphChannels {
            local: LocalHub::new(spin),
            shm,
            net: Mutex::new(HashMap::new()),
            net_all: Mutex::new(Vec::new()),
            max_message_bytes,
            spin,
            group: ShmGroup::default(),
            counters: EdgeCounters::default(),
        }
    }

    /// The channels of `plan` that host `host` makes (the driver for its own host, an agent
    /// for its): every shared-memory channel whose writer is on the host, and the ring of
    /// each network channel relayed to readers there.
    pub(crate) fn create(plan: &GraphPlan, sizes: &ChannelSizes, host: u64) -> Result<Self> {
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
            let here = plan.host_of(edge.writer) == host;
            for chan in &edge.channels {
                let make = match chan.kind {
                    ChannelKind::SharedMemory => here,
                    ChannelKind::Network => chan.relayed() && chan.host == host,
                    ChannelKind::InProcess => false,
                };
                if !make {
                    continue;
                }
                let cfg = ShmConfig {
                    depth: plan.depth as u32,
                    readers: chan.readers.len() as u32,
                    slot_bytes: sizes.slot_bytes,
                    max_message_bytes: sizes.max_message_bytes,
                    spin: sizes.spin,
                    group,
                    readers_map_group: chan.readers.iter().all(|r| *r == Loc::Driver),
                };
                let ch = ShmChannel::create(&cfg, &format!("adag-g{}-c{}", plan.graph, chan.id))
                    .map_err(|e| {
                        Error::io(
                            format!("creating the shared-memory channel of {}", edge.label),
                            e,
                        )
                    })?;
                shm.insert(chan.id, ch);
            }
        }
        let mut chans = Self::new(shm, sizes.spin, sizes.max_message_bytes);
        chans.group = ShmGroup::new(chans.shm.values());
        Ok(chans)
    }

    /// Opens host `host`'s network connections of `plan`: connects to the reading host of each
    /// network channel written here (`addrs`: each host's data port), then takes each
    /// connection that a writing host made to this one from `data` (waiting until
    /// `deadline`), and starts the relay of each channel whose several readers here share a
    /// ring. Every host connects before it waits, so no order of installs deadlocks. A channel
    /// that goes back over another's connection (`GraphPlan::shared_connections`) is filed
    /// with a handle of that connection at both ends instead of connecting.
    pub(crate) fn connect_network(
        &self,
        plan: &GraphPlan,
        host: u64,
        data: &DataPlane,
        addrs: &HashMap<u64, SocketAddr>,
        deadline: Instant,
    ) -> Result<()> {
        let pairs = plan.shared_connections();
        // The second channel of a pair has no connection of its own: it goes back over the
        // first's, which both of its ends file for it too.
        let second_of: HashMap<u64, u64> = pairs.iter().copied().collect();
        let riding: std::collections::HashSet<u64> = pairs.iter().map(|p| p.1).collect();
        let network = || {
            plan.edges
                .values()
                .flat_map(|e| e.network_channels().map(move |c| (e, c)))
                .filter(|(_, c)| !riding.contains(&c.id))
        };
        let keep_with_second = |chan: u64, stream: TcpStream| -> Result<()> {
            if let Some(second) = second_of.get(&chan) {
                let back = stream
                    .try_clone()
                    .map_err(|e| Error::io("sharing a network connection", e))?;
                self.keep(*second, back)?;
            }
            self.keep(chan, stream)
        };
        for (edge, chan) in network().filter(|(e, _)| plan.host_of(e.writer) == host) {
            let addr = addrs.get(&chan.host).ok_or_else(|| {
                Error::compile(
                    edge.label.clone(),
                    format!("host {} (its readers' host) is not connected", chan.host),
                )
            })?;
            let stream = data.connect(*addr, plan.graph, chan.id, deadline).map_err(|e| {
                Error::io(
                    format!(
                        "connecting the network channel of {} from host {host} to host {} at {addr}",
                        edge.label, chan.host
                    ),
                    e,
                )
            })?;
            keep_with_second(chan.id, stream)?;
        }
        for (edge, chan) in network().filter(|(_, c)| c.host == host) {
            let stream = data.take(plan.graph, chan.id, deadline).map_err(|why| {
                Error::compile(
                    edge.label.clone(),
                    format!(
                        "its network channel from host {} to host {host}: {why}",
                        plan.host_of(edge.writer)
                    ),
                )
            })?;
            if chan.relayed() {
                let ring = self
                    .shm(edge.id, chan.id)
                    .map_err(|e| Error::compile(edge.label.clone(), e))?;
                let writer = ring.writer();
                self.shut_at_close(&stream)?;
                let (limit, label) = (self.max_message_bytes, edge.label.clone());
                std::thread::Builder::new()
                    .name(format!("adag-relay-{}", chan.id))
                    .spawn(move || {
                        if let Err(e) = net::relay(stream, writer, limit) {
                            tracing::debug!(edge = %label, error = ?e, "relay ended");
                        }
                    })
                    .map_err(|e| Error::io("starting a relay thread", e))?;
            } else {
                keep_with_second(chan.id, stream)?;
            }
        }
        Ok(())
    }

    /// Files a network connection for the end that will open it.
    fn keep(&self, chan: u64, stream: TcpStream) -> Result<()> {
        net::prepare(&stream).map_err(|e| Error::io("setting up a network connection", e))?;
        self.shut_at_close(&stream)?;
        self.net.lock().insert(chan, stream);
        Ok(())
    }

    /// Keeps a handle of `stream` that [`close_all`](Self::close_all) shuts down.
    fn shut_at_close(&self, stream: &TcpStream) -> Result<()> {
        let closer = stream
            .try_clone()
            .map_err(|e| Error::io("keeping a network connection", e))?;
        self.net_all.lock().push(closer);
        Ok(())
    }

    /// The channels that endpoint `me` (a worker of this host) writes or reads: the ids of
    /// its shared-memory channels and of its network connections, and their descriptors in
    /// that order, to send along with its schedule. The connections handed over are no
    /// longer this process's to open (it keeps them only to shut them down).
    pub(crate) fn handed_to(&self, plan: &GraphPlan, me: Loc) -> Result<Handed> {
        let mut handed = Handed::default();
        for e in plan.edges.values() {
            for chan in &e.channels {
                let mine = e.writer == me || chan.readers.contains(&me);
                if !mine {
                    continue;
                }
                match chan.kind {
                    ChannelKind::InProcess => {}
                    ChannelKind::SharedMemory => handed.shm.push(chan.id),
                    ChannelKind::Network if e.writer != me && chan.relayed() => {
                        handed.shm.push(chan.id)
                    }
                    ChannelKind::Network => handed.net.push(chan.id),
                }
            }
        }
        for id in &handed.shm {
            let ch = self.shm.get(id).ok_or_else(|| {
                Error::io(
                    format!("handing channel {id} to {me:?}"),
                    "its shared-memory channel is not mapped on this host (a bug)",
                )
            })?;
            handed.fds.push(
                ch.fd()
                    .try_clone_to_owned()
                    .map_err(|e| Error::io("handing a channel over", e))?,
            );
        }
        let mut net = self.net.lock();
        for id in &handed.net {
            let stream = net.remove(id).ok_or_else(|| {
                Error::io(
                    format!("handing network channel {id} to {me:?}"),
                    "its connection is not open on this host (a bug)",
                )
            })?;
            handed.fds.push(OwnedFd::from(stream));
        }
        Ok(handed)
    }

    /// A worker's channels: the shared-memory channels `ids` and the network connections
    /// `net`, whose descriptors `fds` came in that order.
    pub(crate) fn open(
        ids: &[u64],
        net: &[u64],
        fds: Vec<OwnedFd>,
        spin: Duration,
        max_message_bytes: usize,
    ) -> std::result::Result<Self, String> {
        if fds.len() != ids.len() + net.len() {
            return Err(format!(
                "expected {} channel fds, got {}",
                ids.len() + net.len(),
                fds.len()
            ));
        }
        let mut shm = HashMap::new();
        let mut fds = fds.into_iter();
        for (id, fd) in ids.iter().zip(fds.by_ref()) {
            let ch = ShmChannel::open(fd).map_err(|e| format!("cannot map channel {id}: {e}"))?;
            shm.insert(*id, ch);
        }
        let chans = Self::new(shm, spin, max_message_bytes);
        for (id, fd) in net.iter().zip(fds) {
            chans
                .keep(*id, TcpStream::from(fd))
                .map_err(|e| format!("network channel {id}: {e}"))?;
        }
        Ok(chans)
    }

    fn take_net(&self, edge: &str, chan: u64) -> std::result::Result<TcpStream, String> {
        self.net.lock().remove(&chan).ok_or_else(|| {
            format!(
                "edge {edge}: network channel {chan} is not connected here (or was opened twice)"
            )
        })
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
        self.writer_counted(plan, edge, me).map(|(w, _)| w)
    }

    /// [`writer`](Self::writer), with the counters of the edge's statistics that it writes,
    /// for a writer that also moves the edge's data another way (a communicator edge, whose
    /// channel carries only the tensor's metadata).
    pub(crate) fn writer_counted<T: Value>(
        &self,
        plan: &GraphPlan,
        edge: u64,
        me: Loc,
    ) -> std::result::Result<(FanOut<T>, Arc<EndCounters>), String> {
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
                ChannelKind::Network => {
                    ends.push(Box::new(
                        NetTx::<T>::new(self.take_net(&e.label, chan.id)?, self.max_message_bytes)
                            .counted(counters.clone()),
                    ));
                }
            }
        }
        self.counters.add(edge, counters.clone());
        Ok((FanOut::new(ends).counted(counters.clone()), counters))
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
            ChannelKind::Network if chan.relayed() => Box::new(ShmRx::<T>::new(
                self.shm(edge, chan.id)?.reader(index as u32),
            )),
            ChannelKind::Network => Box::new(NetRx::<T>::new(
                self.take_net(&e.label, chan.id)?,
                self.max_message_bytes,
                self.spin,
            )),
        })
    }

    /// The ceiling of one message.
    pub(crate) fn max_message_bytes(&self) -> usize {
        self.max_message_bytes
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
        for stream in self.net_all.lock().iter() {
            net::shut(stream);
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
