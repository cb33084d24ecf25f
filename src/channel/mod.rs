//! Channels: one per edge of a compiled graph.
pub(crate) mod endpoint;
pub(crate) mod ring;
pub(crate) mod shm;
pub(crate) mod wait;
