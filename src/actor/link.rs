//! How the driver reaches an actor: a thread of its own process, a worker process, or a worker
//! on another host; one-off calls, kill and pid, whatever the placement.
use super::call::{BUSY_AFTER, CallClaim, CallFailure, Calls, call_failure, recv_spinning};
use super::host::Control;
use super::remote::RemoteLink;
use super::worker::ProcessLink;
use crate::channel::wait::{DEFAULT_SPIN, SpinPolicy};
use crate::error::{Error, Result};
use crate::value::Value;
use crossbeam_channel::{RecvTimeoutError, Sender};
use std::sync::Arc;

/// How the driver reaches an actor.
pub(crate) enum ActorLink {
    Thread(ThreadLink),
    Process(ProcessLink),
    /// A worker process on another host, reached through that host's agent.
    Remote(RemoteLink),
}

/// Dropping the link closes the control channel, which ends the host loop; the thread is
/// detached, so the last handle's drop never blocks on a busy actor.
pub(crate) struct ThreadLink {
    pub(crate) control: Sender<Control>,
    pub(crate) calls: Arc<Calls>,
}

impl ActorLink {
    pub(crate) fn call<Args: Value, R: Value>(
        &self,
        actor: &str,
        method: &str,
        args: Args,
    ) -> Result<R> {
        match self {
            ActorLink::Thread(link) => {
                let (reply, rx) = crossbeam_channel::bounded(1);
                let gone = || Error::Call {
                    actor: actor.to_string(),
                    method: method.to_string(),
                    message: "the actor's thread has stopped".into(),
                };
                let claim = Arc::new(CallClaim::default());
                link.calls.queued();
                link.control
                    .send(Control::Call {
                        method: method.to_string(),
                        args: Box::new(args),
                        reply,
                        claim: claim.clone(),
                    })
                    .map_err(|_| gone())?;
                let reply = match recv_spinning(&rx, &mut SpinPolicy::new(DEFAULT_SPIN)) {
                    Ok(Some(r)) => Ok(r),
                    Ok(None) => rx.recv_timeout(BUSY_AFTER),
                    Err(()) => Err(RecvTimeoutError::Disconnected),
                };
                let reply = match reply {
                    Ok(r) => r,
                    Err(RecvTimeoutError::Timeout) if claim.cancel() => Err(CallFailure::Busy),
                    // Taken just now: it runs; wait for it.
                    Err(RecvTimeoutError::Timeout) => rx.recv().map_err(|_| gone())?,
                    Err(RecvTimeoutError::Disconnected) => return Err(gone()),
                };
                let value = reply.map_err(|f| call_failure(actor, method, f))?;
                value.downcast::<R>().map(|b| *b).map_err(|_| Error::Call {
                    actor: actor.to_string(),
                    method: method.to_string(),
                    message: format!("the method does not return {}", std::any::type_name::<R>()),
                })
            }
            ActorLink::Process(link) => link.call::<Args, R>(actor, method, args),
            ActorLink::Remote(link) => link.call::<Args, R>(actor, method, args),
        }
    }

    pub(crate) fn kill(&self, actor: &str) -> Result<()> {
        match self {
            ActorLink::Thread(_) => Err(Error::Call {
                actor: actor.to_string(),
                method: "kill".into(),
                message: "a thread actor cannot be killed; only process actors can".into(),
            }),
            ActorLink::Process(link) => link.kill(),
            ActorLink::Remote(link) => link.kill(),
        }
    }

    pub(crate) fn pid(&self) -> Option<u32> {
        match self {
            ActorLink::Thread(_) => None,
            ActorLink::Process(link) => Some(link.pid()),
            ActorLink::Remote(link) => Some(link.pid()),
        }
    }
}
