//! Worker processes: the same executable started again in worker mode, hosting one actor
//! each, controlled over a private socket.
//!
//! The driver spawns every worker from one long-lived thread, because `PR_SET_PDEATHSIG`
//! fires when the *thread* that forked the child exits: so workers die with the driver
//! process, not with whichever thread happened to spawn them. A monitor thread per worker
//! waits for the child to exit, reaps it at once (no zombie) and tears down its graph.
use super::call::{
    BUSY_AFTER, CallClaim, CallFailure, Calls, call_failure, decode_result, encode_args,
};
use super::channels::GraphChannels;
use super::host::{Control, RunRequest, host_loop};
use super::observe::{EdgeCounters, Observation, Recorder};
use super::registry;
use super::wire::{self, FromWorker, ToWorker, WireFailure};
use crate::channel::wait::DEFAULT_SPIN;
use crate::compile::plan::{GraphPlan, Loc};
use crate::error::{Error, Result};
use crate::value::Value;
use crossbeam_channel::Sender;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// The fd number of the control socket in a worker.
const WORKER_FD: i32 = 100;
const ENV_FD: &str = "ADAG_WORKER_FD";
const ENV_PARENT: &str = "ADAG_WORKER_PARENT";
const ENV_NAME: &str = "ADAG_WORKER_NAME";
/// Set to `explicit` in workers started by a command of [`set_worker_command`]: the start-up
/// hook leaves them alone, and the program enters the worker by calling [`crate::init`].
const ENV_ENTRY: &str = "ADAG_WORKER_ENTRY";

/// The program and arguments that start a worker process, when not this executable.
static WORKER_COMMAND: Mutex<Option<(std::path::PathBuf, Vec<String>)>> = Mutex::new(None);

/// Start worker processes with `program args..` instead of this executable run again.
///
/// For hosts whose executable does not reach adag before `main` (an interpreter that loads
/// adag as a library, such as the Python package): the command must load the same adag build
/// and call [`crate::init`], which runs the worker and never returns. The start-up hook does
/// not turn such a worker into one by itself (it is told so by the `ADAG_WORKER_ENTRY`
/// variable), since it would run the worker inside the library's loading. Applies to the
/// workers of this process's runtimes spawned afterwards; `None` restores the default. (Hosts
/// that join a cluster still start their workers from their own executable.)
pub fn set_worker_command(command: Option<(std::path::PathBuf, Vec<String>)>) {
    *WORKER_COMMAND.lock() = command;
}

/// Called when a worker process dies; implemented by live graphs.
pub(crate) trait DeathSink: Send + Sync {
    fn actor_died(&self, actor: &str, reason: &str);
}

/// Live graphs by id, so that a worker's death reaches the graph it serves.
pub(crate) fn graphs() -> &'static Mutex<HashMap<u64, std::sync::Weak<dyn DeathSink>>> {
    static GRAPHS: OnceLock<Mutex<HashMap<u64, std::sync::Weak<dyn DeathSink>>>> = OnceLock::new();
    GRAPHS.get_or_init(Default::default)
}

type CallReply = Result<Vec<u8>, WireFailure>;

#[derive(Default)]
struct GraphSlots {
    installed: Option<Sender<Result<(), String>>>,
    done: Option<Sender<String>>,
}

struct LinkShared {
    name: String,
    sock: OwnedFd,
    send_lock: Mutex<()>,
    pending_call: Mutex<Option<Sender<CallReply>>>,
    spawned: Mutex<Option<Sender<Result<(), String>>>>,
    graph: Mutex<GraphSlots>,
    pending_observe: Mutex<Option<Sender<Observation>>>,
    dead: Mutex<Option<String>>,
    live_graph: Arc<Mutex<Option<u64>>>,
}

impl LinkShared {
    fn send(&self, msg: &ToWorker, fds: &[BorrowedFd<'_>]) -> std::io::Result<()> {
        let _guard = self.send_lock.lock();
        wire::send(self.sock.as_fd(), msg, fds)
    }

    fn died(&self) -> Option<Error> {
        self.dead.lock().clone().map(|reason| Error::ActorDied {
            actor: self.name.clone(),
            reason,
        })
    }

    /// Everything waiting on this worker learns that it is gone.
    fn fail_waiters(&self) {
        self.pending_call.lock().take();
        self.spawned.lock().take();
        self.pending_observe.lock().take();
        let mut g = self.graph.lock();
        g.installed.take();
        g.done.take();
    }
}

/// The driver's link to one worker process.
pub(crate) struct ProcessLink {
    pid: u32,
    shared: Arc<LinkShared>,
    call_lock: Mutex<()>,
    observe_lock: Mutex<()>,
    exited: crossbeam_channel::Receiver<()>,
    /// Lines of its stdout and stderr dropped because the driver's output was too slow.
    log_dropped: Arc<std::sync::atomic::AtomicU64>,
}

type SpawnJob = Box<dyn FnOnce() + Send>;

/// The one thread that forks every worker (see the module doc).
fn spawner() -> &'static Sender<SpawnJob> {
    static SPAWNER: OnceLock<Sender<SpawnJob>> = OnceLock::new();
    SPAWNER.get_or_init(|| {
        let (tx, rx) = crossbeam_channel::unbounded::<SpawnJob>();
        std::thread::Builder::new()
            .name("adag-spawner".into())
            .spawn(move || {
                while let Ok(job) = rx.recv() {
                    job();
                }
            })
            .expect("cannot start the adag spawner thread");
        tx
    })
}

fn exit_reason(status: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("its process exited with status {code}"),
        (_, Some(sig)) => format!("its process was killed by signal {sig}"),
        _ => "its process ended".into(),
    }
}

fn spawn_child(name: &str, child_sock: OwnedFd) -> std::io::Result<Child> {
    let mut cmd = match WORKER_COMMAND.lock().clone() {
        Some((program, args)) => {
            let mut cmd = Command::new(program);
            cmd.args(args).env(ENV_ENTRY, "explicit");
            cmd
        }
        None => {
            let mut cmd = Command::new(std::env::current_exe()?);
            cmd.env_remove(ENV_ENTRY);
            cmd
        }
    };
    // A worker is no driver: a launcher's ADAG_LISTEN is not for it.
    cmd.env_remove(crate::cluster::ENV_LISTEN)
        .env(ENV_FD, WORKER_FD.to_string())
        .env(ENV_PARENT, std::process::id().to_string())
        .env(ENV_NAME, name)
        .stdin(std::process::Stdio::null())
        // Drained by the driver and prefixed with the actor (`logs.rs`); the user's
        // RUST_BACKTRACE, like the rest of the environment, is inherited as it is.
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let raw = child_sock.as_raw_fd();
    let parent = std::process::id() as i32;
    // SAFETY: the closure runs in the child between fork and exec, where only
    // async-signal-safe functions may be called: dup2, fcntl, prctl, getppid and _exit are.
    // It allocates nothing and touches no lock.
    unsafe {
        cmd.pre_exec(move || {
            if raw == WORKER_FD {
                if libc::fcntl(raw, libc::F_SETFD, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            } else if libc::dup2(raw, WORKER_FD) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() != parent {
                libc::_exit(1);
            }
            Ok(())
        });
    }
    let child = cmd.spawn();
    drop(child_sock);
    child
}

impl ProcessLink {
    pub(crate) fn spawn(
        id: u64,
        name: &str,
        type_name: &str,
        init: Vec<u8>,
        live_graph: Arc<Mutex<Option<u64>>>,
    ) -> Result<Self> {
        let spawn_err = |message: String| Error::Spawn {
            actor: name.to_string(),
            message,
        };
        let (sock, child_sock) =
            wire::socket_pair().map_err(|e| spawn_err(format!("socketpair: {e}")))?;
        let (events, child_events) =
            super::logs::event_socket().map_err(|e| spawn_err(format!("socketpair: {e}")))?;
        let (tx, rx) = crossbeam_channel::bounded(1);
        let child_name = name.to_string();
        spawner()
            .send(Box::new(move || {
                let _ = tx.send(spawn_child(&child_name, child_sock));
            }))
            .map_err(|_| spawn_err("the spawner thread stopped".into()))?;
        let mut child = rx
            .recv()
            .map_err(|_| spawn_err("the spawner thread stopped".into()))?
            .map_err(|e| spawn_err(format!("cannot start the worker process: {e}")))?;
        let pid = child.id();
        let forwarded = super::logs::forward(
            name,
            pid,
            child.stdout.take().map(OwnedFd::from),
            child.stderr.take().map(OwnedFd::from),
            events,
        );
        let (log_dropped, log_stop) = match forwarded {
            Ok(f) => f,
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(spawn_err(format!(
                    "cannot forward the worker's output: {e}"
                )));
            }
        };
        let (spawned_tx, spawned_rx) = crossbeam_channel::bounded(1);
        let shared = Arc::new(LinkShared {
            name: name.to_string(),
            sock,
            send_lock: Mutex::new(()),
            pending_call: Mutex::new(None),
            spawned: Mutex::new(Some(spawned_tx)),
            graph: Mutex::new(GraphSlots::default()),
            pending_observe: Mutex::new(None),
            dead: Mutex::new(None),
            live_graph,
        });
        let (exited_tx, exited) = crossbeam_channel::bounded::<()>(1);
        let (reader_done_tx, reader_done) = crossbeam_channel::bounded::<()>(1);
        // Monitor: reap the child the moment it exits and tell whoever waits on it.
        let monitor = shared.clone();
        std::thread::Builder::new()
            .name(format!("adag-monitor-{name}"))
            .spawn(move || {
                let reason = child
                    .wait()
                    .map_or_else(|e| format!("waiting for it failed: {e}"), exit_reason);
                // Its log forwarders pass on what is left and end.
                drop(log_stop);
                *monitor.dead.lock() = Some(reason.clone());
                let graph = *monitor.live_graph.lock();
                if graph.is_some() {
                    tracing::warn!(actor = %monitor.name, pid, %reason, graph, "worker process died");
                } else {
                    tracing::debug!(actor = %monitor.name, pid, %reason, "worker process ended");
                }
                // Replies the worker sent just before it exited are delivered first: the
                // reader reaches the end of the socket at once, since the worker's end is
                // closed with it (bounded, in case a grandchild inherited that end).
                let _ = reader_done.recv_timeout(Duration::from_millis(200));
                monitor.fail_waiters();
                // Reaped: said before the graph is told, because telling it may drop the last
                // handle of this very worker here, whose `Drop` waits for this. Said by
                // disconnecting, so that every wait on it, then and later, returns at once.
                drop(exited_tx);
                let graph = *monitor.live_graph.lock();
                if let Some(g) = graph {
                    let sink = graphs().lock().get(&g).and_then(|w| w.upgrade());
                    if let Some(sink) = sink {
                        sink.actor_died(&monitor.name, &reason);
                    }
                }
            })
            .map_err(|e| spawn_err(format!("cannot start the monitor thread: {e}")))?;
        // Reader: route the worker's replies.
        let reader = shared.clone();
        std::thread::Builder::new()
            .name(format!("adag-link-{name}"))
            .spawn(move || {
                read_replies(&reader);
                drop(reader_done_tx);
            })
            .map_err(|e| spawn_err(format!("cannot start the reader thread: {e}")))?;
        let link = ProcessLink {
            pid,
            shared,
            call_lock: Mutex::new(()),
            observe_lock: Mutex::new(()),
            exited,
            log_dropped,
        };
        link.shared
            .send(
                &ToWorker::Spawn {
                    id,
                    name: name.to_string(),
                    type_name: type_name.to_string(),
                    init,
                    log_level: super::logs::driver_level(),
                },
                &[child_events.as_fd()],
            )
            .map_err(|e| spawn_err(format!("cannot reach the worker: {e}")))?;
        drop(child_events);
        match spawned_rx.recv_timeout(Duration::from_secs(60)) {
            Ok(Ok(())) => Ok(link),
            Ok(Err(message)) => Err(spawn_err(message)),
            Err(_) => Err(spawn_err(match link.shared.dead.lock().clone() {
                Some(reason) => format!("the worker died while starting: {reason}"),
                None => "the worker did not start within 60 s".into(),
            })),
        }
    }

    pub(crate) fn call<Args: Value, R: Value>(
        &self,
        actor: &str,
        method: &str,
        args: Args,
    ) -> Result<R> {
        let args = encode_args(actor, method, &args)?;
        let bytes = self
            .call_bytes(method, args)?
            .map_err(|f| call_failure(actor, method, f))?;
        decode_result(
            actor,
            method,
            &bytes,
            "the worker's method returns another type (a stale worker binary?)",
        )
    }

    /// A one-off call with encoded arguments: the encoded result, or why the method failed
    /// (`Err` of the outer result: the worker could not be reached or died).
    pub(crate) fn call_bytes(
        &self,
        method: &str,
        args: Vec<u8>,
    ) -> Result<std::result::Result<Vec<u8>, CallFailure>> {
        let actor = &self.shared.name;
        let call_err = |message: String| Error::Call {
            actor: actor.to_string(),
            method: method.to_string(),
            message,
        };
        let _one_at_a_time = self.call_lock.lock();
        if let Some(dead) = self.shared.died() {
            return Err(dead);
        }
        let (tx, rx) = crossbeam_channel::bounded(1);
        *self.shared.pending_call.lock() = Some(tx);
        self.shared
            .send(
                &ToWorker::Call {
                    method: method.to_string(),
                    args,
                },
                &[],
            )
            .map_err(|e| {
                // A broken pipe is a worker that is gone (or going): report its death once the
                // monitor has reaped it, not the pipe.
                self.death_within(Duration::from_secs(2))
                    .unwrap_or_else(|| call_err(format!("cannot reach the worker: {e}")))
            })?;
        let reply = match rx.recv() {
            Ok(r) => r,
            Err(_) => {
                // The monitor dropped the sender: the worker is gone. Give it a moment to
                // record why.
                let _ = self.exited.recv_timeout(Duration::from_millis(500));
                return Err(self
                    .shared
                    .died()
                    .unwrap_or_else(|| call_err("the worker stopped answering".into())));
            }
        };
        Ok(reply.map_err(|f| match f {
            WireFailure::NoSuchMethod => CallFailure::NoSuchMethod,
            WireFailure::BadArgs(m) => CallFailure::BadArgs(m),
            WireFailure::Task(m) => CallFailure::Task(m),
            WireFailure::Busy => CallFailure::Busy,
        }))
    }

    /// Ready (or disconnected) once the worker has exited and was reaped.
    pub(crate) fn exit_signal(&self) -> crossbeam_channel::Receiver<()> {
        self.exited.clone()
    }

    /// Send this actor its part of a graph; `installed` and `done` are answered by the worker.
    // One argument per thing the worker needs; a struct for one caller would only rename them.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn install(
        &self,
        actor: u64,
        plan: Arc<GraphPlan>,
        chans: &GraphChannels,
        installed: Sender<Result<(), String>>,
        done: Sender<String>,
        comms: (Vec<super::wire::CommTicket>, Vec<BorrowedFd<'_>>),
        timeline: bool,
    ) -> Result<()> {
        if let Some(dead) = self.shared.died() {
            return Err(dead);
        }
        if !comms.0.is_empty() {
            // The communicator ranks go first, in a message of their own (see `InstallComms`).
            self.shared
                .send(&ToWorker::InstallComms { comms: comms.0 }, &comms.1)
                .map_err(|e| {
                    Error::io(
                        format!("sending the communicators to {}", self.shared.name),
                        e,
                    )
                })?;
        }
        let handed = chans.handed_to(&plan, Loc::Actor(actor))?;
        {
            let mut g = self.shared.graph.lock();
            g.installed = Some(installed);
            g.done = Some(done);
        }
        let fds: Vec<BorrowedFd<'_>> = handed.fds.iter().map(|f| f.as_fd()).collect();
        self.shared
            .send(
                &ToWorker::Install {
                    plan: (*plan).clone(),
                    chans: handed.shm.clone(),
                    net: handed.net.clone(),
                    max_message_bytes: chans.max_message_bytes() as u64,
                    timeline,
                },
                &fds,
            )
            .map_err(|e| {
                self.death_within(Duration::from_millis(500))
                    .unwrap_or_else(|| {
                        Error::io(format!("sending the schedule to {}", self.shared.name), e)
                    })
            })
    }

    /// SIGKILL the worker and wait (up to 5 s) until its monitor has reaped it, so that once
    /// this returns every call to the actor answers `ActorDied` (never a broken pipe).
    pub(crate) fn kill(&self) -> Result<()> {
        if self.shared.dead.lock().is_some() {
            return Ok(());
        }
        // The monitor has not reaped the child yet, so the pid still names it.
        let pid =
            rustix::process::Pid::from_raw(self.pid as i32).expect("a child's pid is positive");
        rustix::process::kill_process(pid, rustix::process::Signal::KILL).map_err(|e| {
            Error::io(
                format!("killing worker {} (pid {})", self.shared.name, self.pid),
                e,
            )
        })?;
        let _ = self.exited.recv_timeout(Duration::from_secs(5));
        Ok(())
    }

    pub(crate) fn pid(&self) -> u32 {
        self.pid
    }

    /// Lines of the worker's output dropped because the driver's output was too slow.
    pub(crate) fn log_lines_dropped(&self) -> u64 {
        self.log_dropped.load(Ordering::Relaxed)
    }

    /// The worker's counters and timeline of its current (or last) graph; `None` if it is
    /// dead or does not answer within `wait`.
    pub(crate) fn observe(&self, wait: Duration) -> Option<Observation> {
        let _one_at_a_time = self.observe_lock.lock();
        if self.is_dead() {
            return None;
        }
        let (tx, rx) = crossbeam_channel::bounded(1);
        *self.shared.pending_observe.lock() = Some(tx);
        self.shared.send(&ToWorker::Observe, &[]).ok()?;
        let got = rx.recv_timeout(wait).ok();
        self.shared.pending_observe.lock().take();
        got
    }

    /// Why the worker died, waiting up to `wait` for its monitor to record it: a broken link
    /// is often noticed before the monitor has reaped the process.
    pub(crate) fn death_within(&self, wait: Duration) -> Option<Error> {
        if self.shared.died().is_none() {
            let _ = self.exited.recv_timeout(wait);
        }
        self.shared.died()
    }

    pub(crate) fn is_dead(&self) -> bool {
        self.shared.dead.lock().is_some()
    }
}

impl Drop for ProcessLink {
    fn drop(&mut self) {
        if self.is_dead() {
            return; // already reaped by its monitor
        }
        // Ask the worker to leave, then make sure it did: no process outlives its handles.
        let _ = self.shared.send(&ToWorker::Shutdown, &[]);
        if let Err(crossbeam_channel::RecvTimeoutError::Timeout) =
            self.exited.recv_timeout(Duration::from_secs(2))
        {
            let _ = self.kill();
        }
    }
}

fn read_replies(link: &LinkShared) {
    loop {
        let msg = match wire::recv::<FromWorker>(link.sock.as_fd()) {
            Ok(Some((msg, _))) => msg,
            Ok(None) | Err(_) => return,
        };
        match msg {
            FromWorker::Spawned(r) => {
                if let Some(tx) = link.spawned.lock().take() {
                    let _ = tx.send(r);
                }
            }
            FromWorker::CallResult(r) => {
                if let Some(tx) = link.pending_call.lock().take() {
                    let _ = tx.send(r);
                }
            }
            FromWorker::Installed(r) => {
                if let Some(tx) = link.graph.lock().installed.take() {
                    let _ = tx.send(r);
                }
            }
            FromWorker::GraphDone(why) => {
                if let Some(tx) = link.graph.lock().done.take() {
                    let _ = tx.send(why);
                }
            }
            FromWorker::Observed(o) => {
                if let Some(tx) = link.pending_observe.lock().take() {
                    let _ = tx.send(o);
                }
            }
        }
    }
}

/// If this process was started as a worker, run it and exit; otherwise return at once.
/// Workers started by a [`set_worker_command`] command are left to [`maybe_run_worker_explicit`].
pub(crate) fn maybe_run_worker() {
    if std::env::var_os(ENV_ENTRY).is_some_and(|v| v == "explicit") {
        return;
    }
    maybe_run_worker_explicit();
}

/// [`maybe_run_worker`] for every worker, those started by a [`set_worker_command`] command
/// included (what [`crate::init`] calls).
pub(crate) fn maybe_run_worker_explicit() {
    static STARTED: AtomicBool = AtomicBool::new(false);
    let (Ok(fd), Ok(parent)) = (std::env::var(ENV_FD), std::env::var(ENV_PARENT)) else {
        return;
    };
    // A process started by a worker inherits its environment; only the driver's own child
    // is a worker.
    if parent
        != rustix::process::getppid()
            .map_or(0, |p| p.as_raw_nonzero().get())
            .to_string()
    {
        return;
    }
    if fd != WORKER_FD.to_string() || STARTED.swap(true, Ordering::SeqCst) {
        return;
    }
    ignore_sigpipe();
    // SAFETY: fd WORKER_FD was placed in this process by the driver's pre_exec (dup2) for
    // exactly this purpose; nothing else in the process owns or closes it.
    let sock = unsafe { OwnedFd::from_raw_fd(WORKER_FD) };
    // The fd crossed exec without FD_CLOEXEC; set it again, so that processes the actor
    // launches do not inherit the control socket (one would keep the driver's link to this
    // worker open after the worker is gone).
    let _ = rustix::io::fcntl_setfd(&sock, rustix::io::FdFlags::CLOEXEC);
    let code = worker_main(sock);
    std::process::exit(code);
}

fn worker_main(sock: OwnedFd) -> i32 {
    keep_freed_memory();
    let sock = Arc::new(sock);
    let send_lock = Arc::new(Mutex::new(()));
    let send = {
        let sock = sock.clone();
        let lock = send_lock.clone();
        move |msg: &FromWorker| {
            let _g = lock.lock();
            let _ = wire::send(sock.as_fd(), msg, &[]);
        }
    };
    let Ok(Some((
        ToWorker::Spawn {
            id,
            name,
            type_name,
            init,
            log_level,
        },
        fds,
    ))) = wire::recv::<ToWorker>(sock.as_fd())
    else {
        return 2;
    };
    // Before the actor is built: events of its `new` reach the driver too.
    if let Some(events) = fds.into_iter().next() {
        super::logs::init_worker(events, &log_level);
    }
    let (control, rx) = crossbeam_channel::unbounded::<Control>();
    // One-off calls queued for the actor's thread, which may be running a graph's schedule.
    let waiting = Arc::new(Calls::default());
    let waiting_host = waiting.clone();
    let (ready_tx, ready_rx) = crossbeam_channel::bounded(1);
    let host_name = name.clone();
    let spawned = std::thread::Builder::new().name(format!("adag-{name}")).spawn(move || {
        let built = match registry::lookup(&type_name) {
            None => Err(format!(
                "actor type {type_name} is not registered in this executable; is its #[actor] impl linked in?"
            )),
            Some(entry) => std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (entry.build)(&init, id, host_name)))
                .unwrap_or_else(|p| Err(super::method::panic_text(p))),
        };
        match built {
            Ok(host) => {
                let _ = ready_tx.send(Ok(()));
                host_loop(host, rx, waiting_host);
            }
            Err(e) => {
                let _ = ready_tx.send(Err(e));
            }
        }
    });
    if spawned.is_err() {
        send(&FromWorker::Spawned(Err(
            "cannot start the actor thread".into()
        )));
        return 3;
    }
    let ready = ready_rx
        .recv()
        .unwrap_or_else(|_| Err("the actor thread stopped".into()));
    let ok = ready.is_ok();
    send(&FromWorker::Spawned(
        ready.map_err(|e| format!("new() failed: {e}")),
    ));
    if !ok {
        return 4;
    }
    // What the current (or last) graph's loop records, and its channels' counters.
    // (Only the counters are kept, not the channels: their memory goes with the graph.)
    let mut observed: (Recorder, Option<EdgeCounters>) = (Recorder::default(), None);
    // The communicators of the next `Install`.
    let mut comms: Result<super::comm_ops::CommMap, String> = Ok(HashMap::new());
    loop {
        let (msg, fds) = match wire::recv::<ToWorker>(sock.as_fd()) {
            Ok(Some(m)) => m,
            // The driver is gone or spoke nonsense: leave.
            Ok(None) | Err(_) => return 0,
        };
        match msg {
            ToWorker::Spawn { .. } => return 5,
            ToWorker::Shutdown => return 0,
            ToWorker::Observe => {
                send(&FromWorker::Observed(
                    observed.0.observe(observed.1.as_ref()),
                ));
            }
            ToWorker::Call { method, args } => {
                let (reply, reply_rx) = crossbeam_channel::bounded(1);
                let claim = Arc::new(CallClaim::default());
                waiting.queued();
                if control
                    .send(Control::CallEncoded {
                        method,
                        args,
                        reply,
                        claim: claim.clone(),
                    })
                    .is_err()
                {
                    return 6;
                }
                // Served at once, or between two executions of a graph's schedule; withdrawn
                // when the actor is stuck inside a method (see `call::BUSY_AFTER`).
                let reply = match reply_rx.recv_timeout(BUSY_AFTER) {
                    Err(crossbeam_channel::RecvTimeoutError::Timeout) if claim.cancel() => {
                        Ok(Err(CallFailure::Busy))
                    }
                    Err(crossbeam_channel::RecvTimeoutError::Timeout) => reply_rx.recv(),
                    Ok(r) => Ok(r),
                    Err(crossbeam_channel::RecvTimeoutError::Disconnected) => return 6,
                };
                let result = match reply {
                    Ok(r) => r.map_err(|f| match f {
                        CallFailure::NoSuchMethod => WireFailure::NoSuchMethod,
                        CallFailure::BadArgs(m) => WireFailure::BadArgs(m),
                        CallFailure::Task(m) => WireFailure::Task(m),
                        CallFailure::Busy => WireFailure::Busy,
                    }),
                    Err(_) => return 6,
                };
                send(&FromWorker::CallResult(result));
            }
            ToWorker::InstallComms { comms: tickets } => {
                comms = super::comm_ops::open_tickets(tickets, fds);
            }
            ToWorker::Install {
                plan,
                chans,
                net,
                max_message_bytes,
                timeline,
            } => {
                let comms = std::mem::replace(&mut comms, Ok(HashMap::new()));
                let opened = comms.and_then(|comms| {
                    GraphChannels::open(&chans, &net, fds, DEFAULT_SPIN, max_message_bytes as usize)
                        .map(|chans| (comms, chans))
                });
                let (comms, graph_chans) = match opened {
                    Ok(opened) => opened,
                    Err(e) => {
                        send(&FromWorker::Installed(Err(e)));
                        send(&FromWorker::GraphDone("install failed".into()));
                        continue;
                    }
                };
                let (installed, installed_rx) = crossbeam_channel::bounded(1);
                let (done, done_rx) = crossbeam_channel::bounded(1);
                let recorder = Recorder::new(timeline);
                let graph_chans = Arc::new(graph_chans);
                let ends = graph_chans.clone();
                observed = (recorder.clone(), Some(graph_chans.counters()));
                let request = RunRequest {
                    plan: Arc::new(plan),
                    chans: graph_chans,
                    comms,
                    installed,
                    done,
                    recorder,
                };
                if control.send(Control::Run(request)).is_err() {
                    return 6;
                }
                let send = send.clone();
                let _ = std::thread::Builder::new()
                    .name("adag-graph-events".into())
                    .spawn(move || {
                        let r = installed_rx
                            .recv()
                            .unwrap_or_else(|_| Err("the actor thread stopped".into()));
                        send(&FromWorker::Installed(r));
                        let why = done_rx
                            .recv()
                            .unwrap_or_else(|_| "the actor thread stopped".into());
                        // However the loop ended, its graph is over: closing every channel
                        // this worker holds wakes its peers (shared memory is closed for
                        // every process; a connection shut down reaches the other host), so
                        // a loop stopped by a broken connection stops the whole graph.
                        ends.close_all();
                        send(&FromWorker::GraphDone(why));
                    });
            }
        }
    }
}

/// A worker decodes and encodes large payloads over and over: keep freed memory in the heap
/// instead of returning it to the kernel, so that the next buffer of the same size is not
/// faulted in page by page again (glibc maps allocations over 32 MiB afresh every time).
fn keep_freed_memory() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only tunes glibc's allocator; it is called before the worker starts
    // any other thread, so no allocation runs concurrently with the change.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 30);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 31);
    }
}

/// A worker (or agent) runs from a constructor, before Rust's runtime would set `SIGPIPE` to
/// be ignored as it does for every `main`: set it here, so that a write to a connection a
/// peer closed is an error, not the death of the process.
pub(crate) fn ignore_sigpipe() {
    // SAFETY: setting a signal's disposition to SIG_IGN installs no handler code; it is what
    // the Rust runtime itself does before `main`.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
    }
}
