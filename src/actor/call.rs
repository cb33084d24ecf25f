//! One-off calls to an actor (`handle.call().method(args)`), whatever its placement: the
//! caller's claim on a queued call, the count of queued calls an actor's loop looks at between
//! executions, the read that gives way to them, and the encoding and errors of a call that
//! crosses a process.
use crate::channel::wait::SpinPolicy;
use crate::channel::{ChanError, Msg, Reader};
use crate::error::{Error, MethodError, Result};
use crate::value::Value;
use crossbeam_channel::{Receiver, TryRecvError};
use std::cell::{Cell, OnceCell};
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// How long a one-off call waits for the actor to take it. An actor running a graph takes
/// calls between two executions of its schedule, and an idle one within [`CALL_POLL`]; one
/// that has not taken the call by then is stuck inside a method, and the call is withdrawn
/// (unrun) with `ActorBusy`.
pub(crate) const BUSY_AFTER: Duration = Duration::from_secs(2);

/// While an actor's loop waits for the next execution (its schedule's first read), it looks
/// for queued one-off calls this often: the longest an idle actor keeps a call waiting. Only
/// that idle wait is cut in slices; a read that finds its message at once, as in a busy
/// pipeline, reads no flag but one thread-local and makes no syscall.
pub(crate) const CALL_POLL: Duration = Duration::from_millis(20);

/// One-off calls queued for an actor's thread: the caller counts its call in before sending
/// it, the thread counts it out when it takes it off the queue. The graph loop reads this
/// counter once per execution (one relaxed load): no syscall, no wake-up.
#[derive(Default)]
pub(crate) struct Calls(AtomicUsize);

impl Calls {
    pub(crate) fn queued(&self) {
        self.0.fetch_add(1, Ordering::Release);
    }
    pub(crate) fn taken(&self) {
        self.0.fetch_sub(1, Ordering::Release);
    }
    pub(crate) fn any(&self) -> bool {
        self.0.load(Ordering::Acquire) > 0
    }
}

/// Who gets a queued call: the actor's thread (it runs it) or the caller (it gave up on a
/// stuck actor): whichever comes first, so that a withdrawn call never runs.
#[derive(Default)]
pub(crate) struct CallClaim(AtomicU8);

impl CallClaim {
    const QUEUED: u8 = 0;
    const TAKEN: u8 = 1;
    const WITHDRAWN: u8 = 2;
    pub(crate) fn take(&self) -> bool {
        self.0
            .compare_exchange(
                Self::QUEUED,
                Self::TAKEN,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok()
    }
    /// Withdraws the call unless the actor took it already.
    pub(crate) fn cancel(&self) -> bool {
        self.0
            .compare_exchange(
                Self::QUEUED,
                Self::WITHDRAWN,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok()
    }
}

/// Why a one-off call did not return a value.
#[derive(Debug)]
pub(crate) enum CallFailure {
    NoSuchMethod,
    BadArgs(String),
    Task(MethodError),
    /// The actor did not take the call within [`BUSY_AFTER`]: it is
    /// stuck inside a method; the call was withdrawn without running.
    Busy,
}

thread_local! {
    /// The queued calls of the actor whose loop runs on this thread.
    static HOST_CALLS: OnceCell<Arc<Calls>> = const { OnceCell::new() };
}

/// Where a schedule's loop stands between two executions, shared by the loop and the
/// schedule's read operations (one per installed schedule, on the actor's thread; not a
/// thread-local, which the Python extension looks up through the dynamic loader on every
/// execution).
#[derive(Debug, Default)]
pub(crate) struct Between {
    /// Set while the schedule's first operation runs: a read there is waiting *between* two
    /// executions, where a one-off call may run.
    first_running: Cell<bool>,
    /// Set by a read that gave up its wait between two executions for a one-off call.
    interrupted: Cell<bool>,
}

/// The read operation of a schedule. Between two executions (the schedule's first operation)
/// it waits in [`CALL_POLL`] slices and gives up (`Timeout`, which the loop takes as "serve the
/// calls, then start the execution again") when a one-off call is queued; elsewhere it waits
/// for its message as any read.
pub(crate) fn read_between<T>(
    between: &Between,
    reader: &mut Reader<T>,
) -> Result<Msg<T>, ChanError> {
    if !between.first_running.get() {
        return reader.read(None);
    }
    loop {
        match reader.read(Some(Instant::now() + CALL_POLL)) {
            Err(ChanError::Timeout) => {
                if HOST_CALLS.with(|c| c.get().is_some_and(|c| c.any())) {
                    between.interrupted.set(true);
                    return Err(ChanError::Timeout);
                }
            }
            r => return r,
        }
    }
}

/// Runs an operation of the schedule; when it is the first (`first`), its read may give up
/// waiting for the next execution so that a queued one-off call runs: that is `None`, and
/// nothing of the next execution was read.
pub(crate) fn between(
    state: &Between,
    first: bool,
    run: impl FnOnce() -> Result<(), ChanError>,
) -> Option<Result<(), ChanError>> {
    if !first {
        return Some(run());
    }
    state.first_running.set(true);
    let r = run();
    state.first_running.set(false);
    if matches!(r, Err(ChanError::Timeout)) && state.interrupted.replace(false) {
        None
    } else {
        Some(r)
    }
}

/// Serve the calls counted in `calls` from this thread's actor loop (see [`read_between`]).
pub(crate) fn serve_calls_here(calls: Arc<Calls>) {
    HOST_CALLS.with(|c| {
        let _ = c.set(calls);
    });
}

/// The calls queued for the actor whose loop runs on this thread.
pub(crate) fn calls_here() -> Option<Arc<Calls>> {
    HOST_CALLS.with(|c| c.get().cloned())
}

/// The arguments of a one-off call to an actor in another process.
pub(crate) fn encode_args<Args: Value>(actor: &str, method: &str, args: &Args) -> Result<Vec<u8>> {
    crate::value::encode(args).map_err(|e| Error::Call {
        actor: actor.to_string(),
        method: method.to_string(),
        message: format!("cannot encode the arguments: {e}"),
    })
}

/// The result of a one-off call to an actor in another process; `stale` says where a type
/// mismatch most likely comes from.
pub(crate) fn decode_result<R: Value>(
    actor: &str,
    method: &str,
    bytes: &[u8],
    stale: &str,
) -> Result<R> {
    crate::value::decode::<R>(bytes).map_err(|e| Error::Codec {
        op: "decode",
        ty: std::any::type_name::<R>().into(),
        place: format!("the result of {actor}.{method}"),
        message: format!("{e}; {stale}"),
    })
}

pub(crate) fn call_failure(actor: &str, method: &str, failure: CallFailure) -> Error {
    match failure {
        CallFailure::Task(cause) => cause.into_error(actor, method),
        CallFailure::NoSuchMethod => Error::Call {
            actor: actor.to_string(),
            method: method.to_string(),
            message: "the actor has no such method; check the name against its #[actor] impl"
                .into(),
        },
        CallFailure::BadArgs(message) => Error::Call {
            actor: actor.to_string(),
            method: method.to_string(),
            message,
        },
        // The graph's id is filled in by the handle, which knows it.
        CallFailure::Busy => Error::ActorBusy {
            actor: actor.to_string(),
            graph: 0,
        },
    }
}

/// Polls `rx` while `policy` spins (the channels' spin → yield phases): `Ok(Some(message))`
/// when one came, `Ok(None)` when the spin budget ran out first (the caller blocks now),
/// `Err(())` when the sender is gone. Both ends of a one-off call to a thread actor spin
/// first: a thread blocked in `recv` and woken from the other core costs ~80 µs on the
/// target machines (2 vCPUs, measured), and a call had two of them.
pub(crate) fn recv_spinning<T>(rx: &Receiver<T>, policy: &mut SpinPolicy) -> Result<Option<T>, ()> {
    let mut got = None;
    policy.idle(|| match rx.try_recv() {
        Ok(message) => {
            got = Some(message);
            Ok(true)
        }
        Err(TryRecvError::Empty) => Ok(false),
        Err(TryRecvError::Disconnected) => Err(()),
    })?;
    Ok(got)
}
