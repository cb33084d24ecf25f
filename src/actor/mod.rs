//! Actors: the trait `#[actor]` implements, handles, one-off calls, and where actors live
//! (a thread of the driver's process or a worker process of their own).
use crate::dag::{ActorInfo, ActorRef, AnyNode, ErasedArg, MethodSig, Node, method_node};
use crate::error::{Error, Result};
use crate::value::{TypeTag, Value};
use parking_lot::Mutex;
use std::fmt;
use std::ops::Deref;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

pub(crate) mod call;
pub(crate) mod channels;
pub(crate) mod comm_ops;
pub(crate) mod host;
pub(crate) mod lend;
pub(crate) mod link;
pub(crate) mod logs;
pub(crate) mod method;
pub(crate) mod observe;
pub(crate) mod op;
pub(crate) mod registry;
pub(crate) mod remote;
mod runtime;
pub(crate) mod wire;
#[cfg(test)]
mod wire_tests;
pub(crate) mod worker;

pub use method::{ArgTuple, MethodEntry, SplitTuple};
pub use registry::ActorTypeEntry;
pub use runtime::{Placement, Runtime, SpawnOptions};

/// A stateful actor whose methods can be bound into compiled graphs.
///
/// Implemented by `#[adag::actor]` on an `impl` block; not meant to be written by hand.
pub trait Actor: Sized + Send + 'static {
    /// The arguments of the actor's `new` (`()` without one).
    type Init: Value;
    /// Typed binding methods, reached through [`ActorHandle`]'s `Deref`.
    type Binder: FromHandleCore;
    /// Typed one-off calls, reached through [`ActorHandle::call`].
    type Caller: FromHandleCore;
    /// The type's registered name (module path and type name).
    fn type_name() -> &'static str;
    /// Build the actor from its init arguments.
    fn construct(init: Self::Init) -> std::result::Result<Self, String>;
    /// The exported methods.
    fn methods() -> &'static [MethodEntry<Self>];
}

/// Built by generated binder and caller types from the untyped handle.
pub trait FromHandleCore: Send + Sync + 'static {
    /// Wrap the handle.
    fn from_core(core: HandleCore) -> Self;
}

static NEXT_ACTOR_ID: AtomicU64 = AtomicU64::new(1);

pub(crate) fn next_actor_id() -> u64 {
    NEXT_ACTOR_ID.fetch_add(1, Ordering::Relaxed)
}

/// The untyped handle of an actor: what generated code and the driver hold.
#[derive(Clone)]
pub struct HandleCore(pub(crate) Arc<ActorShared>);

pub(crate) struct ActorShared {
    pub id: u64,
    pub name: String,
    pub type_name: &'static str,
    pub signature: fn(&str) -> Option<MethodSig>,
    pub method_names: fn() -> Vec<&'static str>,
    /// A driver's reader of a method's result (`None`) or of element `i` of its tuple result
    /// (`Some(i)`), for by-name outputs; `None` for an unknown method or element.
    pub output_reader: fn(&str, Option<usize>) -> Option<channels::ErasedReaderFn>,
    pub link: link::ActorLink,
    /// The live compiled graph this actor belongs to.
    pub live_graph: Arc<Mutex<Option<u64>>>,
    /// The device whose tensors the actor computes on (chooses `Transport::Auto`).
    pub device: crate::tensor::Device,
}

impl ActorInfo for ActorShared {
    fn id(&self) -> u64 {
        self.id
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn signature(&self, method: &str) -> Option<MethodSig> {
        (self.signature)(method)
    }

    fn method_names(&self) -> Vec<&'static str> {
        (self.method_names)()
    }

    fn device(&self) -> crate::tensor::Device {
        self.device
    }

    /// 0 for actors in the driver's process, else the actor's own process number.
    fn process(&self) -> u64 {
        match &self.link {
            link::ActorLink::Thread(_) => 0,
            link::ActorLink::Process(_) | link::ActorLink::Remote(_) => self.id,
        }
    }

    fn host(&self) -> u64 {
        match &self.link {
            link::ActorLink::Remote(link) => link.host(),
            link::ActorLink::Thread(_) | link::ActorLink::Process(_) => 0,
        }
    }
}

impl<A: Actor> From<&ActorHandle<A>> for ActorRef {
    fn from(h: &ActorHandle<A>) -> ActorRef {
        h.core().actor_ref()
    }
}

impl From<&HandleCore> for ActorRef {
    fn from(h: &HandleCore) -> ActorRef {
        h.actor_ref()
    }
}

impl From<HandleCore> for ActorRef {
    fn from(h: HandleCore) -> ActorRef {
        h.actor_ref()
    }
}

impl fmt::Debug for HandleCore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Actor({})", self.0.name)
    }
}

impl HandleCore {
    /// The actor's name, as errors show it.
    pub fn name(&self) -> &str {
        &self.0.name
    }

    /// The actor's registered type name.
    pub fn type_name(&self) -> &'static str {
        self.0.type_name
    }

    /// The actor's unique id.
    pub fn id(&self) -> u64 {
        self.0.id
    }

    /// The device the actor was spawned for ([`SpawnOptions::device`]).
    pub fn device(&self) -> crate::tensor::Device {
        self.0.device
    }

    pub(crate) fn same(&self, other: &HandleCore) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// The actor as graphs refer to it.
    pub fn actor_ref(&self) -> ActorRef {
        ActorRef(self.0.clone())
    }

    /// How the driver reads the result of `method` (or element `elem` of its tuple result)
    /// without knowing its type: `None` when there is no such method or element.
    pub(crate) fn output_reader(
        &self,
        method: &str,
        elem: Option<usize>,
    ) -> Option<channels::ErasedReaderFn> {
        (self.0.output_reader)(method, elem)
    }

    /// The handle of the actor behind a graph's reference, if it is one of this runtime's.
    pub(crate) fn of(actor: &ActorRef) -> Option<HandleCore> {
        actor
            .as_any()
            .downcast::<ActorShared>()
            .ok()
            .map(HandleCore)
    }

    /// Bind a method into a graph (used by generated code).
    #[must_use = "a bound node does nothing unless it is used by a task or is an output of the graph"]
    pub fn bind<R: Value>(&self, method: &str, args: Vec<ErasedArg>) -> Node<R> {
        Node::from_inner(method_node(
            self.actor_ref(),
            method,
            args,
            TypeTag::of::<R>(),
        ))
    }

    /// One-off call (used by generated code): the slow path. An actor in a live graph runs
    /// it between two executions of its schedule, never inside one; an actor stuck inside a
    /// method for 2 s answers [`Error::ActorBusy`] and the call
    /// does not run.
    pub fn call<Args: Value, R: Value>(&self, method: &str, args: Args) -> Result<R> {
        match self.0.link.call::<Args, R>(&self.0.name, method, args) {
            Err(Error::ActorBusy { actor, .. }) => Err(Error::ActorBusy {
                actor,
                graph: self.0.live_graph.lock().unwrap_or(0),
            }),
            r => r,
        }
    }

    /// A method by name, for dynamic binding; its types are checked when the graph compiles.
    ///
    /// A name the actor does not export is an [`Error::Compile`] that names it and lists the
    /// actor's methods.
    pub fn method(&self, name: &str) -> Result<DynMethod> {
        let Some(sig) = (self.0.signature)(name) else {
            let mut names = (self.0.method_names)();
            names.sort_unstable();
            return Err(Error::compile(
                format!("{}.{name}", self.0.name),
                format!(
                    "actor {} ({}) has no method `{name}`; its methods are: {}",
                    self.0.name,
                    self.0.type_name,
                    names.join(", ")
                ),
            ));
        };
        Ok(DynMethod {
            actor: self.clone(),
            name: name.to_string(),
            ret: sig.ret,
        })
    }
}

/// A method looked up by name (Ray's `actor.method.bind(..)` from tools and other languages).
pub struct DynMethod {
    actor: HandleCore,
    name: String,
    ret: TypeTag,
}

impl fmt::Debug for DynMethod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DynMethod({}.{})", self.actor.name(), self.name)
    }
}

impl DynMethod {
    /// Bind the method to arguments. Mismatched argument types are reported by `compile`,
    /// naming the node.
    #[must_use = "a bound node does nothing unless it is used by a task or is an output of the graph"]
    pub fn bind(&self, args: impl IntoIterator<Item = ErasedArg>) -> AnyNode {
        AnyNode {
            inner: method_node(
                self.actor.actor_ref(),
                &self.name,
                args.into_iter().collect(),
                self.ret,
            ),
        }
    }
}

/// A typed handle of a spawned actor. Derefs to the generated binder, so
/// `handle.forward(x)` binds `forward` into a graph; `handle.call().forward(x)` calls it once.
pub struct ActorHandle<A: Actor> {
    core: HandleCore,
    binder: A::Binder,
    caller: A::Caller,
}

impl<A: Actor> Clone for ActorHandle<A> {
    fn clone(&self) -> Self {
        ActorHandle::from_core(self.core.clone())
    }
}

impl<A: Actor> fmt::Debug for ActorHandle<A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ActorHandle({})", self.core.0.name)
    }
}

impl<A: Actor> ActorHandle<A> {
    pub(crate) fn from_core(core: HandleCore) -> Self {
        ActorHandle {
            binder: A::Binder::from_core(core.clone()),
            caller: A::Caller::from_core(core.clone()),
            core,
        }
    }

    /// Typed one-off calls (the slow path, for setup and inspection).
    pub fn call(&self) -> &A::Caller {
        &self.caller
    }

    /// The untyped handle.
    pub fn core(&self) -> &HandleCore {
        &self.core
    }

    /// The actor's name.
    pub fn name(&self) -> &str {
        &self.core.0.name
    }

    /// The actor's id.
    pub fn id(&self) -> u64 {
        self.core.0.id
    }

    /// A method by name, for dynamic binding.
    ///
    /// ```
    /// # use adag::{Dag, ErasedArg, Placement, Runtime};
    /// # pub struct W;
    /// # #[adag::actor]
    /// # impl W { pub fn new() -> Self { W } pub fn twice(&mut self, x: u64) -> u64 { 2 * x } }
    /// let rt = Runtime::new()?;
    /// let w = rt.spawn::<W>(Placement::Thread, ())?;
    /// let dag = Dag::<u64>::new();
    /// let y = w.method("twice")?.bind([ErasedArg::from(dag.input().erase())]);
    /// assert_eq!(y.type_name(), "u64");
    /// let typo = w.method("twcie").unwrap_err().to_string();
    /// assert!(typo.contains("twcie") && typo.contains("twice"), "{typo}");
    /// # Ok::<(), adag::Error>(())
    /// ```
    pub fn method(&self, name: &str) -> Result<DynMethod> {
        self.core.method(name)
    }

    /// Kill the actor's worker process at once (SIGKILL); for thread actors, an error.
    pub fn kill(&self) -> Result<()> {
        self.core.0.link.kill(&self.core.0.name)
    }

    /// The device the actor was spawned for.
    pub fn device(&self) -> crate::tensor::Device {
        self.core.0.device
    }

    /// The worker's process id, for process actors.
    pub fn pid(&self) -> Option<u32> {
        self.core.0.link.pid()
    }
}

impl<A: Actor> Deref for ActorHandle<A> {
    type Target = A::Binder;
    fn deref(&self) -> &A::Binder {
        &self.binder
    }
}

#[cfg(feature = "async")]
thread_local! {
    static ACTOR_RUNTIME: std::cell::OnceCell<tokio::runtime::Runtime> = const { std::cell::OnceCell::new() };
}

/// Run an async method on the calling actor's own single-threaded tokio runtime.
#[cfg(feature = "async")]
pub(crate) fn block_on<F: std::future::Future>(f: F) -> F::Output {
    ACTOR_RUNTIME.with(|cell| {
        cell.get_or_init(|| {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("cannot build the actor's tokio runtime")
        })
        .block_on(f)
    })
}

/// Run an async method to completion on the calling actor's thread, parking the thread while
/// the future waits (no tokio: its timers and I/O are not available to such methods).
#[cfg(not(feature = "async"))]
pub(crate) fn block_on<F: std::future::Future>(f: F) -> F::Output {
    use std::sync::Arc;
    use std::task::{Context, Poll, Wake, Waker};

    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
        fn wake_by_ref(self: &Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    loop {
        match f.as_mut().poll(&mut cx) {
            Poll::Ready(v) => return v,
            Poll::Pending => std::thread::park(),
        }
    }
}
