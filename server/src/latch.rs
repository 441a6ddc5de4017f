//! A one-time event that threads and tasks (executors, the start waiting for the
//! replica's follower) wait for without polling.

/// Set once; every waiter, on any thread, then resolves.
pub struct Latch {
    set: std::sync::Mutex<Option<futures::channel::oneshot::Sender<()>>>,
    done: futures::future::Shared<futures::channel::oneshot::Receiver<()>>,
}

impl Default for Latch {
    fn default() -> Self {
        Self::new()
    }
}

impl Latch {
    pub fn new() -> Self {
        use futures::FutureExt;
        let (tx, rx) = futures::channel::oneshot::channel();
        Latch {
            set: std::sync::Mutex::new(Some(tx)),
            done: rx.shared(),
        }
    }

    pub fn set(&self) {
        let tx = self.set.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(tx) = tx {
            let _ = tx.send(());
        }
    }

    pub async fn wait(&self) {
        let _ = self.done.clone().await;
    }
}
