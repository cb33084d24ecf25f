//! The options of compilation, with Ray's defaults.
use std::time::Duration;

/// Which communicator serves tensor edges and collectives that name none of their own
/// (Ray's `_default_communicator`). See `docs/communicators.md`.
#[derive(Clone, Default)]
pub enum DefaultCommunicator {
    /// Make one group per set of actors of a collective, reusing one already made for the
    /// same set; a point-to-point communicator edge reuses a collective's group whose actors
    /// are a superset of its ends, else the remaining edges share one new group. Groups are
    /// CPU groups, or NCCL ones when every member is on a CUDA device (and the NCCL crate is
    /// linked).
    #[default]
    Create,
    /// Make none: an edge or collective without its own communicator is a compile error
    /// naming it.
    None,
    /// The user's own group, bound to its actors: the communicator of every point-to-point
    /// edge and every collective that names none (a collective's actors must then be exactly
    /// the group's; an edge's writer and readers must be members). It reaches thread actors
    /// through [`CommunicatorGroup::communicator`](crate::comm::CommunicatorGroup::communicator)
    /// and process actors through its ticket and descriptors.
    Custom(crate::dag::CustomCommunicator),
}

impl std::fmt::Debug for DefaultCommunicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DefaultCommunicator::Create => f.write_str("Create"),
            DefaultCommunicator::None => f.write_str("None"),
            DefaultCommunicator::Custom(c) => write!(f, "Custom({c:?})"),
        }
    }
}

/// The options of [`Dag::compile`](crate::Dag::compile). Every option of Ray's
/// `experimental_compile` has a field here; the defaults are Ray's.
///
/// `compile` checks every field against the range its documentation gives (also available
/// as [`CompileOptions::validate`]) and fails with [`Error::Config`](crate::Error::Config)
/// naming the option, the value and the range, before anything is claimed or spawned.
///
/// ```
/// use adag::CompileOptions;
/// use std::time::Duration;
/// let opts = CompileOptions::default()
///     .max_inflight_executions(4)
///     .submit_timeout(Duration::from_secs(1));
/// assert_eq!(opts.max_inflight_executions, 4);
/// assert_eq!(opts.buffer_size_bytes, 1_000_000);
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct CompileOptions {
    /// Longest time `execute` may block for room in an input channel (default 10 s).
    /// Any value: `Duration::ZERO` fails at once when there is no room; `Duration::MAX`
    /// waits for ever.
    pub submit_timeout: Duration,
    /// Default deadline of `get` (default 10 s; `get_timeout` overrides it per call).
    /// Any value: `Duration::ZERO` takes a result only if it is already there;
    /// `Duration::MAX` waits for ever.
    pub get_timeout: Duration,
    /// Initial capacity of each channel slot in bytes (default 1 MB); larger messages grow
    /// the channel automatically up to `max_message_bytes`. Must be at least 1 and at most
    /// `max_message_bytes` (a slot larger than the largest message allowed is never used).
    pub buffer_size_bytes: usize,
    /// Hard ceiling of one message (default 1 GiB): larger ones fail with
    /// [`Error::MessageTooLarge`](crate::Error::MessageTooLarge). Must be at least 1 and at
    /// least `buffer_size_bytes`.
    pub max_message_bytes: usize,
    /// Drive the graph from async code (`execute_async`). Either value.
    pub enable_asyncio: bool,
    /// Executions submitted but not yet read (default 10); sizes every channel ring. Must be
    /// 1 to 65,536: with 0 nothing could be submitted, and every channel holds this many
    /// slots.
    pub max_inflight_executions: usize,
    /// Results read but not yet claimed by their ref (default 1000). Must be at least 1: the
    /// driver files each result it reads here until its ref claims it, so with 0 an async
    /// graph could never deliver one.
    pub max_buffered_results: usize,
    /// Overlap communication of one execution with compute of the next. Either value.
    pub overlap_gpu_communication: bool,
    /// The communicator for tensor edges and collectives that name none. Any value; a
    /// `Custom` group's members are checked against the graph when it compiles.
    pub default_communicator: DefaultCommunicator,
    /// How long a waiting thread spins before it sleeps (default 50 µs). At most 1 s:
    /// spinning longer only burns a core that sleeping would free; `Duration::ZERO` sleeps
    /// at once.
    pub spin: Duration,
    /// How long teardown waits for each actor's loop to stop (default 5 s); a worker process
    /// still running then is killed. At most one day, so that teardown always ends;
    /// `Duration::ZERO` kills a worker whose loop has not stopped at once.
    pub teardown_timeout: Duration,
    /// Record every operation of every actor for
    /// [`CompiledGraph::timeline`](crate::CompiledGraph::timeline) (default off; the
    /// environment variable `ADAG_TIMELINE=path` turns it on for every graph and writes the
    /// JSON at teardown). See `docs/observability.md`.
    pub timeline: bool,
}

impl Default for CompileOptions {
    fn default() -> Self {
        CompileOptions {
            submit_timeout: Duration::from_secs(10),
            get_timeout: Duration::from_secs(10),
            buffer_size_bytes: 1_000_000,
            max_message_bytes: 1 << 30,
            enable_asyncio: false,
            max_inflight_executions: 10,
            max_buffered_results: 1000,
            overlap_gpu_communication: false,
            default_communicator: DefaultCommunicator::Create,
            spin: Duration::from_micros(50),
            teardown_timeout: Duration::from_secs(5),
            timeline: false,
        }
    }
}

/// The largest `max_inflight_executions` allowed.
pub const MAX_INFLIGHT_EXECUTIONS: usize = 1 << 16;
/// The longest `spin` allowed.
pub const MAX_SPIN: Duration = Duration::from_secs(1);
/// The longest `teardown_timeout` allowed.
pub const MAX_TEARDOWN_TIMEOUT: Duration = Duration::from_secs(24 * 3600);

impl CompileOptions {
    /// Check every field against its documented range; the first one out of range is an
    /// [`Error::Config`](crate::Error::Config) naming it, its value and the range.
    /// `Dag::compile` calls this first.
    ///
    /// ```
    /// use adag::{CompileOptions, Error};
    /// let e = CompileOptions::default().max_buffered_results(0).validate().unwrap_err();
    /// assert!(matches!(e, Error::Config { option: "max_buffered_results", .. }));
    /// ```
    pub fn validate(&self) -> crate::Result<()> {
        use crate::Error;
        if !(1..=MAX_INFLIGHT_EXECUTIONS).contains(&self.max_inflight_executions) {
            return Err(Error::config(
                "max_inflight_executions",
                self.max_inflight_executions,
                format!("between 1 and {MAX_INFLIGHT_EXECUTIONS}"),
            ));
        }
        if self.max_buffered_results < 1 {
            return Err(Error::config(
                "max_buffered_results",
                self.max_buffered_results,
                "at least 1 (results are filed there until their ref claims them)",
            ));
        }
        if self.max_message_bytes < 1 {
            return Err(Error::config(
                "max_message_bytes",
                self.max_message_bytes,
                "at least 1",
            ));
        }
        if !(1..=self.max_message_bytes).contains(&self.buffer_size_bytes) {
            return Err(Error::config(
                "buffer_size_bytes",
                self.buffer_size_bytes,
                format!(
                    "between 1 and max_message_bytes ({}); raise max_message_bytes too for larger slots",
                    self.max_message_bytes
                ),
            ));
        }
        if self.spin > MAX_SPIN {
            return Err(Error::config(
                "spin",
                self.spin,
                format!("at most {MAX_SPIN:?}"),
            ));
        }
        if self.teardown_timeout > MAX_TEARDOWN_TIMEOUT {
            return Err(Error::config(
                "teardown_timeout",
                self.teardown_timeout,
                format!("at most {MAX_TEARDOWN_TIMEOUT:?} (teardown always ends)"),
            ));
        }
        // submit_timeout, get_timeout: every value has a meaning (ZERO: try once, MAX: for
        // ever); enable_asyncio, overlap_gpu_communication: either value;
        // default_communicator: checked against the graph by the communicator plan.
        Ok(())
    }
}

macro_rules! setters {
    ($($(#[$doc:meta])* $name:ident: $ty:ty),* $(,)?) => {
        impl CompileOptions {
            $($(#[$doc])* pub fn $name(mut self, value: $ty) -> Self {
                self.$name = value;
                self
            })*
        }
    };
}

setters! {
    /// Set [`CompileOptions::submit_timeout`].
    submit_timeout: Duration,
    /// Set [`CompileOptions::get_timeout`].
    get_timeout: Duration,
    /// Set [`CompileOptions::buffer_size_bytes`].
    buffer_size_bytes: usize,
    /// Set [`CompileOptions::max_message_bytes`].
    max_message_bytes: usize,
    /// Set [`CompileOptions::enable_asyncio`].
    enable_asyncio: bool,
    /// Set [`CompileOptions::max_inflight_executions`].
    max_inflight_executions: usize,
    /// Set [`CompileOptions::max_buffered_results`].
    max_buffered_results: usize,
    /// Set [`CompileOptions::overlap_gpu_communication`].
    overlap_gpu_communication: bool,
    /// Set [`CompileOptions::default_communicator`].
    default_communicator: DefaultCommunicator,
    /// Set [`CompileOptions::spin`].
    spin: Duration,
    /// Set [`CompileOptions::teardown_timeout`].
    teardown_timeout: Duration,
    /// Set [`CompileOptions::timeline`].
    timeline: bool,
}

/// Timeouts from this long on count from the coarse clock ([`crate::clock::coarse_deadline`]):
/// a few ms late at most, under 1%, for a clock read a fifth of the cost.
const COARSE_FROM: Duration = Duration::from_secs(1);

/// A deadline `d` from now, where `Duration::MAX` (or an overflow) means none. Never early; a
/// deadline a second or more away may be a few ms late.
pub(crate) fn deadline_after(d: std::time::Duration) -> Option<std::time::Instant> {
    if d == Duration::MAX {
        None
    } else if d >= COARSE_FROM {
        crate::clock::coarse_deadline(d)
    } else {
        std::time::Instant::now().checked_add(d)
    }
}
