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
    ///
    /// `message` holds the whole chain of the method's error (each `source()` joined with
    /// `": "`, as anyhow's `{:#}` prints it), so `to_string()` shows every cause; the causes
    /// are also in `chain`, one per level. The chain is not repeated through
    /// [`source()`](std::error::Error::source), which would print every cause twice.
    #[error("task {actor}.{method} failed: {message}{}", backtrace_suffix(.backtrace))]
    #[non_exhaustive]
    Task {
        /// The actor that ran the method.
        actor: String,
        /// The method that failed.
        method: String,
        /// The method's error text (its whole chain) or panic message.
        message: String,
        /// The method's error, outermost first, then each `source()` in turn (one element
        /// for an error without a source or a panic). Boxed, like the two fields below, to
        /// keep `Error` small (every `Result` of the crate carries it).
        chain: Box<[String]>,
        /// The Rust type of the method's error (`std::any::type_name`), or `None` for a
        /// panic and for failures that are not the method's own (an argument that could not
        /// be read, a result over the ceiling).
        error_type: Option<Box<str>>,
        /// The panic's backtrace, when the actor's process asked for one (`RUST_BACKTRACE`
        /// or `RUST_LIB_BACKTRACE` set to `1` or `full`).
        backtrace: Option<Box<str>>,
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
    /// The graph is not valid; nothing was compiled. Every problem found is listed in
    /// `problems`; `node` and `message` repeat the first.
    #[error("{}", compile_text(.problems, .node, .message))]
    #[non_exhaustive]
    Compile {
        /// The node at fault, as `actor.method#id` or `input`.
        node: String,
        /// What is wrong and how to fix it.
        message: String,
        /// Every problem found, the first one included: those of tasks, then the graph's
        /// (input, outputs, unused nodes in creation order), then those of input nodes.
        problems: Vec<CompileProblem>,
    },
    /// A compile option is out of its range; nothing was compiled.
    #[error(
        "CompileOptions::{option} = {value} is not allowed: it must be {allowed}; set it with CompileOptions::{option}(...) to a value in that range"
    )]
    Config {
        /// The option (the field of [`CompileOptions`](crate::CompileOptions)).
        option: &'static str,
        /// The value given, as `Debug` prints it.
        value: String,
        /// The allowed range, in words.
        allowed: String,
    },
    /// The input given to `execute` lacks a part the graph reads; nothing of it was sent.
    #[error("the input does not fit the graph: part {part}: {message}")]
    Input {
        /// The input part, as `input[3]`.
        part: String,
        /// What is missing and what to pass.
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
    /// An argument of a call is outside the range it accepts; nothing was done.
    #[error("invalid argument `{name}`: {message}")]
    InvalidArgument {
        /// The argument.
        name: String,
        /// The range it accepts and what to pass.
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

/// One problem of a graph that does not compile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompileProblem {
    /// The node at fault: `actor.method#id`, `input`, `input[0]`, `input.key`, or what else
    /// is at fault (`outputs`, an actor's name).
    pub node: String,
    /// What is wrong and how to fix it.
    pub message: String,
}

impl std::fmt::Display for CompileProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "node {}: {}", self.node, self.message)
    }
}

fn compile_text(problems: &[CompileProblem], node: &str, message: &str) -> String {
    match problems {
        [] | [_] => format!("cannot compile the graph: node {node}: {message}"),
        many => {
            let mut s = format!("cannot compile the graph: {} problems:", many.len());
            for (i, p) in many.iter().enumerate() {
                s.push_str(&format!("\n  {}. {p}", i + 1));
            }
            s
        }
    }
}

fn backtrace_suffix(backtrace: &Option<Box<str>>) -> String {
    match backtrace {
        Some(b) => format!("\npanic backtrace:\n{b}"),
        None => String::new(),
    }
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
        Error::compile_all(vec![CompileProblem {
            node: node.into(),
            message: message.into(),
        }])
    }

    /// One error listing every problem (at least one).
    pub(crate) fn compile_all(problems: Vec<CompileProblem>) -> Self {
        let first = problems.first().cloned().unwrap_or(CompileProblem {
            node: "graph".into(),
            message: "invalid (no problem recorded: a bug)".into(),
        });
        Error::Compile {
            node: first.node,
            message: first.message,
            problems,
        }
    }

    pub(crate) fn config(
        option: &'static str,
        value: impl std::fmt::Debug,
        allowed: impl Into<String>,
    ) -> Self {
        Error::Config {
            option,
            value: format!("{value:?}"),
            allowed: allowed.into(),
        }
    }

    /// A task error with no chain or type of its own (failures around the method).
    pub(crate) fn task(
        actor: impl Into<String>,
        method: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        let message = message.into();
        Error::Task {
            actor: actor.into(),
            method: method.into(),
            chain: Box::new([message.clone()]),
            message,
            error_type: None,
            backtrace: None,
        }
    }

    /// Whether a ref's `get` or `get_timeout` that failed with this error left the ref
    /// usable: nothing was claimed (the wait timed out, there was no room to read its
    /// execution, or the graph's mode calls for the other way of waiting), so a later call
    /// may still return the result. After any other error the result is gone.
    ///
    /// ```
    /// use adag::Error;
    /// use std::time::Duration;
    ///
    /// let timeout = Error::Timeout {
    ///     what: "execution 3's result".into(),
    ///     timeout: Duration::from_millis(5),
    ///     hint: String::new(),
    /// };
    /// assert!(timeout.ref_stays_usable());
    /// let claimed = Error::AlreadyClaimed { execution: 3, output: 0 };
    /// assert!(!claimed.ref_stays_usable());
    /// ```
    pub fn ref_stays_usable(&self) -> bool {
        matches!(
            self,
            Error::Timeout { .. } | Error::CapacityExceeded { .. } | Error::WrongMode { .. }
        )
    }

    /// Every problem of a compile error (empty for other errors).
    pub fn compile_problems(&self) -> &[CompileProblem] {
        match self {
            Error::Compile { problems, .. } => problems,
            _ => &[],
        }
    }
}

/// How a method failed, as the actor reports it: the error's chain and type, or a panic's
/// text and backtrace.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct MethodError {
    /// The error, then each `source()` in turn (the panic message for a panic).
    pub chain: Vec<String>,
    /// `std::any::type_name` of the error; `None` for a panic.
    pub error_type: Option<String>,
    /// A panic's backtrace, when one was captured.
    pub backtrace: Option<String>,
}

impl MethodError {
    /// An error known only by its text.
    pub fn message(text: impl Into<String>) -> Self {
        MethodError {
            chain: vec![text.into()],
            error_type: None,
            backtrace: None,
        }
    }

    /// The chain joined as anyhow's `{:#}` prints it.
    pub fn text(&self) -> String {
        self.chain.join(": ")
    }

    /// The error for a failure of `actor.method`.
    pub(crate) fn into_error(self, actor: &str, method: &str) -> Error {
        Error::Task {
            actor: actor.into(),
            method: method.into(),
            message: self.text(),
            chain: self.chain.into(),
            error_type: self.error_type.map(Into::into),
            backtrace: self.backtrace.map(Into::into),
        }
    }
}

/// A failed task, carried in place of a value to every downstream reader (an error frame).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub(crate) struct TaskError {
    pub actor: String,
    pub method: String,
    pub message: String,
    /// The method's own error (chain, type, backtrace), when it is the method that failed.
    pub cause: Option<MethodError>,
}

impl TaskError {
    /// A failure around the method (argument, result, channel), known by its text.
    pub(crate) fn new(
        actor: impl Into<String>,
        method: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        TaskError {
            actor: actor.into(),
            method: method.into(),
            message: message.into(),
            cause: None,
        }
    }

    /// The method itself failed with `cause`.
    pub(crate) fn of_method(actor: &str, method: &str, cause: MethodError) -> Self {
        TaskError {
            actor: actor.into(),
            method: method.into(),
            message: cause.text(),
            cause: Some(cause),
        }
    }
}

impl From<&TaskError> for Error {
    fn from(e: &TaskError) -> Self {
        match &e.cause {
            Some(c) => c.clone().into_error(&e.actor, &e.method),
            None => Error::task(&e.actor, &e.method, &e.message),
        }
    }
}

/// How `#[actor]` turns a method's `Err(e)` into a [`MethodError`], picking the richest
/// description `e`'s type allows without specialization (the autoref trick: the generated
/// code calls the method on `&&&&Wrap(&e)`, and the first impl whose bounds hold wins):
/// 1. `E: std::error::Error`: the error and each `source()`;
/// 2. `E: AsRef<dyn Error + Send + Sync>` (`anyhow::Error`, `Box<dyn Error + Send + Sync>`):
///    the same through the reference;
/// 3. `E: AsRef<dyn Error>` (`Box<dyn Error>`): likewise;
/// 4. any `E: Display`: its text alone.
///
/// Every level records `std::any::type_name::<E>()`.
#[doc(hidden)]
pub mod error_kind {
    use super::MethodError;
    use std::error::Error as StdError;
    use std::fmt::Display;

    /// The method's error, borrowed.
    pub struct Wrap<'a, E>(pub &'a E);

    fn chain_of(e: &dyn StdError) -> Vec<String> {
        let mut chain = vec![e.to_string()];
        let mut next = e.source();
        while let Some(cause) = next {
            let text = cause.to_string();
            // Some errors print their source in their own text too: keep each text once.
            if chain.last().is_none_or(|last| !last.ends_with(&text)) {
                chain.push(text);
            }
            next = cause.source();
        }
        chain
    }

    fn with_type<E>(chain: Vec<String>) -> MethodError {
        MethodError {
            chain,
            error_type: Some(std::any::type_name::<E>().to_string()),
            backtrace: None,
        }
    }

    /// Level 1: a `std::error::Error`.
    pub trait ViaStdError {
        /// The method error.
        fn __adag_method_error(&self) -> MethodError;
    }
    impl<E: StdError> ViaStdError for &&&Wrap<'_, E> {
        fn __adag_method_error(&self) -> MethodError {
            with_type::<E>(chain_of(self.0))
        }
    }

    /// Level 2: a handle to a thread-safe `dyn Error` (anyhow).
    pub trait ViaDynSendError {
        /// The method error.
        fn __adag_method_error(&self) -> MethodError;
    }
    impl<E: AsRef<dyn StdError + Send + Sync + 'static>> ViaDynSendError for &&Wrap<'_, E> {
        fn __adag_method_error(&self) -> MethodError {
            with_type::<E>(chain_of(self.0.as_ref()))
        }
    }

    /// Level 3: a handle to a `dyn Error`.
    pub trait ViaDynError {
        /// The method error.
        fn __adag_method_error(&self) -> MethodError;
    }
    impl<E: AsRef<dyn StdError + 'static>> ViaDynError for &Wrap<'_, E> {
        fn __adag_method_error(&self) -> MethodError {
            with_type::<E>(chain_of(self.0.as_ref()))
        }
    }

    /// Level 4: anything printable.
    pub trait ViaDisplay {
        /// The method error.
        fn __adag_method_error(&self) -> MethodError;
    }
    impl<E: Display> ViaDisplay for Wrap<'_, E> {
        fn __adag_method_error(&self) -> MethodError {
            with_type::<E>(vec![self.0.to_string()])
        }
    }
}
