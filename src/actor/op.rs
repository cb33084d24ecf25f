//! The unit of an installed schedule: one operation (a read, a method's compute, a write, a
//! communicator's send, receive or collective, or one stage of these), which the actor's loop
//! runs in the schedule's order on the actor itself.
use crate::channel::ChanError;

/// One operation of an installed schedule.
pub(crate) type Op<A> = Box<dyn FnMut(&mut A) -> Result<(), ChanError>>;
