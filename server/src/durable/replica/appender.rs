//! The appender thread: this replica's writes go to the stream in the order they were
//! submitted, many per round trip (one pipeline of XADDs per batch). An append that
//! fails is answered `LogUnavailable` at once; the connection is made again for the next.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc::Receiver;

use super::Replica;

/// One record to append, and the token its reply waits under.
pub struct Append {
    pub bytes: Vec<u8>,
    pub token: u64,
}

/// Most records in one pipeline.
const BATCH: usize = 256;

pub fn run(r: &Replica, rx: Receiver<Append>) {
    let mut conn: Option<redis::Connection> = None;
    while let Ok(first) = rx.recv() {
        let mut batch = vec![first];
        while batch.len() < BATCH {
            match rx.try_recv() {
                Ok(a) => batch.push(a),
                Err(_) => break,
            }
        }
        if conn.is_none() {
            match r.connect() {
                Ok(c) => conn = Some(c),
                Err(e) => {
                    fail_all(
                        r,
                        &batch,
                        &format!("the write log at {} is unreachable: {e}", r.url.server),
                    );
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
        let done: redis::RedisResult<Vec<String>> = pipe.query(conn.as_mut().expect("connected"));
        match done {
            Ok(_) => {
                r.metrics.appended.fetch_add(batch.len() as u64, Relaxed);
            }
            Err(e) => {
                conn = None;
                fail_all(
                    r,
                    &batch,
                    &format!("appending to the write log failed: {e}"),
                );
            }
        }
    }
}

fn fail_all(r: &Replica, batch: &[Append], why: &str) {
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
