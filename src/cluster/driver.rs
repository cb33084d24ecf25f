//! The driver's side of a cluster: it listens, authenticates each joining agent, keeps a table
//! of hosts and a heartbeat with each, and marks a host lost when its connection closes or
//! falls silent past the heartbeat timeout.
use super::wire::{self, Hello, ToAgent, ToDriver, WireError};
use super::{ClusterOptions, HostInfo};
use crate::error::{Error, Result};
use parking_lot::{Condvar, Mutex};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

struct Host {
    info: HostInfo,
    /// The writing side of the connection (heartbeats, shutdown).
    stream: TcpStream,
    lost: Option<String>,
}

struct State {
    hosts: Vec<Host>,
    next_id: u64,
}

pub(crate) struct ClusterDriver {
    addr: SocketAddr,
    opts: ClusterOptions,
    state: Mutex<State>,
    /// Signalled when a host joins or is lost.
    changed: Condvar,
    stop: AtomicBool,
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
        // Polled, so that the accept loop sees `stop` without a connection to wake it.
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::io("setting up the listener", e))?;
        let driver = Arc::new(ClusterDriver {
            addr,
            opts,
            state: Mutex::new(State {
                hosts: Vec::new(),
                next_id: 1,
            }),
            changed: Condvar::new(),
            stop: AtomicBool::new(false),
        });
        let weak = Arc::downgrade(&driver);
        std::thread::Builder::new()
            .name("adag-cluster-accept".into())
            .spawn(move || accept_loop(listener, weak))
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

    /// The hosts that joined and are not lost, in joining order.
    pub(crate) fn hosts(&self) -> Vec<HostInfo> {
        self.state
            .lock()
            .hosts
            .iter()
            .filter(|h| h.lost.is_none())
            .map(|h| h.info.clone())
            .collect()
    }

    pub(crate) fn wait_for_hosts(&self, n: usize, timeout: Duration) -> Result<Vec<HostInfo>> {
        let deadline = Instant::now() + timeout;
        let mut state = self.state.lock();
        loop {
            let live: Vec<HostInfo> = state
                .hosts
                .iter()
                .filter(|h| h.lost.is_none())
                .map(|h| h.info.clone())
                .collect();
            if live.len() >= n {
                return Ok(live);
            }
            if self.changed.wait_until(&mut state, deadline).timed_out() {
                let live = state.hosts.iter().filter(|h| h.lost.is_none()).count();
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

    fn send_heartbeats(&self) {
        let mut lost = Vec::new();
        {
            let mut state = self.state.lock();
            for h in state.hosts.iter_mut().filter(|h| h.lost.is_none()) {
                if let Err(e) = wire::write_frame(&mut h.stream, &ToAgent::Heartbeat) {
                    lost.push((h.info.id, format!("the connection broke: {e}")));
                }
            }
        }
        for (id, why) in lost {
            self.mark_lost(id, why);
        }
    }

    fn mark_lost(&self, id: u64, why: String) {
        let mut state = self.state.lock();
        if let Some(h) = state.hosts.iter_mut().find(|h| h.info.id == id)
            && h.lost.is_none()
        {
            tracing::warn!(host = id, name = %h.info.name, reason = %why, "host lost");
            let _ = h.stream.shutdown(Shutdown::Both);
            h.lost = Some(why);
        }
        drop(state);
        self.changed.notify_all();
    }

    /// Authenticate one connection and add its host.
    fn admit(self: &Arc<Self>, mut stream: TcpStream, peer: SocketAddr) -> Result<(), WireError> {
        stream.set_nodelay(true)?;
        wire::driver_handshake(&mut stream, self.opts.token.as_bytes())?;
        let hello: Hello = wire::read_frame(&mut stream)?;
        let id = {
            let mut state = self.state.lock();
            let id = state.next_id;
            state.next_id += 1;
            let info = HostInfo {
                id,
                name: hello.name,
                address: peer,
                cores: hello.cores,
                pid: hello.pid,
            };
            wire::write_frame(
                &mut stream,
                &ToAgent::Welcome {
                    host: id,
                    interval_ms: self.opts.heartbeat_interval.as_millis() as u64,
                    timeout_ms: self.opts.heartbeat_timeout.as_millis() as u64,
                },
            )?;
            // Writes of heartbeats never block the driver for long on a stuck peer.
            stream.set_write_timeout(Some(self.opts.heartbeat_timeout))?;
            tracing::info!(host = id, name = %info.name, %peer, cores = info.cores, "host joined");
            state.hosts.push(Host {
                info,
                stream: stream.try_clone()?,
                lost: None,
            });
            id
        };
        self.changed.notify_all();
        // Reader: heartbeats keep the host alive; silence past the timeout loses it.
        stream.set_read_timeout(Some(self.opts.heartbeat_timeout))?;
        let weak = Arc::downgrade(self);
        std::thread::Builder::new()
            .name(format!("adag-host-{id}"))
            .spawn(move || {
                let why = loop {
                    match wire::read_frame::<ToDriver>(&mut stream) {
                        Ok(ToDriver::Heartbeat) => {}
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

impl Drop for ClusterDriver {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        let mut state = self.state.lock();
        for h in state.hosts.iter_mut().filter(|h| h.lost.is_none()) {
            let _ = wire::write_frame(&mut h.stream, &ToAgent::Shutdown);
            let _ = h.stream.shutdown(Shutdown::Both);
        }
    }
}

fn accept_loop(listener: TcpListener, driver: std::sync::Weak<ClusterDriver>) {
    loop {
        let Some(d) = driver.upgrade() else { return };
        if d.stop.load(Ordering::Acquire) {
            return;
        }
        match listener.accept() {
            Ok((stream, peer)) => {
                // Each join is checked on a thread of its own, so that a slow or hostile
                // peer never holds up the others (its handshake is bounded in time).
                let d = d.clone();
                let _ = std::thread::Builder::new()
                    .name("adag-cluster-join".into())
                    .spawn(move || {
                        let _ = stream.set_nonblocking(false);
                        if let Err(e) = d.admit(stream, peer) {
                            tracing::warn!(%peer, error = %e, "join refused");
                        }
                    });
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                drop(d);
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => {
                tracing::warn!(error = %e, "accepting a connection failed");
                drop(d);
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}
