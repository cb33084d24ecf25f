//! The agent of a host: the user's own executable started by a cluster launcher with
//! `ADAG_JOIN` and `ADAG_TOKEN` in its environment. It joins the driver and stays until the
//! driver goes (connection closed, or silent past the heartbeat timeout), then exits.
use super::data::DataPlane;
use super::wire::{
    self, AgentReply, AgentRequest, Hello, RemoteFailure, ToAgent, ToDriver, WireError,
};
use super::{ENV_HOST_NAME, ENV_JOIN, ENV_JOIN_TIMEOUT, ENV_TOKEN};
use parking_lot::Mutex;
use std::io;
use std::net::{IpAddr, SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What an agent does for the driver: the runtime's side (workers), behind a trait so that
/// the cluster knows nothing of actors.
pub(crate) trait AgentServices: Send + Sync {
    /// Start a worker for `actor`; its process id.
    fn spawn(&self, actor: u64, name: &str, type_name: &str, init: Vec<u8>) -> Result<u32, String>;
    /// A one-off call; the encoded result.
    fn call(&self, actor: u64, method: &str, args: Vec<u8>) -> Result<Vec<u8>, RemoteFailure>;
    /// Kill the actor's worker at once.
    fn kill(&self, actor: u64) -> Result<(), String>;
    /// Stop the actor's worker (its last handle is gone).
    fn release(&self, actor: u64);
    /// Install this host's part of a graph (`part`: encoded by the runtime); returns once
    /// every actor here installed its schedule.
    fn install(&self, graph: u64, part: Vec<u8>) -> Result<(), String>;
    /// Close a graph's channels on this host; returns once its actors here stopped.
    fn close_graph(&self, graph: u64);
    /// The encoded report of `actor`'s worker, waiting at most `wait` for it; `None` if the
    /// worker is dead, unknown here or silent.
    fn observe(&self, actor: u64, wait: Duration) -> Option<Vec<u8>>;
    /// Stop every worker: the agent is leaving.
    fn shutdown(&self);
}

/// What an agent's services get to work with besides its requests.
pub(crate) struct AgentContext {
    /// Tells the driver that an actor's worker died.
    pub deaths: DeathReporter,
    /// This host's data port (network channels).
    pub data: Arc<DataPlane>,
    /// The driver's address as this host reaches it (a data address of the driver that is
    /// unspecified means this one).
    pub driver_ip: IpAddr,
    /// Carries the output and `tracing` events of this host's workers to the driver.
    pub logs: LogReporter,
}

/// Carries what this host's workers write to the driver, over the agent's connection. Its
/// writes wait at most the heartbeat timeout; callers never call it from an actor's thread
/// (a queue and a forwarding thread stand between), so a slow driver costs lines, never an
/// actor's progress.
#[derive(Clone)]
pub(crate) struct LogReporter {
    link: DriverLink,
    /// This host's name, as the driver lists it (lines are prefixed with it).
    pub host_name: String,
    /// The most verbose `tracing` level the driver lets through.
    pub level: String,
}

impl LogReporter {
    /// Sends lines (`(true, line)`: stderr); false if the driver is gone or the write failed.
    pub(crate) fn lines(&self, lines: Vec<(bool, String)>) -> bool {
        self.link.tell(&ToDriver::Logs { lines })
    }

    /// Sends one encoded `tracing` event of `actor`'s worker.
    pub(crate) fn event(&self, actor: &str, pid: u32, record: Vec<u8>) -> bool {
        self.link.tell(&ToDriver::Event {
            actor: actor.to_string(),
            pid,
            record,
        })
    }
}

/// The writing side of the agent's connection, shared by everything that tells the driver
/// something (one writer at a time, so that frames never interleave; `None` once leaving).
#[derive(Clone)]
struct DriverLink(Arc<Mutex<Option<TcpStream>>>);

impl DriverLink {
    /// Sends `msg`; false if the agent is leaving or the write failed.
    fn tell(&self, msg: &ToDriver) -> bool {
        match self.0.lock().as_mut() {
            Some(stream) => wire::write_frame(stream, msg).is_ok(),
            None => false,
        }
    }
}

/// Tells the driver what happened to the actors of this host (given to the services when they
/// are made): deaths, and schedules that stopped on their own.
#[derive(Clone)]
pub(crate) struct DeathReporter(DriverLink);

impl DeathReporter {
    fn tell(&self, msg: &ToDriver) {
        self.0.tell(msg);
    }

    /// Tells the driver that `actor`'s schedule of `graph` stopped on its own.
    pub(crate) fn graph_fault(&self, graph: u64, actor: &str, reason: &str) {
        self.tell(&ToDriver::GraphFault {
            graph,
            actor: actor.to_string(),
            reason: reason.to_string(),
        });
    }

    /// Tells the driver that `actor`'s worker died.
    pub(crate) fn died(&self, actor: u64, reason: &str) {
        self.tell(&ToDriver::Died {
            actor,
            reason: reason.to_string(),
        });
    }
}

/// Makes the agent's services.
pub(crate) type MakeServices = fn(AgentContext) -> Box<dyn AgentServices>;

/// Where the data port listens (default: the address this host reaches the driver from,
/// any free port).
pub const ENV_DATA_ADDR: &str = "ADAG_DATA_ADDR";
/// Where other hosts reach the data port, when that differs from where it listens (a NAT, a
/// proxy, a Kubernetes Service).
pub const ENV_DATA_ADVERTISE: &str = "ADAG_DATA_ADVERTISE";

fn env_addr(name: &str) -> Result<Option<SocketAddr>, String> {
    match std::env::var(name) {
        Ok(v) if !v.is_empty() => v
            .parse()
            .map(Some)
            .map_err(|e| format!("{name}={v} is not an ip:port address: {e}")),
        _ => Ok(None),
    }
}

/// Exit status of an agent that could not join (wrong secret, no driver, bad address).
pub const EXIT_JOIN_FAILED: i32 = 3;

/// How long an agent keeps trying to reach a driver that is not listening yet (launchers
/// may start hosts before the driver), unless `ADAG_JOIN_TIMEOUT` says: 30 s, an attempt
/// every 0.5 s.
const JOIN_TIMEOUT: Duration = Duration::from_secs(30);
const CONNECT_PAUSE: Duration = Duration::from_millis(500);

/// The join window: `ADAG_JOIN_TIMEOUT` seconds, else [`JOIN_TIMEOUT`].
fn join_timeout() -> Result<Duration, String> {
    match std::env::var(ENV_JOIN_TIMEOUT) {
        Err(_) => Ok(JOIN_TIMEOUT),
        Ok(v) => v
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|s| s.is_finite() && *s >= 0.0 && *s < 1e9)
            .map(Duration::from_secs_f64)
            .ok_or_else(|| format!("{ENV_JOIN_TIMEOUT}={v} is not a number of seconds")),
    }
}

/// If this process was started as a host's agent, run it and exit; otherwise return at once.
pub(crate) fn maybe_run_agent(make: MakeServices) {
    if let Some(code) = run_agent_from_env(make) {
        std::process::exit(code);
    }
}

/// If this process was started as a host's agent (`ADAG_JOIN` is set), run it until the
/// driver leaves and return the process's exit status (0, or [`EXIT_JOIN_FAILED`]);
/// otherwise return `None` at once.
pub(crate) fn run_agent_from_env(make: MakeServices) -> Option<i32> {
    let join = std::env::var(ENV_JOIN).ok()?;
    // Before `main` would: a write to a vanished driver is an error, not a SIGPIPE.
    // SAFETY: SIG_IGN installs no handler code; the Rust runtime does the same before `main`.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
    }
    Some(match run(&join, make) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("adag agent: {e}");
            EXIT_JOIN_FAILED
        }
    })
}

fn host_name() -> String {
    if let Ok(name) = std::env::var(ENV_HOST_NAME)
        && !name.is_empty()
    {
        return name;
    }
    rustix::system::uname()
        .nodename()
        .to_string_lossy()
        .into_owned()
}

/// Connects to the driver at `join`, trying again until `until` while it does not listen (or
/// its name does not resolve yet).
fn connect(join: &str, until: Instant) -> Result<TcpStream, String> {
    let mut last = String::new();
    let mut attempts = 0u32;
    loop {
        attempts += 1;
        // A name that does not resolve yet (a Kubernetes Service before its pod) is retried
        // like a driver that does not listen yet.
        match join.to_socket_addrs() {
            Ok(addrs) => {
                for addr in addrs {
                    match TcpStream::connect_timeout(&addr, wire::HANDSHAKE_TIMEOUT) {
                        Ok(s) => return Ok(s),
                        Err(e) => last = format!("{addr}: {e}"),
                    }
                }
            }
            Err(e)
                if join
                    .rsplit_once(':')
                    .is_some_and(|(_, p)| p.parse::<u16>().is_ok()) =>
            {
                last = format!("{join} does not resolve: {e}");
            }
            Err(e) => {
                return Err(format!(
                    "{ENV_JOIN}={join} is not an address (host:port): {e}"
                ));
            }
        }
        if Instant::now() + CONNECT_PAUSE > until {
            break;
        }
        std::thread::sleep(CONNECT_PAUSE);
    }
    Err(format!(
        "cannot reach the driver at {join} after {attempts} attempts ({last}); is the driver listening there? ({ENV_JOIN_TIMEOUT} sets how long to keep trying)"
    ))
}

/// Whether a join's handshake failed because the driver's port dropped the connection before
/// answering (it drops the oldest unproven connection when strangers fill its room, and any
/// that is slow to prove itself): worth another try. A wrong secret or another protocol
/// version is not.
fn dropped_by_the_port(e: &WireError) -> bool {
    matches!(e, WireError::Io(err) if matches!(
        err.kind(),
        io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::WouldBlock
            | io::ErrorKind::TimedOut
    ))
}

/// Connects and proves this host knows the secret, within the join window: a connection the
/// driver's port dropped unanswered is tried again (said once on stderr), with growing pauses.
fn join_driver(join: &str, token: &str) -> Result<TcpStream, String> {
    let window = join_timeout()?;
    let started = Instant::now();
    let until = started + window;
    let mut pause = Duration::from_millis(20);
    let mut dropped = 0u32;
    loop {
        let mut stream = connect(join, until)?;
        stream.set_nodelay(true).map_err(|e| e.to_string())?;
        match wire::agent_handshake(&mut stream, token.as_bytes()) {
            Ok(()) => return Ok(stream),
            Err(e) if dropped_by_the_port(&e) => {
                let e = match &e {
                    WireError::Io(err) if err.kind() == io::ErrorKind::UnexpectedEof => {
                        "it closed the connection".to_string()
                    }
                    other => other.to_string(),
                };
                dropped += 1;
                if dropped == 1 {
                    eprintln!(
                        "adag agent: the driver at {join} dropped the join before answering ({e}); its listen port drops unproven connections when many are held open: trying again for up to {window:?} ({ENV_JOIN_TIMEOUT})"
                    );
                }
                if Instant::now() + pause >= until {
                    return Err(format!(
                        "joining {join}: the driver's port dropped every attempt before answering ({dropped} attempts over {:.1?}; the last: {e}); is its listen port flooded with connections from elsewhere? ({ENV_JOIN_TIMEOUT} sets how long to keep trying)",
                        started.elapsed()
                    ));
                }
                std::thread::sleep(pause);
                pause = (pause * 2).min(CONNECT_PAUSE);
            }
            Err(e) => return Err(format!("joining {join}: {e}")),
        }
    }
}

fn run(join: &str, make: MakeServices) -> Result<(), String> {
    let token = std::env::var(ENV_TOKEN)
        .ok()
        .filter(|t| !t.is_empty())
        .ok_or_else(|| format!("{ENV_JOIN} is set but {ENV_TOKEN} is not: set the driver's shared secret in {ENV_TOKEN}"))?;
    let mut stream = join_driver(join, &token)?;
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let local_ip = stream.local_addr().map_err(|e| e.to_string())?.ip();
    let driver_ip = stream.peer_addr().map_err(|e| e.to_string())?.ip();
    let bind = env_addr(ENV_DATA_ADDR)?.unwrap_or(SocketAddr::new(local_ip, 0));
    let data = DataPlane::start(bind, token.as_bytes()).map_err(|e| {
        format!("cannot listen for data connections on {bind} ({ENV_DATA_ADDR}): {e}")
    })?;
    let advertised = env_addr(ENV_DATA_ADVERTISE)?.unwrap_or(data.addr());
    let name = host_name();
    wire::write_frame(
        &mut stream,
        &Hello {
            name: name.clone(),
            cores,
            pid: std::process::id(),
            data: advertised,
        },
    )
    .map_err(|e| format!("joining {join}: {e}"))?;
    let (host, interval, timeout, log_level) = match wire::read_frame::<ToAgent>(&mut stream) {
        Ok(ToAgent::Welcome {
            host,
            interval_ms,
            timeout_ms,
            log_level,
        }) => (
            host,
            Duration::from_millis(interval_ms.max(1)),
            Duration::from_millis(timeout_ms.max(1)),
            log_level,
        ),
        Ok(ToAgent::Refused { reason }) => return Err(format!("the driver refused: {reason}")),
        Ok(other) => return Err(format!("the driver answered {other:?} to a join")),
        Err(e) => return Err(format!("joining {join}: {e}")),
    };
    let _ = stream.set_write_timeout(Some(timeout));
    let writer = Arc::new(Mutex::new(Some(
        stream.try_clone().map_err(|e| e.to_string())?,
    )));
    let services: Arc<dyn AgentServices> = Arc::from(make(AgentContext {
        deaths: DeathReporter(DriverLink(writer.clone())),
        data: data.clone(),
        driver_ip,
        logs: LogReporter {
            link: DriverLink(writer.clone()),
            host_name: name,
            level: log_level,
        },
    }));
    serve(stream, &writer, &services, host, interval, timeout);
    // Leaving: waits for connections end first (an install waiting for one returns at once),
    // then every worker started here goes too, and nothing more is written.
    data.stop();
    services.shutdown();
    writer.lock().take();
    Ok(())
}

/// Serves the driver's requests, with heartbeats both ways, until the driver goes.
fn serve(
    mut stream: TcpStream,
    writer: &Arc<Mutex<Option<TcpStream>>>,
    services: &Arc<dyn AgentServices>,
    host: u64,
    interval: Duration,
    timeout: Duration,
) {
    let _ = stream.set_read_timeout(Some(timeout));
    let beat = writer.clone();
    std::thread::Builder::new()
        .name("adag-agent-heartbeat".into())
        .spawn(move || {
            loop {
                let sent = match beat.lock().as_mut() {
                    Some(s) => wire::write_frame(s, &ToDriver::Heartbeat).is_ok(),
                    None => false,
                };
                if !sent {
                    break;
                }
                std::thread::sleep(interval);
            }
        })
        .ok();
    let started = Instant::now();
    loop {
        match wire::read_frame_within::<ToAgent>(&mut stream, wire::MAX_JOINED_FRAME) {
            Ok(ToAgent::Heartbeat { driver_ns }) => {
                if let Some(s) = writer.lock().as_mut() {
                    let agent_ns = crate::clock::mono_ns();
                    let _ = wire::write_frame(
                        s,
                        &ToDriver::Clock {
                            driver_ns,
                            agent_ns,
                        },
                    );
                }
            }
            Ok(ToAgent::Shutdown) => return,
            Ok(ToAgent::Request { req, request }) => {
                // Each request on a thread of its own: a long call never holds up the
                // heartbeats or the other actors' requests.
                let services = services.clone();
                let replies = writer.clone();
                let spawned = std::thread::Builder::new()
                    .name(format!("adag-agent-req-{req}"))
                    .spawn(move || {
                        let result = handle(&*services, request);
                        if let Some(s) = replies.lock().as_mut() {
                            let _ = wire::write_frame(s, &ToDriver::Reply { req, result });
                        }
                    });
                if let Err(e) = spawned
                    && let Some(s) = writer.lock().as_mut()
                {
                    let _ = wire::write_frame(
                        s,
                        &ToDriver::Reply {
                            req,
                            result: Err(RemoteFailure::Spawn(format!(
                                "the agent cannot start a thread: {e}"
                            ))),
                        },
                    );
                }
            }
            Ok(other) => {
                eprintln!("adag agent (host {host}): unexpected {other:?}; ignored");
            }
            Err(WireError::Io(e))
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                eprintln!(
                    "adag agent (host {host}): the driver sent nothing for {timeout:?} (up {:?}); leaving",
                    started.elapsed()
                );
                return;
            }
            Err(_) => return,
        }
    }
}

fn handle(
    services: &dyn AgentServices,
    request: AgentRequest,
) -> Result<AgentReply, RemoteFailure> {
    match request {
        AgentRequest::Spawn {
            actor,
            name,
            type_name,
            init,
        } => services
            .spawn(actor, &name, &type_name, init)
            .map(|pid| AgentReply::Spawned { pid })
            .map_err(RemoteFailure::Spawn),
        AgentRequest::Call {
            actor,
            method,
            args,
        } => services
            .call(actor, &method, args)
            .map(AgentReply::Returned),
        AgentRequest::Kill { actor } => services
            .kill(actor)
            .map(|()| AgentReply::Done)
            .map_err(RemoteFailure::Died),
        AgentRequest::Release { actor } => {
            services.release(actor);
            Ok(AgentReply::Done)
        }
        AgentRequest::Install { graph, part } => services
            .install(graph, part)
            .map(|()| AgentReply::Done)
            .map_err(RemoteFailure::Spawn),
        AgentRequest::CloseGraph { graph } => {
            services.close_graph(graph);
            Ok(AgentReply::Done)
        }
        AgentRequest::Observe { actor, wait_ms } => Ok(AgentReply::Observed(
            services.observe(actor, Duration::from_millis(wait_ms)),
        )),
    }
}
