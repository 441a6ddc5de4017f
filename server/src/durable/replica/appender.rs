//! The appender, one per executor: the writes this executor's connections send go to the
//! stream in the order they were submitted, many per round trip (one pipeline of XADDs
//! per batch), on the executor's own connection to Redis: no hand-off to another thread
//! on an acknowledged write's path. An append refused or lost is answered
//! `LogUnavailable` at once; the connection is made again for the next batch, and also
//! once the follower found Redis failing (a restart or failover leaves idle connections
//! dead, and the next write on one would be refused for nothing).

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use futures::channel::{mpsc, oneshot};
use futures::StreamExt;

use super::resp::Resp;
use super::Replica;
use crate::failure::Failure;
use crate::write::record::{Outcome, Write};

/// One record to append, and the token its reply waits under.
struct Append {
    bytes: Vec<u8>,
    token: u64,
}

/// Most records in one pipeline.
const BATCH: usize = 256;

/// This executor's way into the log.
#[derive(Clone)]
pub struct Appender {
    replica: Arc<Replica>,
    queue: mpsc::UnboundedSender<Append>,
}

impl Appender {
    /// Starts this executor's appending task in `tq`.
    pub fn start(
        replica: Arc<Replica>,
        tq: glommio::TaskQueueHandle,
    ) -> Result<Appender, crate::error::StartError> {
        let (queue, appends) = mpsc::unbounded();
        let name = format!("kvix-append-{}-{}", replica.id, glommio::executor().id());
        glommio::spawn_local_into(run(replica.clone(), appends, name), tq)
            .map_err(crate::error::StartError::spawn("the log appender"))?
            .detach();
        Ok(Appender { replica, queue })
    }

    /// Appends `record`; the receiver answers once this replica applied it (or with
    /// `LogUnavailable` when it could not be appended).
    pub fn submit(&self, record: &Write) -> oneshot::Receiver<Result<Outcome, Failure>> {
        let r = &self.replica;
        let (tx, rx) = oneshot::channel();
        let Some(token) = r.expect(tx) else {
            return rx;
        };
        let bytes = rkyv::to_bytes::<rkyv::rancor::Error>(record)
            .expect("plain data serializes")
            .to_vec();
        if self.queue.unbounded_send(Append { bytes, token }).is_err() {
            r.fail(token, "the log appender has stopped".into());
        }
        rx
    }
}

async fn run(r: Arc<Replica>, mut appends: mpsc::UnboundedReceiver<Append>, name: String) {
    let mut conn: Option<Resp> = None;
    // The follower's failures counted when the connection was made.
    let mut made_after = 0;
    while let Some(first) = appends.next().await {
        let mut batch = vec![first];
        while batch.len() < BATCH {
            match appends.try_recv() {
                Ok(a) => batch.push(a),
                _ => break,
            }
        }
        if r.link_failures.load(Relaxed) != made_after {
            // Redis failed the follower since: this idle connection is likely dead.
            conn = None;
        }
        if conn.is_none() {
            made_after = r.link_failures.load(Relaxed);
            match Resp::open(&r.link, &name).await {
                Ok(c) => conn = Some(c),
                Err(e) => {
                    let why = format!("the write log at {} is unreachable: {e}", r.url.server);
                    fail(&r, &batch, &why);
                    continue;
                }
            }
        }
        let mut pipe = redis::pipe();
        for a in &batch {
            pipe.cmd("XADD")
                .arg(&r.url.key)
                .arg("*")
                .arg("r")
                .arg(&a.bytes[..])
                .arg("o")
                .arg(format!("{}:{}", r.id, a.token));
        }
        let c = conn.as_mut().expect("connected");
        if let Err(e) = c.send(&pipe.get_packed_pipeline()).await {
            conn = None;
            fail(
                &r,
                &batch,
                &format!("appending to the write log failed: {e}"),
            );
            continue;
        }
        // Each XADD answers for itself: one refused (maxmemory) fails its write alone.
        // Should the connection fail part-way, the XADDs already answered are in the
        // log and are answered when the follower reads them back; only the rest fail
        // (a client retrying a write the log took would have it twice).
        for (i, a) in batch.iter().enumerate() {
            match c.reply().await {
                Ok(reply) => match reply.extract_error() {
                    Ok(_) => {
                        r.metrics.appended.fetch_add(1, Relaxed);
                    }
                    Err(e) => fail(
                        &r,
                        std::slice::from_ref(a),
                        &format!("appending to the write log failed: {e}"),
                    ),
                },
                Err(e) => {
                    conn = None;
                    let why = format!("appending to the write log failed: {e}");
                    fail(&r, &batch[i..], &why);
                    break;
                }
            }
        }
    }
}

fn fail(r: &Replica, batch: &[Append], why: &str) {
    r.metrics
        .append_failures
        .fetch_add(batch.len() as u64, Relaxed);
    let n = r.metrics.append_failures.load(Relaxed);
    if n.is_power_of_two() || n <= 4 {
        tracing::warn!("{why} ({n} writes refused so far)");
    }
    for a in batch {
        r.fail(a.token, why.to_string());
    }
}
