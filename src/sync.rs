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
