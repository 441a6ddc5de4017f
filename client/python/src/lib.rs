//! The `kvix._kvix` extension module: kvix-client for Python.
//!
//! Everything about the protocol stays in Rust: this module only converts arguments
//! and results. One tokio runtime per process (one I/O thread, `kvix-client-io`)
//! runs every client's connections; a blocking call runs its future on the calling
//! thread with the GIL released, an async call returns a future of the caller's event
//! loop that the I/O thread completes through a [`completer::Completer`] without taking
//! the GIL. The public classes (`kvix.Client`, `kvix.AsyncClient`) are thin
//! Python wrappers in `python/kvix/__init__.py`.
//!
//! Forks: a client made before `fork` raises `KvixError` in the child at its first
//! call (its connections and I/O thread stay with the parent); a client made in the
//! child works (the child starts its own runtime).

use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};
use std::sync::Mutex;

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
    m.add_class::<results::Pick>()?;
    m.add_function(pyo3::wrap_pyfunction!(results::pick, m)?)?;
    m.add_class::<args::Keyspace>()?;
    m.add_class::<args::EventSource>()?;
    errors::register(m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    static AT_FORK: std::sync::Once = std::sync::Once::new();
    // SAFETY: the handler only bumps an atomic, which is async-signal-safe.
    AT_FORK.call_once(|| unsafe {
        libc::pthread_atfork(None, None, Some(forked_child));
    });
    Ok(())
}

/// Forks this process descends through: bumped in each child by a `pthread_atfork`
/// handler (`os.fork()`, multiprocessing's fork, gunicorn's `--preload` workers). A
/// runtime or a client of an earlier generation is the parent's: its I/O thread does
/// not exist in the child, and its sockets and epoll instance are the parent's too.
static FORKS: AtomicU64 = AtomicU64::new(0);

extern "C" fn forked_child() {
    FORKS.fetch_add(1, Ordering::Relaxed);
}

/// This process's fork generation ([`FORKS`]).
pub fn generation() -> u64 {
    FORKS.load(Ordering::Relaxed)
}

/// The process's I/O runtime, started on first use in each process: a child of a fork
/// starts its own. The parent's, inherited, is never dropped in the child (dropping it
/// would deregister the parent's sockets from the epoll instance they share).
pub fn runtime() -> PyResult<&'static Runtime> {
    static RT: AtomicPtr<Runtime> = AtomicPtr::new(std::ptr::null_mut());
    static RT_GENERATION: AtomicU64 = AtomicU64::new(u64::MAX);
    static START: Mutex<()> = Mutex::new(());
    let generation = generation();
    if RT_GENERATION.load(Ordering::Acquire) == generation {
        // SAFETY: set below from a leaked Box before the generation that publishes it.
        return Ok(unsafe { &*RT.load(Ordering::Acquire) });
    }
    let _one = START.lock().unwrap_or_else(|p| p.into_inner());
    if RT_GENERATION.load(Ordering::Acquire) == generation {
        // SAFETY: as above.
        return Ok(unsafe { &*RT.load(Ordering::Acquire) });
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("kvix-client-io")
        .enable_all()
        .build()?;
    RT.store(Box::into_raw(Box::new(rt)), Ordering::Release);
    RT_GENERATION.store(generation, Ordering::Release);
    // SAFETY: just stored, never freed.
    Ok(unsafe { &*RT.load(Ordering::Acquire) })
}
