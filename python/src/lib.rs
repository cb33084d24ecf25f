//! `adag._native`: the extension module of the Python package `adag` (Ray Compiled Graphs'
//! API, backed by adag). The Python side (`adag/*.py`) describes graphs and wraps this module;
//! see `docs/python.md`.
//!
//! A Python actor is one Rust actor type, [`actor::PyActor`], in a worker process started as
//! `python -c "import adag._native as m; m._worker_main()"` (see
//! [`adag::set_worker_command`]); values travel as [`value::PyValue`]s: pickle protocol 5
//! with out-of-band buffers read in place from shared memory (numpy arrays and torch tensors
//! as their bytes).
#![deny(unsafe_op_in_unsafe_fn)]

pub mod actor;
pub mod driver;
pub mod value;

use pyo3::prelude::*;

/// Enter the worker loop when this interpreter was started as an adag worker; never returns
/// then. Returns at once in any other process.
#[pyfunction]
fn _worker_main(py: Python<'_>) {
    py.allow_threads(adag::init);
}

/// Run this process as a host's agent (`ADAG_JOIN`, `ADAG_TOKEN` in its environment) until
/// the driver leaves; its exit status, or `None` when the environment does not say to join.
/// The GIL is released throughout.
#[pyfunction]
fn _run_agent(py: Python<'_>) -> Option<i32> {
    py.allow_threads(adag::run_agent)
}

/// Start worker processes with `program args..` (the driver calls it once, with its own
/// interpreter).
#[pyfunction]
fn _set_worker_command(program: String, args: Vec<String>) {
    adag::set_worker_command(Some((program.into(), args)));
}

/// The extension module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(_worker_main, m)?)?;
    m.add_function(wrap_pyfunction!(_set_worker_command, m)?)?;
    m.add_function(wrap_pyfunction!(_run_agent, m)?)?;
    m.add_function(wrap_pyfunction!(driver::spawn, m)?)?;
    m.add_function(wrap_pyfunction!(driver::get, m)?)?;
    m.add_function(wrap_pyfunction!(driver::listen, m)?)?;
    m.add_function(wrap_pyfunction!(driver::hosts, m)?)?;
    m.add_function(wrap_pyfunction!(driver::all_hosts, m)?)?;
    m.add_function(wrap_pyfunction!(driver::wait_for_hosts, m)?)?;
    m.add_class::<driver::NativeActor>()?;
    m.add_class::<driver::NativeGraph>()?;
    m.add_class::<driver::CompiledDAGRef>()?;
    m.add_class::<value::ShmBuffer>()?;
    m.add_class::<value::OutputBuffer>()?;
    m.add_function(wrap_pyfunction!(value::output_buffer, m)?)?;
    m.add_function(wrap_pyfunction!(value::tensor_bytes, m)?)?;
    Ok(())
}
