//! The ZAP handler of the bound sockets (ZeroMQ's authentication protocol, RFC 27): a
//! connection to `--events-bind` from an address outside `--source-allow` is refused
//! during its handshake, before any of its messages is read. libzmq asks the handler at
//! `inproc://zeromq.zap.01` of the socket's context about every connection to a socket
//! with a ZAP domain, for the NULL mechanism the engines use too.

use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::thread::JoinHandle;

use crate::ingest::context::{Context, Kind};
use crate::ingest::METRICS;
use crate::loud::count_loudly;

/// The ZAP domain the bound sockets ask about.
pub const DOMAIN: &str = "kvix-events-bind";
const ENDPOINT: &str = "inproc://zeromq.zap.01";

/// The handler's thread, stopped and joined when dropped (before the context ends).
pub struct Zap {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Zap {
    /// Serves the context's ZAP requests: a peer is admitted when `allows` its address.
    pub fn start(
        ctx: &Context,
        allows: impl Fn(Option<IpAddr>) -> bool + Send + 'static,
    ) -> Result<Zap, zmq::Error> {
        let rep = ctx.socket(Kind::Rep)?;
        rep.set_linger(0)?;
        rep.bind(ENDPOINT)?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::Builder::new()
            .name("kvix-zap".into())
            .spawn(move || serve(&rep, &stopped, &allows))
            .map_err(|_| zmq::Error::EMFILE)?;
        Ok(Zap {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Zap {
    fn drop(&mut self) {
        self.stop.store(true, Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve(rep: &zmq::Socket, stop: &AtomicBool, allows: &dyn Fn(Option<IpAddr>) -> bool) {
    while !stop.load(Relaxed) {
        match rep.poll(zmq::POLLIN, 100) {
            Ok(0) => continue,
            Ok(_) => {}
            Err(_) => return,
        }
        let Ok(request) = rep.recv_multipart(0) else {
            return;
        };
        if rep.send_multipart(answer(&request, allows), 0).is_err() {
            return;
        }
    }
}

/// The reply to one request (version, request id, domain, address, identity,
/// mechanism, credentials...): 200 for an allowed address (an ipc peer has none: local),
/// 400 otherwise; 500 for a request that is not one.
fn answer(request: &[Vec<u8>], allows: &dyn Fn(Option<IpAddr>) -> bool) -> Vec<Vec<u8>> {
    let reply = |id: &[u8], status: &str, text: &str| {
        vec![
            b"1.0".to_vec(),
            id.to_vec(),
            status.as_bytes().to_vec(),
            text.as_bytes().to_vec(),
            Vec::new(),
            Vec::new(),
        ]
    };
    let (Some(version), Some(id), Some(address)) =
        (request.first(), request.get(1), request.get(3))
    else {
        return reply(b"", "500", "not a ZAP request");
    };
    if version != b"1.0" {
        return reply(id, "500", "not ZAP 1.0");
    }
    let text = String::from_utf8_lossy(address);
    let peer: Option<IpAddr> = text.parse().ok();
    if allows(peer) {
        return reply(id, "200", "OK");
    }
    if let Some(n) = count_loudly(&METRICS.peers_refused) {
        tracing::warn!(from = %text, "ingest: a connection to --events-bind from {text}, outside --source-allow: refused at its handshake ({n} so far)");
    }
    reply(id, "400", "outside --source-allow")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_answered_by_the_peers_address() {
        let loopback = |p: Option<IpAddr>| p.is_none_or(|ip| ip.is_loopback());
        let ask = |address: &str| {
            let request: Vec<Vec<u8>> = ["1.0", "7", DOMAIN, address, "", "NULL"]
                .iter()
                .map(|f| f.as_bytes().to_vec())
                .collect();
            let reply = answer(&request, &loopback);
            assert_eq!((&reply[0][..], &reply[1][..]), (&b"1.0"[..], &b"7"[..]));
            String::from_utf8(reply[2].clone()).unwrap()
        };
        assert_eq!(ask("127.0.0.1"), "200");
        assert_eq!(ask("::1"), "200");
        assert_eq!(ask(""), "200", "an ipc peer has no address");
        assert_eq!(ask("10.1.2.3"), "400");
        assert_eq!(
            answer(&[b"2.0".to_vec(), b"1".to_vec()], &loopback)[2],
            b"500"
        );
    }
}
