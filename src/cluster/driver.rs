//! The driver's side of a cluster: it listens, authenticates each joining agent, keeps a table
//! of hosts and a heartbeat with each, and marks a host lost when its connection closes or
//! falls silent past the heartbeat timeout.
use super::data::DataPlane;
use super::gate::{self, Doorman, Step};
use super::wire::{
    self, AgentReply, AgentRequest, Hello, RemoteFailure, ToAgent, ToDriver, WireError,
};
use super::{ClusterOptions, HostInfo, HostLoss};
use crate::error::{Error, Result};
use crossbeam_channel::Sender;
use parking_lot::{Condvar, Mutex};
use std::collections::HashMap;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

type Reply = Result<AgentReply, RemoteFailure>;
/// How long a broken connection reported by one host waits for another host of the cluster
/// to be counted lost (a killed host is seen within milliseconds: its connection closes).
const FAULT_GRACE: Duration = Duration::from_millis(500);
/// Told why an actor's worker died (or its host was lost).
pub(crate) type DeathCallback = Box<dyn Fn(&str) + Send + Sync>;
/// Told that a graph's schedule stopped on a host: (actor, why).
pub(crate) type FaultCallback = Arc<dyn Fn(&str, &str) + Send + Sync>;

/// Where the output and `tracing` events of workers on other hosts go in the driver (the
/// runtime's log forwarding): it must never block, since a host's reader thread calls it.
pub(crate) trait LogSink: Send + Sync {
    /// Lines of workers of host `host` (`(true, line)`: stderr), each already prefixed.
    fn lines(&self, host: &str, lines: Vec<(bool, String)>);
    /// An encoded `tracing` event of `actor`'s worker (process `pid`) on host `host`.
    fn event(&self, host: &str, actor: &str, pid: u32, record: &[u8]);
}

struct Host {
    info: HostInfo,
    /// The writing side of the connection (heartbeats, requests, shutdown); one writer at a
    /// time, so that frames never interleave.
    stream: Arc<Mutex<TcpStream>>,
    /// Requests waiting for their reply.
    pending: HashMap<u64, Sender<Reply>>,
    /// Its clock against the driver's, from the heartbeats (what [`HostInfo::clock`] shows).
    clock: super::clock::ClockSync,
    /// The actors started there, told when their worker dies.
    deaths: HashMap<u64, DeathCallback>,
}

impl Host {
    /// The host as the runtime lists it, with its clock as estimated now.
    fn listed(&self) -> HostInfo {
        HostInfo {
            clock: self.clock.estimate(),
            ..self.info.clone()
        }
    }
}

struct State {
    hosts: Vec<Host>,
    next_id: u64,
    /// Live graphs across hosts, told when one of their schedules stops on its own.
    faults: HashMap<u64, FaultCallback>,
}

pub(crate) struct ClusterDriver {
    addr: SocketAddr,
    /// The driver's host's data port (network channels that end here).
    data: Arc<DataPlane>,
    opts: ClusterOptions,
    state: Mutex<State>,
    /// Signalled when a host joins or is lost.
    changed: Condvar,
    stop: AtomicBool,
    next_req: AtomicU64,
    logs: std::sync::OnceLock<Arc<dyn LogSink>>,
}

impl ClusterDriver {
    /// Listen on `opts.addr` and accept agents until dropped.
    pub(crate) fn start(opts: ClusterOptions) -> Result<Arc<ClusterDriver>> {
        if opts.token.is_empty() {
            return Err(Error::io(
                "starting the cluster listener",
                "the shared secret is empty; pass a token that every host's ADAG_TOKEN repeats",
            ));
        }
        let listener = TcpListener::bind(opts.addr)
            .map_err(|e| Error::io(format!("listening on {}", opts.addr), e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::io("reading the listener's address", e))?;
        // Polled by the port's door (`gate`), with every pending handshake.
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::io("setting up the listener", e))?;
        let data_bind = SocketAddr::new(addr.ip(), 0);
        let data = DataPlane::start(data_bind, opts.token.as_bytes())
            .map_err(|e| Error::io(format!("listening for data connections on {data_bind}"), e))?;
        let driver = Arc::new(ClusterDriver {
            addr,
            data,
            opts,
            state: Mutex::new(State {
                hosts: Vec::new(),
                next_id: 1,
                faults: HashMap::new(),
            }),
            changed: Condvar::new(),
            stop: AtomicBool::new(false),
            next_req: AtomicU64::new(1),
            logs: std::sync::OnceLock::new(),
        });
        let weak = Arc::downgrade(&driver);
        std::thread::Builder::new()
            .name("adag-cluster-accept".into())
            .spawn(move || gate::run(listener, &weak))
            .map_err(|e| Error::io("starting the cluster's accept thread", e))?;
        let weak = Arc::downgrade(&driver);
        let interval = driver.opts.heartbeat_interval;
        std::thread::Builder::new()
            .name("adag-cluster-heartbeat".into())
            .spawn(move || {
                while let Some(d) = weak.upgrade() {
                    if d.stop.load(Ordering::Acquire) {
                        break;
                    }
                    d.send_heartbeats();
                    drop(d);
                    std::thread::sleep(interval);
                }
            })
            .map_err(|e| Error::io("starting the cluster's heartbeat thread", e))?;
        tracing::debug!(%addr, "cluster listening");
        Ok(driver)
    }

    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `on_fault` hears of graph `graph`'s schedules that stop on their own on other hosts,
    /// until [`forget_graph`](Self::forget_graph).
    pub(crate) fn on_fault(&self, graph: u64, on_fault: FaultCallback) {
        self.state.lock().faults.insert(graph, on_fault);
    }

    pub(crate) fn forget_graph(&self, graph: u64) {
        self.state.lock().faults.remove(&graph);
    }

    fn fault(self: &Arc<Self>, host: u64, graph: u64, actor: String, reason: String) {
        let Some(cb) = self.state.lock().faults.get(&graph).cloned() else {
            return;
        };
        let why = format!("on {}: {reason}", self.describe_host(host));
        let lost_before = self.lost_count();
        let driver = Arc::downgrade(self);
        // Off the host's reader thread, as deaths are. A host that died breaks its neighbours'
        // connections too, and their report can come first: wait a moment for the loss, so
        // that the graph fails naming the host that died (ActorDied), not a neighbour.
        let _ = std::thread::Builder::new()
            .name(format!("adag-fault-{graph}"))
            .spawn(move || {
                if let Some(d) = driver.upgrade() {
                    let until = Instant::now() + FAULT_GRACE;
                    let mut state = d.state.lock();
                    while Self::count_lost(&state) == lost_before
                        && !d.changed.wait_until(&mut state, until).timed_out()
                    {
                    }
                    let lost = Self::count_lost(&state) > lost_before;
                    drop(state);
                    drop(d);
                    if lost {
                        // Its actors' deaths are being reported on their own thread.
                        std::thread::sleep(Duration::from_millis(50));
                    }
                }
                cb(&actor, &why)
            });
    }

    fn count_lost(state: &State) -> usize {
        state.hosts.iter().filter(|h| h.info.lost.is_some()).count()
    }

    fn lost_count(&self) -> usize {
        Self::count_lost(&self.state.lock())
    }

    /// Sends the output and events of workers on other hosts to `sink` (set once, right
    /// after the driver starts).
    pub(crate) fn set_log_sink(&self, sink: Arc<dyn LogSink>) {
        let _ = self.logs.set(sink);
    }

    /// The driver's host's data port.
    pub(crate) fn data(&self) -> &Arc<DataPlane> {
        &self.data
    }

    /// Where each host's data port is reached, by host id (0: the driver's, whose address
    /// may be unspecified: each host then uses the address it reaches the driver at).
    pub(crate) fn data_addrs(&self) -> Vec<(u64, SocketAddr)> {
        let mut all = vec![(0, self.data.addr())];
        all.extend(
            self.state
                .lock()
                .hosts
                .iter()
                .filter(|h| h.info.lost.is_none())
                .map(|h| (h.info.id, h.info.data_address)),
        );
        all
    }

    /// Every host that joined, in joining order: the lost ones too, marked with when and why.
    pub(crate) fn hosts(&self) -> Vec<HostInfo> {
        self.state.lock().hosts.iter().map(Host::listed).collect()
    }

    pub(crate) fn wait_for_hosts(&self, n: usize, timeout: Duration) -> Result<Vec<HostInfo>> {
        let deadline = Instant::now() + timeout;
        let mut state = self.state.lock();
        loop {
            let live: Vec<HostInfo> = state
                .hosts
                .iter()
                .filter(|h| h.info.lost.is_none())
                .map(Host::listed)
                .collect();
            if live.len() >= n {
                return Ok(live);
            }
            if self.changed.wait_until(&mut state, deadline).timed_out() {
                let live = state.hosts.iter().filter(|h| h.info.lost.is_none()).count();
                return Err(Error::Timeout {
                    what: format!("{n} hosts to join {} ({live} joined)", self.addr),
                    timeout,
                    hint: format!(
                        "start the missing hosts with ADAG_JOIN={} and the same ADAG_TOKEN (docs/multi-host.md), or wait longer",
                        self.addr
                    ),
                });
            }
        }
    }

    /// Host `id`'s name and its clock against the driver's (`None`: no estimate yet).
    pub(crate) fn clock_of(&self, id: u64) -> (String, Option<super::ClockOffset>) {
        self.state
            .lock()
            .hosts
            .iter()
            .find(|h| h.info.id == id)
            .map_or_else(
                || (format!("host {id}"), None),
                |h| (h.info.name.clone(), h.clock.estimate()),
            )
    }

    /// The name of host `id`, as errors show it.
    pub(crate) fn describe_host(&self, id: u64) -> String {
        self.state
            .lock()
            .hosts
            .iter()
            .find(|h| h.info.id == id)
            .map_or_else(
                || format!("host {id}"),
                |h| format!("host {} ({id})", h.info.name),
            )
    }

    /// Send `request` to host `host` and wait for its reply; fails at once if the host is
    /// lost (before or while waiting).
    pub(crate) fn request(&self, host: u64, request: AgentRequest) -> Reply {
        self.request_until(host, request, None)
    }

    /// As [`request`](Self::request), failing with [`RemoteFailure::TimedOut`] when no reply
    /// came within `wait`: for requests whose answer is worth less than a wait for the host
    /// to be declared lost (a silent host takes the whole heartbeat timeout).
    pub(crate) fn request_within(&self, host: u64, request: AgentRequest, wait: Duration) -> Reply {
        self.request_until(host, request, Some(wait))
    }

    fn request_until(&self, host: u64, request: AgentRequest, wait: Option<Duration>) -> Reply {
        let req = self.next_req.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = crossbeam_channel::bounded(1);
        let stream = {
            let mut state = self.state.lock();
            let Some(h) = state.hosts.iter_mut().find(|h| h.info.id == host) else {
                return Err(RemoteFailure::HostLost(format!(
                    "no host {host} joined this driver"
                )));
            };
            if let Some(l) = &h.info.lost {
                return Err(RemoteFailure::HostLost(lost_text(h, &l.reason)));
            }
            h.pending.insert(req, tx);
            h.stream.clone()
        };
        let sent = wire::write_frame(&mut *stream.lock(), &ToAgent::Request { req, request });
        if let Err(e) = sent {
            self.mark_lost(host, format!("sending to it failed: {e}"));
        }
        // The reader answers, or a lost host drops the sender.
        let got = match wait {
            None => rx.recv().map_err(|_| ()),
            Some(wait) => match rx.recv_timeout(wait) {
                Ok(reply) => Ok(reply),
                Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                    // A late reply then finds no one waiting and is dropped.
                    self.abandon(host, req);
                    return Err(RemoteFailure::TimedOut(wait));
                }
                Err(crossbeam_channel::RecvTimeoutError::Disconnected) => Err(()),
            },
        };
        got.unwrap_or_else(|()| {
            Err(RemoteFailure::HostLost(
                self.lost_reason(host)
                    .unwrap_or_else(|| "its connection closed".into()),
            ))
        })
    }

    /// Runs `f` on the state of host `host` under the lock, if that host joined.
    fn with_host<R>(&self, host: u64, f: impl FnOnce(&mut Host) -> R) -> Option<R> {
        self.state
            .lock()
            .hosts
            .iter_mut()
            .find(|h| h.info.id == host)
            .map(f)
    }

    fn abandon(&self, host: u64, req: u64) {
        self.with_host(host, |h| h.pending.remove(&req));
    }

    /// Send `request` to host `host` without waiting for its reply (nothing to wait for when
    /// the host is lost).
    pub(crate) fn notify(&self, host: u64, request: AgentRequest) {
        let req = self.next_req.fetch_add(1, Ordering::Relaxed);
        let stream = self
            .state
            .lock()
            .hosts
            .iter()
            .find(|h| h.info.id == host && h.info.lost.is_none())
            .map(|h| h.stream.clone());
        if let Some(stream) = stream {
            let _ = wire::write_frame(&mut *stream.lock(), &ToAgent::Request { req, request });
        }
    }

    /// Tell `on_death` when actor `actor` on host `host` dies, or its host is lost.
    pub(crate) fn on_death(&self, host: u64, actor: u64, on_death: DeathCallback) {
        let mut state = self.state.lock();
        match state.hosts.iter_mut().find(|h| h.info.id == host) {
            Some(h) if h.info.lost.is_none() => {
                h.deaths.insert(actor, on_death);
            }
            Some(h) => {
                let why = format!(
                    "its host {} was lost: {}",
                    h.info.name,
                    h.info
                        .lost
                        .as_ref()
                        .map(|l| l.reason.clone())
                        .unwrap_or_default()
                );
                drop(state);
                on_death(&why);
            }
            None => {}
        }
    }

    /// Stop telling anyone about actor `actor` (its handles are gone).
    pub(crate) fn forget(&self, host: u64, actor: u64) {
        self.with_host(host, |h| h.deaths.remove(&actor));
    }

    fn lost_reason(&self, host: u64) -> Option<String> {
        self.state
            .lock()
            .hosts
            .iter()
            .find(|h| h.info.id == host)
            .and_then(|h| h.info.lost.as_ref().map(|l| lost_text(h, &l.reason)))
    }

    fn reply(&self, host: u64, req: u64, result: Reply) {
        if let Some(tx) = self.with_host(host, |h| h.pending.remove(&req)).flatten() {
            let _ = tx.send(result);
        }
    }

    fn died(&self, host: u64, actor: u64, reason: &str) {
        // Named as faults are: which host the actor died on.
        let reason = format!("on {}: {reason}", self.describe_host(host));
        if let Some(cb) = self.with_host(host, |h| h.deaths.remove(&actor)).flatten() {
            // Not on this host's reader thread: what the callback does (tearing a graph down)
            // sends requests to this host, whose replies that thread must read.
            let spawned = std::thread::Builder::new()
                .name(format!("adag-death-{actor}"))
                .spawn(move || cb(&reason));
            if let Err(e) = spawned {
                tracing::error!(actor, error = %e, "no thread to report a death");
            }
        }
    }

    fn send_heartbeats(&self) {
        let mut lost = Vec::new();
        let streams: Vec<(u64, Arc<Mutex<TcpStream>>)> = self
            .state
            .lock()
            .hosts
            .iter()
            .filter(|h| h.info.lost.is_none())
            .map(|h| (h.info.id, h.stream.clone()))
            .collect();
        for (id, stream) in streams {
            let beat = ToAgent::Heartbeat {
                driver_ns: crate::clock::mono_ns(),
            };
            if let Err(e) = wire::write_frame(&mut *stream.lock(), &beat) {
                lost.push((id, format!("the connection broke: {e}")));
            }
        }
        for (id, why) in lost {
            self.mark_lost(id, why);
        }
    }

    fn mark_lost(&self, id: u64, why: String) {
        let mut state = self.state.lock();
        let mut deaths = Vec::new();
        let mut reason = String::new();
        if let Some(h) = state.hosts.iter_mut().find(|h| h.info.id == id)
            && h.info.lost.is_none()
        {
            tracing::warn!(host = id, name = %h.info.name, reason = %why, "host lost");
            let _ = h.stream.lock().shutdown(Shutdown::Both);
            // Waiting requests fail now (their senders drop); actors there are dead.
            h.pending.clear();
            deaths = h.deaths.drain().map(|(_, cb)| cb).collect();
            reason = lost_text(h, &why);
            h.info.lost = Some(HostLoss {
                at: std::time::SystemTime::now(),
                reason: why,
            });
        }
        drop(state);
        self.changed.notify_all();
        if deaths.is_empty() {
            return;
        }
        // Off the caller's thread (a host's reader, the heartbeat thread): tearing a graph
        // down takes time and sends requests to other hosts.
        let spawned = std::thread::Builder::new()
            .name(format!("adag-lost-{id}"))
            .spawn(move || {
                for cb in deaths {
                    cb(&reason);
                }
            });
        if let Err(e) = spawned {
            tracing::error!(host = id, error = %e, "no thread to report a lost host");
        }
    }

    /// Add the host of a connection that proved it knows the secret.
    fn admit(self: &Arc<Self>, mut stream: TcpStream, peer: SocketAddr) -> Result<(), WireError> {
        stream.set_nonblocking(false)?;
        stream.set_read_timeout(Some(wire::HANDSHAKE_TIMEOUT))?;
        stream.set_write_timeout(Some(wire::HANDSHAKE_TIMEOUT))?;
        let hello: Hello = wire::read_frame(&mut stream)?;
        let (id, host_name) = {
            let mut state = self.state.lock();
            let id = state.next_id;
            state.next_id += 1;
            let data = if hello.data.ip().is_unspecified() {
                SocketAddr::new(peer.ip(), hello.data.port())
            } else {
                hello.data
            };
            let info = HostInfo {
                id,
                name: hello.name,
                address: peer,
                cores: hello.cores,
                pid: hello.pid,
                data_address: data,
                lost: None,
                clock: None,
            };
            wire::write_frame(
                &mut stream,
                &ToAgent::Welcome {
                    host: id,
                    interval_ms: self.opts.heartbeat_interval.as_millis() as u64,
                    timeout_ms: self.opts.heartbeat_timeout.as_millis() as u64,
                    log_level: tracing::level_filters::LevelFilter::current().to_string(),
                },
            )?;
            // Writes of heartbeats never block the driver for long on a stuck peer.
            stream.set_write_timeout(Some(self.opts.heartbeat_timeout))?;
            // A first heartbeat now: the host's clock is estimated before any graph runs there.
            wire::write_frame(
                &mut stream,
                &ToAgent::Heartbeat {
                    driver_ns: crate::clock::mono_ns(),
                },
            )?;
            tracing::info!(host = id, name = %info.name, %peer, cores = info.cores, "host joined");
            let host_name = info.name.clone();
            state.hosts.push(Host {
                info,
                stream: Arc::new(Mutex::new(stream.try_clone()?)),
                pending: HashMap::new(),
                deaths: HashMap::new(),
                clock: Default::default(),
            });
            (id, host_name)
        };
        self.changed.notify_all();
        // Reader: heartbeats keep the host alive; silence past the timeout loses it.
        stream.set_read_timeout(Some(self.opts.heartbeat_timeout))?;
        let weak = Arc::downgrade(self);
        std::thread::Builder::new()
            .name(format!("adag-host-{id}"))
            .spawn(move || {
                let why = loop {
                    match wire::read_frame_within::<ToDriver>(&mut stream, wire::MAX_JOINED_FRAME) {
                        Ok(ToDriver::Heartbeat) => {}
                        Ok(ToDriver::Clock {
                            driver_ns,
                            agent_ns,
                        }) => {
                            let now = crate::clock::mono_ns();
                            if let Some(d) = weak.upgrade()
                                && let Some(h) =
                                    d.state.lock().hosts.iter_mut().find(|h| h.info.id == id)
                            {
                                h.clock.sample(driver_ns, agent_ns, now);
                            }
                        }
                        Ok(ToDriver::Reply { req, result }) => {
                            if let Some(d) = weak.upgrade() {
                                d.reply(id, req, result);
                            }
                        }
                        Ok(ToDriver::Died { actor, reason }) => {
                            if let Some(d) = weak.upgrade() {
                                d.died(id, actor, &reason);
                            }
                        }
                        Ok(ToDriver::GraphFault {
                            graph,
                            actor,
                            reason,
                        }) => {
                            if let Some(d) = weak.upgrade() {
                                d.fault(id, graph, actor, reason);
                            }
                        }
                        Ok(ToDriver::Logs { lines }) => {
                            if let Some(sink) = weak.upgrade().and_then(|d| d.logs.get().cloned()) {
                                sink.lines(&host_name, lines);
                            }
                        }
                        Ok(ToDriver::Event { actor, pid, record }) => {
                            if let Some(sink) = weak.upgrade().and_then(|d| d.logs.get().cloned()) {
                                sink.event(&host_name, &actor, pid, &record);
                            }
                        }
                        Err(WireError::Io(e))
                            if matches!(
                                e.kind(),
                                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                            ) =>
                        {
                            break "it sent nothing for longer than the heartbeat timeout"
                                .to_string();
                        }
                        Err(WireError::Io(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                            break "its connection closed (the agent exited)".to_string();
                        }
                        // A peer that exits with bytes unread resets the connection instead of
                        // closing it: the same departure, said the same way.
                        Err(WireError::Io(e))
                            if matches!(
                                e.kind(),
                                std::io::ErrorKind::ConnectionReset
                                    | std::io::ErrorKind::ConnectionAborted
                            ) =>
                        {
                            break format!(
                                "its connection closed abruptly ({e}: the agent exited, or its host went down)"
                            );
                        }
                        Err(e) => break format!("its connection failed: {e}"),
                    }
                };
                if let Some(d) = weak.upgrade() {
                    d.mark_lost(id, why);
                }
            })?;
        Ok(())
    }
}

/// Why an actor of lost host `h` is gone, naming the host.
fn lost_text(h: &Host, why: &str) -> String {
    format!(
        "its host {} (id {}) was lost: {why}",
        h.info.name, h.info.id
    )
}

impl Drop for ClusterDriver {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        self.data.stop();
        let state = self.state.lock();
        for h in state.hosts.iter().filter(|h| h.info.lost.is_none()) {
            let mut stream = h.stream.lock();
            let _ = wire::write_frame(&mut *stream, &ToAgent::Shutdown);
            let _ = stream.shutdown(Shutdown::Both);
        }
    }
}

impl Doorman for ClusterDriver {
    type Progress = wire::JoinCheck;
    type Proved = ();
    const WHAT: &'static str = "joins";

    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    /// Nothing: the agent speaks first.
    fn greet(&self, _stream: &TcpStream) -> std::io::Result<wire::JoinCheck> {
        Ok(wire::JoinCheck::default())
    }

    fn advance(&self, check: &mut wire::JoinCheck, stream: &TcpStream) -> Step<()> {
        match check.advance(stream, self.opts.token.as_bytes()) {
            Ok(false) => Step::Waiting,
            Ok(true) => Step::Proved(()),
            Err(e) => Step::Refused(e.to_string()),
        }
    }

    /// The rest of a proved join (its `Hello`, the welcome) on a thread of its own: the peer
    /// knows the secret, and its reads are bounded by the handshake's timeout.
    fn proved(self: &Arc<Self>, stream: TcpStream, peer: SocketAddr, (): ()) {
        let d = self.clone();
        let spawned = std::thread::Builder::new()
            .name("adag-cluster-join".into())
            .spawn(move || {
                if let Err(e) = d.admit(stream, peer) {
                    tracing::warn!(%peer, reason = %e, "join refused");
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(%peer, reason = %e, "join refused: no thread to finish it");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::ClusterOptions;

    /// An agent that joins, then answers each request only when told to, heartbeating
    /// meanwhile so that the driver never declares it lost.
    fn fake_agent(addr: SocketAddr, answer: crossbeam_channel::Receiver<AgentReply>) {
        let mut s = TcpStream::connect(addr).unwrap();
        wire::agent_handshake(&mut s, b"tok").unwrap();
        let hello = Hello {
            name: "fake".into(),
            cores: 1,
            pid: 1,
            data: SocketAddr::from(([127, 0, 0, 1], 9)),
        };
        wire::write_frame(&mut s, &hello).unwrap();
        let _: ToAgent = wire::read_frame(&mut s).unwrap();
        s.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
        let mut waiting = Vec::new();
        loop {
            match wire::read_frame_within::<ToAgent>(&mut s, wire::MAX_JOINED_FRAME) {
                Ok(ToAgent::Request { req, .. }) => waiting.push(req),
                Ok(ToAgent::Shutdown) => return,
                Ok(_) => {}
                Err(WireError::Io(e))
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                Err(_) => return,
            }
            if wire::write_frame(&mut s, &ToDriver::Heartbeat).is_err() {
                return;
            }
            // An answer waits for a request to go with it.
            while !waiting.is_empty()
                && let Ok(reply) = answer.try_recv()
            {
                let req = waiting.remove(0);
                let msg = ToDriver::Reply {
                    req,
                    result: Ok(reply),
                };
                wire::write_frame(&mut s, &msg).unwrap();
            }
        }
    }

    #[test]
    fn a_bounded_request_times_out_and_its_late_reply_goes_to_no_one() {
        let driver = ClusterDriver::start(ClusterOptions::new("tok")).unwrap();
        let (answer, answers) = crossbeam_channel::unbounded();
        let addr = driver.addr();
        let agent = std::thread::spawn(move || fake_agent(addr, answers));
        let host = driver.wait_for_hosts(1, Duration::from_secs(10)).unwrap()[0].id;
        let observe = || AgentRequest::Observe {
            actor: 1,
            wait_ms: 0,
        };
        let started = Instant::now();
        let got = driver.request_within(host, observe(), Duration::from_millis(200));
        assert_eq!(
            got,
            Err(RemoteFailure::TimedOut(Duration::from_millis(200)))
        );
        assert!(started.elapsed() < Duration::from_secs(2));
        assert!(driver.state.lock().hosts[0].pending.is_empty());
        // The first request's reply comes late and is dropped; the second gets its own.
        answer.send(AgentReply::Observed(Some(vec![1]))).unwrap();
        answer.send(AgentReply::Observed(Some(vec![2]))).unwrap();
        let got = driver.request_within(host, observe(), Duration::from_secs(10));
        assert_eq!(got, Ok(AgentReply::Observed(Some(vec![2]))));
        assert!(driver.hosts().len() == 1, "the slow host was not lost");
        drop(driver);
        agent.join().unwrap();
    }
}
