//! The driver's runtime: spawns actors on threads or in worker processes.
use super::host::{ActorLink, Control, ThreadLink, host_loop};
use super::method::panic_text;
use super::worker::ProcessLink;
use super::{Actor, ActorHandle, ActorShared, HandleCore, next_actor_id};
use crate::dag::MethodSig;
use crate::error::{Error, Result};
use crate::tensor::Device;
use crate::value::encode;
use parking_lot::Mutex;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

/// Where an actor lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Placement {
    /// A thread of the driver's process: values move without serialization.
    #[default]
    Thread,
    /// A worker process of its own (Ray's kind of actor): edges become shared memory.
    Process,
}

/// How to spawn an actor, beyond its placement ([`Runtime::spawn_with`]).
#[derive(Debug, Clone)]
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
    _inner: Arc<()>,
}

fn signature<A: Actor>(name: &str) -> Option<MethodSig> {
    super::method::find(A::methods(), name).map(|m| m.sig())
}

fn method_names<A: Actor>() -> Vec<&'static str> {
    A::methods().iter().map(|m| m.name).collect()
}

fn short_type_name(full: &str) -> &str {
    full.rsplit("::").next().unwrap_or(full)
}

impl Runtime {
    /// A runtime for this driver process.
    pub fn new() -> Result<Self> {
        super::worker::maybe_run_worker();
        Ok(Runtime::default())
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
            Placement::Process => {
                let init = encode(&init).map_err(|e| Error::Spawn {
                    actor: name.clone(),
                    message: format!("cannot encode the init arguments: {e}"),
                })?;
                ActorLink::Process(ProcessLink::spawn(
                    id,
                    &name,
                    A::type_name(),
                    init,
                    live_graph.clone(),
                )?)
            }
        };
        let core = HandleCore(Arc::new(ActorShared {
            id,
            name,
            type_name: A::type_name(),
            signature: signature::<A>,
            method_names: method_names::<A>,
            link,
            live_graph,
            device,
        }));
        Ok(ActorHandle::from_core(core))
    }
}

fn spawn_thread<A: Actor>(id: u64, name: &str, init: A::Init) -> Result<ThreadLink> {
    let (control, rx) = crossbeam_channel::unbounded::<Control>();
    let calls = std::sync::Arc::new(super::host::Calls::default());
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
