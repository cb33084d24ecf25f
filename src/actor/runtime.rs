//! The driver's runtime: spawns actors on threads or in worker processes.
use super::call::Calls;
use super::host::{Control, host_loop};
use super::link::{ActorLink, ThreadLink};
use super::method::panic_text;
use super::remote::RemoteLink;
use super::worker::ProcessLink;
use super::{Actor, ActorHandle, ActorShared, HandleCore, next_actor_id};
use crate::cluster::driver::ClusterDriver;
use crate::cluster::{ClusterOptions, HostInfo};
use crate::dag::MethodSig;
use crate::error::{Error, Result};
use crate::tensor::Device;
use crate::value::{Value, encode};
use parking_lot::Mutex;
use std::net::SocketAddr;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::time::Duration;

/// Where an actor lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Placement {
    /// A thread of the driver's process: values move without serialization.
    #[default]
    Thread,
    /// A worker process of its own (Ray's kind of actor): edges become shared memory.
    Process,
    /// A worker process on joined host `id` ([`HostInfo::id`]), started by that host's agent.
    /// Host 0 is the driver's own: the same as [`Placement::Process`].
    Host(u64),
}

/// How to spawn an actor, beyond its placement ([`Runtime::spawn_with`]).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct SpawnOptions {
    /// The actor's name (shown in errors and pictures); `None` = `Type#id`.
    pub name: Option<String>,
    /// The device the actor computes on (default [`Device::Cpu`]). adag does not allocate
    /// devices: this records the placement the caller chose, and `Transport::Auto` uses it to
    /// pick a communicator for tensors between actors on distinct CUDA devices.
    pub device: Device,
}

impl Default for SpawnOptions {
    fn default() -> Self {
        SpawnOptions {
            name: None,
            device: Device::Cpu,
        }
    }
}

impl SpawnOptions {
    /// Set [`SpawnOptions::name`].
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// Set [`SpawnOptions::device`].
    pub fn device(mut self, device: Device) -> Self {
        self.device = device;
        self
    }
}

/// The driver's runtime.
///
/// ```
/// let rt = adag::Runtime::new().unwrap();
/// drop(rt);
/// ```
#[derive(Clone, Default)]
pub struct Runtime {
    /// The listener for other hosts, once [`Runtime::listen`] was called.
    cluster: Arc<Mutex<Option<Arc<ClusterDriver>>>>,
}

fn signature<A: Actor>(name: &str) -> Option<MethodSig> {
    super::method::find(A::methods(), name).map(|m| m.sig())
}

fn output_reader<A: Actor>(
    name: &str,
    elem: Option<usize>,
) -> Option<super::channels::ErasedReaderFn> {
    let m = super::method::find(A::methods(), name)?;
    match elem {
        None => Some(m.imp.output_reader()),
        Some(i) => m.imp.elem_reader(i),
    }
}

/// Runs before `main` in every executable that links adag: a worker (or a host's agent)
/// never reaches `main`.
#[ctor::ctor(unsafe)]
fn adag_worker_hook() {
    super::worker::maybe_run_worker();
    crate::cluster::agent::maybe_run_agent(super::remote::agent_services);
}

fn method_names<A: Actor>() -> Vec<&'static str> {
    A::methods().iter().map(|m| m.name).collect()
}

fn short_type_name(full: &str) -> &str {
    full.rsplit("::").next().unwrap_or(full)
}

impl Runtime {
    /// A runtime for this driver process. When a launcher set
    /// [`ADAG_LISTEN`](crate::cluster::ENV_LISTEN) (with `ADAG_TOKEN`), the first runtime
    /// of the process listens there for hosts, as [`listen`](Self::listen) would
    /// ([`ClusterOptions::from_env`]); later runtimes of the process do not (one process,
    /// one address).
    pub fn new() -> Result<Self> {
        let rt = Runtime::without_env();
        static LISTEN_FROM_ENV: std::sync::Once = std::sync::Once::new();
        let mut options = Ok(None);
        LISTEN_FROM_ENV.call_once(|| options = ClusterOptions::from_env());
        if let Some(options) = options? {
            rt.listen(options)?;
        }
        Ok(rt)
    }

    /// A runtime that does not look at `ADAG_LISTEN`: it listens for hosts only when told
    /// ([`listen`](Self::listen)). For embedders that read their own configuration (the
    /// Python package's `adag.init`).
    pub fn without_env() -> Self {
        super::worker::maybe_run_worker();
        Runtime::default()
    }

    /// Listen for hosts joining this driver (see [`cluster`](crate::cluster)); returns the
    /// address they join (`ADAG_JOIN`). Hosts stay joined while this runtime (any clone of
    /// it) lives; when it is dropped, every agent is told to leave.
    pub fn listen(&self, options: ClusterOptions) -> Result<SocketAddr> {
        let mut cluster = self.cluster.lock();
        if let Some(c) = cluster.as_ref() {
            return Err(Error::io(
                format!("listening on {}", options.addr),
                format!(
                    "this runtime already listens on {}; one listener per driver",
                    c.addr()
                ),
            ));
        }
        let driver = ClusterDriver::start(options)?;
        // Communicator groups that span hosts meet at this address (TCP backend).
        crate::comm::tcp::set_root_ip(driver.addr().ip());
        driver.set_log_sink(super::logs::RemoteLogs::new());
        let addr = driver.addr();
        *cluster = Some(driver);
        Ok(addr)
    }

    /// Every host that joined, in joining order (none before [`listen`](Self::listen)): a
    /// host that was lost stays listed with [`HostInfo::lost`] saying when and why (filter
    /// with [`HostInfo::is_alive`] for the live ones).
    pub fn hosts(&self) -> Vec<HostInfo> {
        self.cluster
            .lock()
            .as_ref()
            .map(|c| c.hosts())
            .unwrap_or_default()
    }

    /// Wait until `n` hosts have joined, up to `timeout`.
    pub fn wait_for_hosts(&self, n: usize, timeout: Duration) -> Result<Vec<HostInfo>> {
        let Some(cluster) = self.cluster.lock().clone() else {
            return Err(Error::io(
                "waiting for hosts",
                "this runtime does not listen for hosts; call Runtime::listen first",
            ));
        };
        cluster.wait_for_hosts(n, timeout)
    }

    /// Spawn an actor of type `A` built from `init` (the arguments of its `new`).
    pub fn spawn<A: Actor>(&self, placement: Placement, init: A::Init) -> Result<ActorHandle<A>> {
        let id = next_actor_id();
        let name = format!("{}#{id}", short_type_name(A::type_name()));
        self.spawn_with_id::<A>(placement, id, name, Device::Cpu, init)
    }

    /// Spawn an actor with a name of your choosing (shown in errors and pictures).
    pub fn spawn_named<A: Actor>(
        &self,
        placement: Placement,
        name: impl Into<String>,
        init: A::Init,
    ) -> Result<ActorHandle<A>> {
        self.spawn_with_id::<A>(placement, next_actor_id(), name.into(), Device::Cpu, init)
    }

    /// Spawn an actor with [`SpawnOptions`] (name, device).
    pub fn spawn_with<A: Actor>(
        &self,
        placement: Placement,
        options: SpawnOptions,
        init: A::Init,
    ) -> Result<ActorHandle<A>> {
        let id = next_actor_id();
        let name = options
            .name
            .unwrap_or_else(|| format!("{}#{id}", short_type_name(A::type_name())));
        self.spawn_with_id::<A>(placement, id, name, options.device, init)
    }

    fn spawn_with_id<A: Actor>(
        &self,
        placement: Placement,
        id: u64,
        name: String,
        device: Device,
        init: A::Init,
    ) -> Result<ActorHandle<A>> {
        let live_graph = Arc::new(Mutex::new(None));
        let link = match placement {
            Placement::Thread => ActorLink::Thread(spawn_thread::<A>(id, &name, init)?),
            Placement::Host(host) if host != 0 => {
                let Some(cluster) = self.cluster.lock().clone() else {
                    return Err(Error::Spawn {
                        actor: name,
                        message: format!(
                            "placed on host {host}, but this runtime has no hosts; call Runtime::listen and wait for the hosts first"
                        ),
                    });
                };
                let init = encode_init(&name, &init)?;
                ActorLink::Remote(RemoteLink::spawn(
                    cluster,
                    host,
                    id,
                    &name,
                    A::type_name(),
                    init,
                    live_graph.clone(),
                )?)
            }
            Placement::Process | Placement::Host(_) => {
                let init = encode_init(&name, &init)?;
                ActorLink::Process(ProcessLink::spawn(
                    id,
                    &name,
                    A::type_name(),
                    init,
                    live_graph.clone(),
                )?)
            }
        };
        tracing::debug!(
            actor = %name,
            actor_type = A::type_name(),
            ?placement,
            pid = link.pid(),
            "spawned actor"
        );
        let core = HandleCore(Arc::new(ActorShared {
            id,
            name,
            type_name: A::type_name(),
            signature: signature::<A>,
            method_names: method_names::<A>,
            output_reader: output_reader::<A>,
            link,
            live_graph,
            device,
        }));
        Ok(ActorHandle::from_core(core))
    }
}

/// The init arguments of an actor started in another process.
fn encode_init<T: Value>(name: &str, init: &T) -> Result<Vec<u8>> {
    encode(init).map_err(|e| Error::Spawn {
        actor: name.to_string(),
        message: format!("cannot encode the init arguments: {e}"),
    })
}

fn spawn_thread<A: Actor>(id: u64, name: &str, init: A::Init) -> Result<ThreadLink> {
    let (control, rx) = crossbeam_channel::unbounded::<Control>();
    let calls = std::sync::Arc::new(Calls::default());
    let host_calls = calls.clone();
    let (ready_tx, ready_rx) = crossbeam_channel::bounded::<Result<(), String>>(1);
    let host_name = name.to_string();
    // Detached: the thread ends when the last handle drops the control channel.
    std::thread::Builder::new()
        .name(format!("adag-{name}"))
        .spawn(move || {
            let built = catch_unwind(AssertUnwindSafe(|| A::construct(init)))
                .unwrap_or_else(|p| Err(panic_text(p)));
            match built {
                Ok(actor) => {
                    let _ = ready_tx.send(Ok(()));
                    host_loop(
                        Box::new(super::host::Host {
                            actor,
                            id,
                            name: host_name,
                        }),
                        rx,
                        host_calls,
                    );
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            }
        })
        .map_err(|e| Error::Spawn {
            actor: name.to_string(),
            message: format!("cannot start its thread: {e}"),
        })?;
    let started = ready_rx
        .recv()
        .unwrap_or_else(|_| Err("its thread stopped during construction".into()));
    started.map_err(|message| Error::Spawn {
        actor: name.to_string(),
        message: format!("new() failed: {message}"),
    })?;
    Ok(ThreadLink { control, calls })
}
