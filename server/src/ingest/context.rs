//! The ingest's libzmq context, sized for every source's sockets.
//!
//! libzmq allows 1,023 sockets per context by default and a source takes three (its SUB,
//! the monitor socket libzmq attaches to it, and the PAIR reading that monitor), so
//! subscriptions past about 340 sources failed with "Too many open files" while
//! `--max-sources` allowed 1,024. The `zmq` crate has no way to set `ZMQ_MAX_SOCKETS`, so
//! the context is made here with `zmq-sys` (the same libzmq the crate links) and its
//! sockets are handed to the crate's [`zmq::Socket`], which owns and closes them.

use std::ffi::c_void;

/// Sockets one source holds: its SUB, libzmq's monitor socket on it, and our PAIR.
pub const SOCKETS_PER_SOURCE: usize = 3;

/// A libzmq context with room for `max_sockets`; terminated once dropped.
pub struct Context {
    raw: *mut c_void,
}

// SAFETY: a libzmq context is thread safe (zmq_ctx_new(3): "a ØMQ context is thread
// safe and may be shared among as many application threads as necessary").
unsafe impl Send for Context {}
unsafe impl Sync for Context {}

/// The socket kinds the ingest opens.
#[derive(Debug, Clone, Copy)]
pub enum Kind {
    Sub,
    Pair,
    Dealer,
    Rep,
}

impl Context {
    /// A context allowing `max_sockets` sockets.
    pub fn new(max_sockets: usize) -> Result<Context, zmq::Error> {
        // SAFETY: plain libzmq calls on the context made here; a failed one is checked.
        unsafe {
            let raw = zmq_sys::zmq_ctx_new();
            if raw.is_null() {
                return Err(last_error());
            }
            let context = Context { raw };
            let n = i32::try_from(max_sockets).unwrap_or(i32::MAX);
            if zmq_sys::zmq_ctx_set(raw, zmq_sys::ZMQ_MAX_SOCKETS as i32, n) != 0 {
                return Err(last_error());
            }
            Ok(context)
        }
    }

    /// The most sockets it allows.
    #[cfg(test)]
    pub fn max_sockets(&self) -> usize {
        // SAFETY: a getter on a live context.
        let n = unsafe { zmq_sys::zmq_ctx_get(self.raw, zmq_sys::ZMQ_MAX_SOCKETS as i32) };
        usize::try_from(n).unwrap_or(0)
    }

    /// A new socket of this context. The context must outlive it (its drop waits for
    /// every socket to close): the ingest threads drop their sockets before their
    /// handle on the context.
    pub fn socket(&self, kind: Kind) -> Result<zmq::Socket, zmq::Error> {
        let kind = match kind {
            Kind::Sub => zmq_sys::ZMQ_SUB,
            Kind::Pair => zmq_sys::ZMQ_PAIR,
            Kind::Dealer => zmq_sys::ZMQ_DEALER,
            Kind::Rep => zmq_sys::ZMQ_REP,
        };
        // SAFETY: a socket made on a live context; ownership goes to the returned
        // `zmq::Socket`, which closes it once (what `from_raw` asks of the pointer).
        unsafe {
            let sock = zmq_sys::zmq_socket(self.raw, kind as i32);
            if sock.is_null() {
                return Err(last_error());
            }
            Ok(zmq::Socket::from_raw(sock))
        }
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: the context is terminated once, here; EINTR asks to call again.
        while unsafe { zmq_sys::zmq_ctx_term(self.raw) } != 0 {
            if last_error() != zmq::Error::EINTR {
                break;
            }
        }
    }
}

fn last_error() -> zmq::Error {
    // SAFETY: reads libzmq's errno for this thread.
    zmq::Error::from_raw(unsafe { zmq_sys::zmq_errno() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_context_holds_more_sockets_than_libzmq_allows_by_default() {
        // Each socket holds a descriptor: as the server does, use what the operator allows.
        crate::rlimit::raise_open_files().unwrap();
        let ctx = Context::new(4 * 1024).unwrap();
        assert_eq!(ctx.max_sockets(), 4 * 1024);
        let sockets: Vec<zmq::Socket> =
            (0..1100).map(|_| ctx.socket(Kind::Pair).unwrap()).collect();
        drop(sockets);
        let small = Context::new(8).unwrap();
        let kept: Vec<_> = (0..8).map(|_| small.socket(Kind::Sub).unwrap()).collect();
        assert!(
            small.socket(Kind::Dealer).is_err(),
            "the ninth socket is refused"
        );
        drop(kept);
    }
}
