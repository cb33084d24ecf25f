#![doc = include_str!("guide.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod actor;
mod buffer;
mod channel;
mod clock;
pub mod cluster;
pub mod comm;
pub mod compile;
pub mod dag;
pub mod error;
pub mod exec;
pub(crate) mod sync;
pub mod tensor;
mod value;

pub use actor::{Actor, ActorHandle, HandleCore, Placement, Runtime, SpawnOptions};
pub use adag_macros::actor;
pub use buffer::{Buffer, BufferMut};
pub use comm::{CommError, CommId, Communicator, CommunicatorFactory, CommunicatorGroup, ReduceOp};
pub use compile::{CompileOptions, DefaultCommunicator};
pub use dag::collective;
pub use dag::{
    ActorRef, AnyNode, Arg, CustomCommunicator, Dag, ErasedArg, InputNode, MultiOutput, Node,
    Transport,
};
pub use error::{Capacity, CompileProblem, Error, MethodError, Result};
pub use exec::{
    ActorStats, AsyncPipeline, AsyncRefSet, CommunicatorInfo, CompiledGraph, CompiledRef,
    EdgeStats, First, GraphStats, HostClock, IndexedInput, IntoOutputs, OpKind, Pipeline,
    RefFuture, RefSet, Timeline, TimelineEvent, get_all, get_all_timeout, wait_first,
    wait_first_async,
};
pub use tensor::{DType, Device, Element, Tensor, TensorError};
pub use value::{AnyValue, TypeTag, Value};

/// Start-up hook: in a worker process started by a driver this runs the worker and never
/// returns; in any other process it does nothing. Called automatically before `main` in
/// every executable that links adag, and by [`Runtime::new`]; calling it at the top of
/// `main` is harmless.
///
/// It is also how a worker started by a command of [`set_worker_command`] becomes a worker:
/// that command calls `init()` once adag is loaded.
pub fn init() {
    actor::worker::maybe_run_worker_explicit();
}

pub use actor::lend::output_buffer;
pub use actor::worker::set_worker_command;

/// Run this process as a host's agent when it was started as one (`ADAG_JOIN` and
/// `ADAG_TOKEN` in its environment, see [`cluster`]): it joins the driver, serves it until the
/// driver leaves, and returns the process's exit status (0, or
/// [`cluster::EXIT_JOIN_FAILED`] when it could not join). Returns `None` at once in any other
/// process.
///
/// Executables that link adag need not call it: the start-up hook does, before `main`. It is
/// for programs that load adag as a library (the Python package's `python -m adag.agent`):
/// they keep `ADAG_JOIN` out of the environment while the library loads (or its hook would
/// run the agent inside the loading), set their [`set_worker_command`], and call this.
///
/// ```
/// // A process that was not started as an agent (no `ADAG_JOIN`) goes on at once.
/// assert_eq!(adag::run_agent(), None);
/// ```
pub fn run_agent() -> Option<i32> {
    cluster::agent::run_agent_from_env(actor::remote::agent_services)
}

#[doc(hidden)]
pub mod __private {
    pub use crate::actor::method::{method, method_split};
    pub use crate::actor::registry::{ACTOR_TYPES, ActorTypeEntry};
    pub use crate::actor::{FromHandleCore, HandleCore, MethodEntry};
    pub use crate::comm::COMM_FACTORIES;
    pub use crate::error::{MethodError, error_kind};
    pub use linkme;

    /// Run an async method to completion on the actor's own thread.
    pub fn block_on<F: std::future::Future>(f: F) -> F::Output {
        crate::actor::block_on(f)
    }
}
