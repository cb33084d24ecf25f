//! Channels: one per edge of a compiled graph.
pub(crate) mod endpoint;
#[cfg(all(test, not(loom)))]
mod frame_tests;
#[cfg(all(test, loom))]
mod loom_tests;
pub(crate) mod oob;
pub(crate) mod ring;
pub(crate) mod shm;
pub(crate) mod wait;
