//! Completing asyncio futures from the I/O thread without taking the GIL there.
//!
//! An async call returns a future of the caller's event loop; the Rust task that does
//! the work pushes its result here and, when the queue was empty, writes one byte to a
//! socket pair the loop watches (`loop.add_reader(fileno, drain)`). `drain` runs on the
//! loop's thread, with the GIL, and sets the results. The I/O thread never waits for the
//! GIL, so a busy interpreter cannot hold up the replies of other clients or threads.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use pyo3::intern;
use pyo3::prelude::*;

/// A result waiting to be turned into Python objects on the loop's thread.
type Make = Box<dyn FnOnce(Python<'_>) -> PyResult<Py<PyAny>> + Send>;

struct Done {
    future: Py<PyAny>,
    make: Make,
}

pub struct Queue {
    done: Mutex<Vec<Done>>,
    /// Whether `done` has something: read without the lock.
    ready: AtomicBool,
    wake: UnixStream,
}

impl Queue {
    /// Hands a result to the loop; never blocks on Python.
    pub fn push(&self, future: Py<PyAny>, make: Make) {
        let was_empty = match self.done.lock() {
            Ok(mut q) => {
                q.push(Done { future, make });
                self.ready.store(true, Ordering::Release);
                q.len() == 1
            }
            Err(_) => return,
        };
        if was_empty {
            // A full socket already holds a wake-up the loop has yet to read.
            let _ = (&self.wake).write(&[1]);
        }
    }
}

/// The bridge between one event loop and the client's I/O thread.
#[pyclass(frozen, module = "kvix._kvix")]
pub struct Completer {
    event_loop: Py<PyAny>,
    queue: Arc<Queue>,
    watch: UnixStream,
    /// Futures handed out and not yet set, by address: `close` fails them.
    pending: Mutex<HashMap<usize, Py<PyAny>>>,
}

#[pymethods]
impl Completer {
    #[new]
    fn new(event_loop: Py<PyAny>) -> PyResult<Self> {
        let (watch, wake) = UnixStream::pair()?;
        watch.set_nonblocking(true)?;
        wake.set_nonblocking(true)?;
        Ok(Completer {
            event_loop,
            queue: Arc::new(Queue {
                done: Mutex::new(Vec::new()),
                ready: AtomicBool::new(false),
                wake,
            }),
            watch,
            pending: Mutex::default(),
        })
    }

    /// Fails every future still pending with `KvixError` (the client is closing: their
    /// replies would never be delivered to the loop).
    fn close(&self, py: Python<'_>) {
        let pending = match self.pending.lock() {
            Ok(mut p) => std::mem::take(&mut *p),
            Err(_) => return,
        };
        for future in pending.into_values() {
            let fut = future.bind(py);
            if is_done(fut) {
                continue;
            }
            let e = crate::errors::KvixError::new_err("the client was closed before the reply");
            if let Err(e) = fut.call_method1(intern!(py, "set_exception"), (e.value(py),)) {
                e.write_unraisable(py, Some(fut));
            }
        }
    }

    /// The descriptor the loop watches for readability.
    fn fileno(&self) -> i32 {
        self.watch.as_raw_fd()
    }

    /// Sets the results that arrived (the loop calls this when `fileno` is readable).
    fn drain(&self, py: Python<'_>) {
        // Read the wake-ups first, then take the queue: a push after the take writes a
        // new wake-up, so none is lost.
        let mut sink = [0u8; 64];
        loop {
            match (&self.watch).read(&mut sink) {
                Ok(0) => break,
                Ok(_) => continue,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => break,
            }
        }
        let batch = match self.queue.done.lock() {
            Ok(mut q) => {
                self.queue.ready.store(false, Ordering::Relaxed);
                std::mem::take(&mut *q)
            }
            Err(_) => return,
        };
        if let Ok(mut p) = self.pending.lock() {
            for d in &batch {
                p.remove(&(d.future.as_ptr() as usize));
            }
        }
        for Done { future, make } in batch {
            let fut = future.bind(py);
            // Cancelled by the caller (asyncio.wait_for, say): nothing to set.
            if is_done(fut) {
                continue;
            }
            let set = match make(py) {
                Ok(v) => fut.call_method1(intern!(py, "set_result"), (v,)),
                Err(e) => fut.call_method1(intern!(py, "set_exception"), (e.value(py),)),
            };
            if let Err(e) = set {
                e.write_unraisable(py, Some(fut));
            }
        }
    }
}

impl Completer {
    /// Sets the results already there: a call whose first poll on the caller's thread
    /// finished it (an answer that came while `spin_us` spun, a query failed open at
    /// once) completes its future before the caller awaits it, without waking the
    /// loop's thread (which costs more than the query on some machines).
    pub fn drain_ready(&self, py: Python<'_>) {
        if self.queue.ready.load(Ordering::Acquire) {
            self.drain(py);
        }
    }

    /// A new future of this loop and the queue its result goes through.
    pub fn future(&self, py: Python<'_>) -> PyResult<(Py<PyAny>, Arc<Queue>)> {
        let fut = self
            .event_loop
            .call_method0(py, intern!(py, "create_future"))?;
        if let Ok(mut p) = self.pending.lock() {
            p.insert(fut.as_ptr() as usize, fut.clone_ref(py));
        }
        Ok((fut, self.queue.clone()))
    }
}

/// Whether an asyncio future is done already (set, or cancelled by its caller).
fn is_done(fut: &Bound<'_, PyAny>) -> bool {
    fut.call_method0(intern!(fut.py(), "done"))
        .and_then(|d| d.is_truthy())
        .unwrap_or(true)
}
