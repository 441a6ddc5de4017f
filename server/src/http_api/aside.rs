//! Work too long for an executor's turn (parsing a body of megabytes, hashing its
//! tokens) run on a thread aside while the executor goes on serving. The threads are
//! started once and kept: a thread started per body cost more than the parse of a
//! 1,250-block query (its stack mapped and unmapped each time, docs/benchmarks.md §15).
//! At most [`AT_ONCE`] bodies per executor are aside at once; more wait their turn.

use std::rc::Rc;
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};

use glommio::sync::Semaphore;

/// Bodies one executor has aside at once, and the threads that parse them.
const AT_ONCE: u64 = 4;

type Job = Box<dyn FnOnce() + Send>;

thread_local! {
    static SLOTS: Rc<Semaphore> = Rc::new(Semaphore::new(AT_ONCE));
}

/// The threads' queue, started on first use. None when no thread could be started.
fn pool() -> Option<&'static Mutex<mpsc::Sender<Job>>> {
    static POOL: OnceLock<Option<Mutex<mpsc::Sender<Job>>>> = OnceLock::new();
    POOL.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        let started = (0..AT_ONCE)
            .filter(|i| {
                let rx = rx.clone();
                std::thread::Builder::new()
                    .name(format!("kvix-http-aside-{i}"))
                    .spawn(move || serve(&rx))
                    .is_ok()
            })
            .count();
        (started > 0).then(|| Mutex::new(tx))
    })
    .as_ref()
}

/// One thread's life: jobs until the queue closes. A job that panics is answered by
/// its dropped sender (its caller gets None); the thread goes on.
fn serve(jobs: &Mutex<mpsc::Receiver<Job>>) {
    loop {
        let job = match jobs.lock().unwrap_or_else(|p| p.into_inner()).recv() {
            Ok(job) => job,
            Err(_) => return,
        };
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
    }
}

/// Runs `f` on a thread aside and waits for it without holding the executor; None
/// when no thread could be started or `f` panicked.
pub async fn run<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let slots = SLOTS.with(Rc::clone);
    let _slot = slots.acquire_static_permit(1).await.ok()?;
    let (tx, rx) = futures::channel::oneshot::channel();
    let job: Job = Box::new(move || {
        let _ = tx.send(f());
    });
    pool()?
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .send(job)
        .ok()?;
    rx.await.ok()
}
