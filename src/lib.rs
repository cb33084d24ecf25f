//! adag: compiled actor graphs for Rust.
#![deny(unsafe_op_in_unsafe_fn)]

pub(crate) mod sync;
pub mod channel;
