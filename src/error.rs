//! The errors of adag: every one says what happened, where (node, actor, method) and what to do.
use std::time::Duration;

/// Result with [`enum@Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Which capacity of a compiled graph was exceeded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Capacity {
    /// `max_inflight_executions`: executions submitted whose results were not read yet.
    InflightExecutions,
    /// `max_buffered_results`: results read off the output channels but not claimed by their ref.
    BufferedResults,
}

/// Every error of the library.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A method returned `Err` or panicked; its downstream tasks were skipped.
    #[error("task {actor}.{method} failed: {message}")]
    Task {
        /// The actor that ran the method.
        actor: String,
        /// The method that failed.
        method: String,
        /// The method's error text or panic message.
        message: String,
    },
    /// An actor's worker process died; the graph was torn down.
    #[error(
        "actor {actor} died ({reason}); its compiled graph was torn down. Spawn the actor again and compile a new graph"
    )]
    ActorDied {
        /// The actor that died.
        actor: String,
        /// How it died (signal, exit status).
        reason: String,
    },
    /// A blocking call ran past its deadline.
    #[error("timed out after {timeout:?} waiting for {what}; {hint}")]
    Timeout {
        /// What was waited on.
        what: String,
        /// The deadline that passed.
        timeout: Duration,
        /// What to do about it.
        hint: String,
    },
    /// A capacity of the compiled graph is full; nothing was blocked.
    #[error("{}", capacity_text(*.capacity, *.limit))]
    CapacityExceeded {
        /// Which capacity.
        capacity: Capacity,
        /// Its configured limit.
        limit: usize,
    },
    /// The graph is not valid; nothing was compiled.
    #[error("cannot compile the graph: node {node}: {message}")]
    Compile {
        /// The node at fault, as `actor.method#id` or `input`.
        node: String,
        /// What is wrong and how to fix it.
        message: String,
    },
    /// The compiled graph was torn down; it runs no more executions.
    #[error("the compiled graph was torn down{}; compile the graph again to run it", reason_suffix(.reason))]
    TornDown {
        /// Why, when it was not an explicit teardown.
        reason: Option<String>,
    },
    /// The result of this execution was already claimed through another handle to the same ref.
    #[error(
        "the result of execution {execution} (output {output}) was already claimed; a ref yields its value once"
    )]
    AlreadyClaimed {
        /// The execution index.
        execution: u64,
        /// The output index.
        output: usize,
    },
    /// A message exceeded the channel's size ceiling.
    #[error(
        "a message of {size} bytes on edge {edge} exceeds the ceiling of {limit} bytes; raise CompileOptions::max_message_bytes or send less"
    )]
    MessageTooLarge {
        /// The edge (the producing node).
        edge: String,
        /// The message size.
        size: usize,
        /// The ceiling.
        limit: usize,
    },
    /// The actor is stuck inside a method of compiled graph `graph` (a live one, or one torn
    /// down while a method of this thread actor was still running): a one-off call it did not
    /// take within 2 s was withdrawn without running. (Calls to an actor of a live graph that
    /// is not stuck run between two executions.)
    #[error(
        "actor {actor} is inside a method of compiled graph #{graph} and did not take the call within 2 s, so the call did not run; call again once the method returns (if the graph was torn down, the actor is free once it returns)"
    )]
    ActorBusy {
        /// The actor.
        actor: String,
        /// The live graph's id.
        graph: u64,
    },
    /// Spawning an actor failed.
    #[error("cannot spawn actor {actor}: {message}")]
    Spawn {
        /// The actor.
        actor: String,
        /// Why.
        message: String,
    },
    /// A one-off call failed outside of the method itself (unknown method, dead actor, wrong types).
    #[error("call {actor}.{method} failed: {message}")]
    Call {
        /// The actor.
        actor: String,
        /// The method.
        method: String,
        /// Why.
        message: String,
    },
    /// The graph was compiled for the other execution mode (sync vs async).
    #[error("{message}")]
    WrongMode {
        /// What was called and what to call instead.
        message: String,
    },
    /// A value could not be encoded or decoded.
    #[error("cannot {op} a value of type {ty} on {place}: {message}")]
    Codec {
        /// `encode` or `decode`.
        op: &'static str,
        /// The Rust type.
        ty: String,
        /// Where (edge, call).
        place: String,
        /// The codec's message.
        message: String,
    },
    /// An operating-system call failed.
    #[error("{context}: {message}")]
    Io {
        /// What was being done.
        context: String,
        /// The OS error.
        message: String,
    },
}

fn capacity_text(capacity: Capacity, limit: usize) -> String {
    match capacity {
        Capacity::InflightExecutions => format!(
            "the compiled graph already has {limit} executions in flight (max_inflight_executions = {limit}); get a result before submitting more, or raise CompileOptions::max_inflight_executions"
        ),
        Capacity::BufferedResults => format!(
            "the compiled graph already buffers {limit} unclaimed results (max_buffered_results = {limit}); get the earlier refs first, or raise CompileOptions::max_buffered_results"
        ),
    }
}

fn reason_suffix(reason: &Option<String>) -> String {
    match reason {
        Some(r) => format!(" ({r})"),
        None => String::new(),
    }
}

impl Error {
    pub(crate) fn io(context: impl Into<String>, err: impl std::fmt::Display) -> Self {
        Error::Io {
            context: context.into(),
            message: err.to_string(),
        }
    }

    pub(crate) fn compile(node: impl Into<String>, message: impl Into<String>) -> Self {
        Error::Compile {
            node: node.into(),
            message: message.into(),
        }
    }
}

/// A failed task, carried in place of a value to every downstream reader (an error frame).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub(crate) struct TaskError {
    pub actor: String,
    pub method: String,
    pub message: String,
}

impl From<&TaskError> for Error {
    fn from(e: &TaskError) -> Self {
        Error::Task {
            actor: e.actor.clone(),
            method: e.method.clone(),
            message: e.message.clone(),
        }
    }
}
