//! Work too long for an executor's turn (parsing a body of megabytes, hashing its
//! tokens) run on a thread of its own while the executor goes on serving. At most
//! [`AT_ONCE`] such threads per executor; more wait their turn.

use std::rc::Rc;

use glommio::sync::Semaphore;

/// Threads one executor runs aside at once.
const AT_ONCE: u64 = 4;

thread_local! {
    static SLOTS: Rc<Semaphore> = Rc::new(Semaphore::new(AT_ONCE));
}

/// Runs `f` on a thread of its own and waits for it without holding the executor; None
/// when the thread could not be started or died.
pub async fn run<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let slots = SLOTS.with(Rc::clone);
    let _slot = slots.acquire_static_permit(1).await.ok()?;
    let (tx, rx) = futures::channel::oneshot::channel();
    std::thread::Builder::new()
        .name("kvix-http-aside".into())
        .spawn(move || {
            let _ = tx.send(f());
        })
        .ok()?;
    rx.await.ok()
}
