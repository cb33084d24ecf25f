//! Synchronisation primitives of the channel code, switchable to [loom].
//!
//! Like tokio's `src/loom`, every atomic, cell, lock, `Arc` and thread that the ring protocol
//! touches comes from here: from `std` in normal builds and from `loom` when the crate is
//! built with `RUSTFLAGS="--cfg loom"`, so the same code is model-checked unchanged.
//!
//! [loom]: https://docs.rs/loom

#[cfg(loom)]
pub(crate) use loom::cell::UnsafeCell;
#[cfg(loom)]
pub(crate) use loom::{
    sync::Arc,
    sync::atomic::{AtomicU32, AtomicU64, Ordering, fence},
    thread,
};

#[cfg(not(loom))]
pub(crate) use self::std_impl::UnsafeCell;
#[cfg(not(loom))]
pub(crate) use std::{
    sync::Arc,
    sync::atomic::{AtomicU32, AtomicU64, Ordering, fence},
    thread,
};

#[cfg(not(loom))]
mod std_impl {
    /// `std::cell::UnsafeCell` with loom's closure API (`with`, `with_mut`), so that code using
    /// it can be checked by loom, which tracks every access to the cell: the slots of the
    /// in-process ring and the ring tests' slot contents.
    #[derive(Debug, Default)]
    pub(crate) struct UnsafeCell<T>(std::cell::UnsafeCell<T>);

    impl<T> UnsafeCell<T> {
        pub(crate) const fn new(value: T) -> Self {
            Self(std::cell::UnsafeCell::new(value))
        }

        /// Runs `f` with a shared pointer to the value.
        pub(crate) fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
            f(self.0.get())
        }

        /// Runs `f` with a mutable pointer to the value.
        pub(crate) fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
            f(self.0.get())
        }
    }
}

/// An asymmetric fence for a Dekker-style handshake between a frequent, cheap side and a rare,
/// paying one (as liburcu and folly do): the notifier of a wait, which runs on every message
/// and almost never finds a waiter, uses [`light`] (a compiler fence) between its change of
/// state and its look at the waiters; the waiter, between its registration and its look at
/// the state, uses [`heavy`]: `membarrier(PRIVATE_EXPEDITED)`, which makes every running
/// thread of this process execute a full memory barrier, so that either the notifier's look
/// comes after it and sees the registration, or its change, made before its look, is visible
/// to the waiter. Where the kernel refuses `membarrier`, both sides are `SeqCst` fences.
///
/// In-process only: threads of another process are not made to fence, so a notifier in
/// another process (a shared-memory channel's peer) must use a `SeqCst` fence. Not switched to
/// loom (which cannot model `membarrier`): code checked by loom uses a `SeqCst` fence on both
/// sides under `cfg(loom)` instead.
pub(crate) mod asymmetric_fence {
    use rustix::thread::{MembarrierCommand, membarrier, membarrier_query};
    use std::sync::OnceLock;
    use std::sync::atomic::{Ordering, compiler_fence, fence};

    /// Whether `membarrier(PRIVATE_EXPEDITED)` works in this process (registered once).
    fn expedited() -> bool {
        static READY: OnceLock<bool> = OnceLock::new();
        *READY.get_or_init(|| {
            membarrier_query().contains_command(MembarrierCommand::PrivateExpedited)
                && membarrier(MembarrierCommand::RegisterPrivateExpedited).is_ok()
        })
    }

    /// The notifier's side: between its change of the state and its look at the waiters.
    #[inline]
    pub(crate) fn light() {
        if expedited() {
            compiler_fence(Ordering::SeqCst);
        } else {
            fence(Ordering::SeqCst);
        }
    }

    /// The waiter's side: between its registration and its look at the state.
    pub(crate) fn heavy() {
        if !expedited() || membarrier(MembarrierCommand::PrivateExpedited).is_err() {
            // Refused after a successful registration (not seen): the waiter's own fence
            // still orders its side, and its sleeps are sliced, so a notification missed
            // costs at most one slice.
            fence(Ordering::SeqCst);
        }
    }
}
