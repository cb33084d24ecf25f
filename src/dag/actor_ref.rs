//! The graph's view of an actor: who it is, where it runs and which methods it has. Graphs
//! and the compiler see actors only through this; the runtime's actors implement it.
use crate::tensor::Device;
use crate::value::TypeTag;
use std::any::Any;
use std::fmt;
use std::sync::Arc;

/// The signature of an exported method, as the compiler checks it.
#[derive(Debug, Clone)]
pub(crate) struct MethodSig {
    pub args: Vec<TypeTag>,
    /// The parameter names, for error messages.
    pub names: &'static [&'static str],
    pub ret: TypeTag,
    /// The element types when the method returns a tuple the graph may split (2 to 8
    /// elements); `None` otherwise.
    pub elems: Option<Vec<TypeTag>>,
}

/// What a graph needs to know of an actor, whatever hosts it.
pub(crate) trait ActorInfo: Any + Send + Sync {
    fn id(&self) -> u64;
    fn name(&self) -> &str;
    fn signature(&self, method: &str) -> Option<MethodSig>;
    fn method_names(&self) -> Vec<&'static str>;
    /// The device the actor computes on (chooses `Transport::Auto`).
    fn device(&self) -> Device;
    /// The process the actor runs in: 0 for the driver's own, else a number of its own.
    fn process(&self) -> u64;
    /// The host the actor runs on: 0 for the driver's, else the id the host joined with.
    fn host(&self) -> u64;
}

/// An actor as a graph refers to it. Made from a spawned actor's handle:
/// `ActorRef::from(&handle)`; two refs of one actor are the same actor.
#[derive(Clone)]
pub struct ActorRef(pub(crate) Arc<dyn ActorInfo>);

impl ActorRef {
    /// The actor's unique id.
    pub fn id(&self) -> u64 {
        self.0.id()
    }

    /// The actor's name, as errors show it.
    pub fn name(&self) -> &str {
        self.0.name()
    }

    /// The device the actor was spawned for.
    pub fn device(&self) -> Device {
        self.0.device()
    }

    pub(crate) fn same(&self, other: &ActorRef) -> bool {
        self.id() == other.id()
    }

    pub(crate) fn signature(&self, method: &str) -> Option<MethodSig> {
        self.0.signature(method)
    }

    pub(crate) fn method_names(&self) -> Vec<&'static str> {
        self.0.method_names()
    }

    pub(crate) fn process(&self) -> u64 {
        self.0.process()
    }

    pub(crate) fn host(&self) -> u64 {
        self.0.host()
    }

    /// The actor behind the graph's view, for the runtime to recover its own type.
    pub(crate) fn as_any(&self) -> Arc<dyn Any + Send + Sync> {
        self.0.clone()
    }
}

impl fmt::Debug for ActorRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Actor({})", self.name())
    }
}
