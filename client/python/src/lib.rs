//! The `kvix._kvix` extension module: kvix-client for Python.
//!
//! Everything about the protocol stays in Rust: this module only converts arguments
//! and results. One tokio runtime per process (one I/O thread, `kvix-client-io`)
//! runs every client's connections; a blocking call runs its future on the calling
//! thread with the GIL released, an async call returns a future of the caller's event
//! loop that the I/O thread completes through a [`completer::Completer`] without taking
//! the GIL. The public classes (`kvix.Client`, `kvix.AsyncClient`) are thin
//! Python wrappers in `python/kvix/__init__.py`.

use std::sync::OnceLock;

use pyo3::prelude::*;
use tokio::runtime::Runtime;

mod args;
mod completer;
mod core;
mod errors;
mod results;

#[pymodule]
fn _kvix(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<core::Core>()?;
    m.add_class::<completer::Completer>()?;
    m.add_class::<results::Score>()?;
    m.add_class::<results::QueryResult>()?;
    m.add_class::<results::Stats>()?;
    m.add_class::<args::Keyspace>()?;
    m.add_class::<args::EventSource>()?;
    errors::register(m)?;
    Ok(())
}

/// The process's I/O runtime, started on first use. (A process that forks after using
/// it has no I/O thread in the child: make clients after forking.)
pub fn runtime() -> PyResult<&'static Runtime> {
    static RT: OnceLock<Runtime> = OnceLock::new();
    if let Some(rt) = RT.get() {
        return Ok(rt);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("kvix-client-io")
        .enable_all()
        .build()?;
    Ok(RT.get_or_init(|| rt))
}
