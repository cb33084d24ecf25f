//! Small frames an actor's network writers hold back to send several in one system call.
//!
//! Under a pipeline of small messages across hosts the system calls are most of the cost: a
//! `sendmsg` on loopback also runs the receiver's TCP stack, about 4 µs of CPU here, against
//! well under 1 µs of the actor's own work per message. An actor that is behind (its next
//! input is already in its reader's buffer) gains most from sending its results in batches,
//! and loses nothing: it will not wait before its next result anyway. See [`Holding`].
use super::{ChanError, Outgoing};
use crate::clock::mono_ns;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::thread::Thread;
use std::time::Duration;

/// Bytes of frames (each at most [`HOLD_FRAME`]) that a connection holds back at most.
pub(super) const HOLD_BYTES: usize = 64 << 10;
/// The largest frame held back: a larger one is worth its own system call.
pub(super) const HOLD_FRAME: usize = 8 << 10;
/// The age of the oldest held frame at which the next write of its connection sends it.
const HOLD_MAX_NS: u64 = 100_000;
/// The age at which the flusher thread sends held frames itself: only reached while the actor
/// is in a long method call (it releases them before any wait of its own).
const FLUSH_AFTER_NS: u64 = 500_000;
/// How often the flusher looks while frames are held, and for how many idle looks it stays
/// awake before it sleeps until the next hold (waking it costs a system call; a look does not
/// show against the batches it saves).
const FLUSH_TICK: Duration = Duration::from_micros(500);
const IDLE_TICKS: u32 = 20;

/// The frames one actor's network writers hold back, and when they leave.
///
/// A writer holds a small frame ([`HOLD_FRAME`] bytes at most) only when the actor's last read
/// found the next message of its channel already whole in its buffer: the actor goes straight
/// on to it, and the frame leaves with the next frames of its connection, in one system call.
/// Held frames leave in order, before anything later on their connection:
/// - before any read that may wait (its next message is not at hand), before every
///   communicator operation, before one-off calls run between executions, and when the
///   schedule stops: nothing stays held while its actor waits, so no peer can wait on a frame
///   held by an actor that waits on that peer;
/// - at the next write of their connection once the actor stops holding, the oldest held
///   frame is [`HOLD_MAX_NS`] old, or [`HOLD_BYTES`] are held;
/// - through a flusher thread of the actor's, once the oldest is [`FLUSH_AFTER_NS`] old: a
///   method call that runs long (or blocks until something downstream happens) never keeps
///   an earlier result from its readers for longer than that.
///
/// The actor's thread does everything but the flusher's sends; the atomics make it shareable
/// with the writers (which are `Send`) and the flusher, and are not contended.
pub(crate) struct Holding {
    /// The last read found the next message of its channel at hand.
    next_here: AtomicBool,
    /// Frames held, over every connection.
    frames: AtomicUsize,
    /// The connections of the writers that hold here.
    conns: parking_lot::Mutex<Vec<Arc<parking_lot::Mutex<Outgoing>>>>,
    /// The flusher thread, started at the first held frame; `None` when it could not start
    /// (then nothing is held).
    flusher: OnceLock<Option<Thread>>,
    /// The flusher sleeps until the next hold (rather than until its next look).
    flusher_sleeps: AtomicBool,
    /// [`HOLD_MAX_NS`] and [`FLUSH_AFTER_NS`] (other values only in tests).
    hold_max_ns: u64,
    flush_after_ns: u64,
}

impl Default for Holding {
    fn default() -> Self {
        Holding::with_limits(HOLD_MAX_NS, FLUSH_AFTER_NS)
    }
}

impl Holding {
    fn with_limits(hold_max_ns: u64, flush_after_ns: u64) -> Self {
        Holding {
            next_here: AtomicBool::new(false),
            frames: AtomicUsize::new(0),
            conns: parking_lot::Mutex::new(Vec::new()),
            flusher: OnceLock::new(),
            flusher_sleeps: AtomicBool::new(false),
            hold_max_ns,
            flush_after_ns,
        }
    }

    /// A holding whose frames leave by age only after `hold_max` (at a write) and `flush_after`
    /// (by the flusher).
    #[cfg(all(test, not(loom)))]
    pub(super) fn lasting(hold_max: Duration, flush_after: Duration) -> Self {
        Holding::with_limits(hold_max.as_nanos() as u64, flush_after.as_nanos() as u64)
    }

    /// The age of the oldest held frame at which the next write of its connection sends it.
    pub(super) fn hold_max_ns(&self) -> u64 {
        self.hold_max_ns
    }

    /// Frames held now, over every connection.
    #[cfg(all(test, not(loom)))]
    pub(super) fn held(&self) -> usize {
        self.frames.load(Ordering::SeqCst)
    }

    /// Whether a writer may hold a frame now.
    pub(super) fn holds(&self) -> bool {
        self.next_here.load(Ordering::Relaxed) && self.flusher.get().is_none_or(|f| f.is_some())
    }

    /// What the actor's read just found: whether the next message of that channel is whole
    /// at hand (the actor will not wait for it).
    pub(crate) fn note_read(&self, next_here: bool) {
        self.next_here.store(next_here, Ordering::Relaxed);
    }

    /// Sends every held frame (the actor may wait next).
    pub(crate) fn release(&self) -> Result<(), ChanError> {
        if self.frames.load(Ordering::Relaxed) == 0 {
            return Ok(());
        }
        for out in self.conns.lock().iter() {
            out.lock().release(self)?;
        }
        Ok(())
    }

    /// `out` is the connection of a writer that holds here.
    pub(super) fn register(&self, out: Arc<parking_lot::Mutex<Outgoing>>) {
        self.conns.lock().push(out);
    }

    /// A writer held one more frame.
    pub(super) fn held_one(self: &Arc<Self>) {
        // SeqCst, with the flusher's going to sleep: either it sees this frame, or this sees
        // it asleep.
        if self.frames.fetch_add(1, Ordering::SeqCst) > 0 {
            return;
        }
        let flusher = self.flusher.get_or_init(|| self.start_flusher());
        // A flusher between two looks needs no wake-up (which would cost a system call and
        // a switch to its thread on every batch).
        if let Some(flusher) = flusher
            && self.flusher_sleeps.load(Ordering::SeqCst)
        {
            flusher.unpark();
        }
    }

    /// `n` held frames left (sent, or handed to the connection's backlog).
    pub(super) fn left(&self, n: usize) {
        self.frames.fetch_sub(n, Ordering::Relaxed);
    }

    fn start_flusher(self: &Arc<Self>) -> Option<Thread> {
        let holding = Arc::downgrade(self);
        match std::thread::Builder::new()
            .name("adag-net-flush".into())
            .spawn(move || flush_stale_frames(holding))
        {
            Ok(handle) => Some(handle.thread().clone()),
            Err(e) => {
                tracing::warn!(error = %e, "no thread to flush held frames: frames are sent one by one");
                None
            }
        }
    }

    /// Sends the frames held for `older_than_ns` or longer, on connections the actor is not
    /// using right now; whether frames are still held. A failed send is reported by the next
    /// write of its connection.
    fn flush_older_than(&self, older_than_ns: u64) -> bool {
        if self.frames.load(Ordering::Relaxed) == 0 {
            return false;
        }
        let now = mono_ns();
        for out in self.conns.lock().iter() {
            // The actor holds the lock only while it writes, and then sends what is held.
            let Some(mut out) = out.try_lock() else {
                continue;
            };
            if out.held_frames > 0
                && now.saturating_sub(out.held_since) >= older_than_ns
                && let Err(e) = out.release(self)
            {
                out.failed = Some(e);
            }
        }
        self.frames.load(Ordering::Relaxed) > 0
    }
}

impl Drop for Holding {
    fn drop(&mut self) {
        // The flusher sees the holding gone at its next look: wake it for that look.
        if let Some(Some(flusher)) = self.flusher.get() {
            flusher.unpark();
        }
    }
}

/// The flusher's loop: looks every [`FLUSH_TICK`] while frames are held (or were lately),
/// sleeps until the next hold otherwise, and ends with its holding.
fn flush_stale_frames(holding: Weak<Holding>) {
    let mut idle = 0;
    loop {
        let Some(h) = holding.upgrade() else {
            return;
        };
        let held = h.flush_older_than(h.flush_after_ns);
        drop(h);
        if held {
            idle = 0;
        } else {
            idle += 1;
        }
        if idle <= IDLE_TICKS {
            std::thread::park_timeout(FLUSH_TICK);
            continue;
        }
        let Some(h) = holding.upgrade() else {
            return;
        };
        h.flusher_sleeps.store(true, Ordering::SeqCst);
        let asleep = h.frames.load(Ordering::SeqCst) == 0;
        drop(h);
        if asleep {
            std::thread::park();
        }
        if let Some(h) = holding.upgrade() {
            h.flusher_sleeps.store(false, Ordering::SeqCst);
        }
        idle = 0;
    }
}
