//! A minimal blocking ZMTP 3.0 peer (NULL security): just what reading a vLLM / SGLang
//! publisher needs, a SUB socket on its PUB and a DEALER on its replay ROUTER.
//!
//! One TCP connection per socket, no background threads, no reconnection of its own:
//! the subscriber decides when to retry. Frames larger than [`MAX_FRAME`] and any
//! protocol violation end the connection with an error, never a panic.

use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

/// Largest frame accepted from a publisher.
pub const MAX_FRAME: u64 = 256 << 20;
const FLAG_MORE: u8 = 1;
const FLAG_LONG: u8 = 2;
const FLAG_COMMAND: u8 = 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SocketType {
    Sub,
    Dealer,
}

impl SocketType {
    fn name(self) -> &'static str {
        match self {
            SocketType::Sub => "SUB",
            SocketType::Dealer => "DEALER",
        }
    }

    fn accepts(self, peer: &[u8]) -> bool {
        match self {
            SocketType::Sub => peer == b"PUB" || peer == b"XPUB",
            SocketType::Dealer => matches!(peer, b"ROUTER" | b"DEALER" | b"REP"),
        }
    }
}

fn proto(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

/// `tcp://host:port` → socket addresses (`*` is not connectable: refused).
pub fn resolve(endpoint: &str) -> io::Result<Vec<std::net::SocketAddr>> {
    let rest = endpoint
        .strip_prefix("tcp://")
        .ok_or_else(|| proto(format!("{endpoint:?}: only tcp:// endpoints are supported")))?;
    if rest.starts_with('*') {
        return Err(proto(format!(
            "{endpoint:?} is a bind address; announce the address to connect to"
        )));
    }
    Ok(rest.to_socket_addrs()?.collect())
}

/// One connected, handshaken ZMTP socket.
pub struct Socket {
    stream: TcpStream,
    buf: Vec<u8>,
    /// Frames of the message being received.
    partial: Vec<Vec<u8>>,
}

impl Socket {
    /// Connects and completes the handshake within `timeout`.
    pub fn connect(endpoint: &str, kind: SocketType, timeout: Duration) -> io::Result<Socket> {
        let addrs = resolve(endpoint)?;
        let mut last = io::Error::new(io::ErrorKind::NotFound, "no address");
        let mut stream = None;
        for a in addrs {
            match TcpStream::connect_timeout(&a, timeout) {
                Ok(s) => {
                    stream = Some(s);
                    break;
                }
                Err(e) => last = e,
            }
        }
        let stream = stream.ok_or(last)?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        let mut s = Socket {
            stream,
            buf: Vec::new(),
            partial: Vec::new(),
        };
        s.handshake(kind)?;
        Ok(s)
    }

    fn handshake(&mut self, kind: SocketType) -> io::Result<()> {
        let mut greeting = [0u8; 64];
        greeting[0] = 0xff;
        greeting[9] = 0x7f;
        greeting[10] = 3; // version 3.0
        greeting[11] = 0;
        greeting[12..16].copy_from_slice(b"NULL");
        // as-server = 0, filler zeros.
        let mut ready = vec![5u8];
        ready.extend_from_slice(b"READY");
        property(&mut ready, "Socket-Type", kind.name().as_bytes());
        if kind == SocketType::Dealer {
            property(&mut ready, "Identity", b"");
        }
        let mut out = greeting.to_vec();
        frame_into(&mut out, FLAG_COMMAND, &ready);
        self.stream.write_all(&out)?;

        let mut peer = [0u8; 64];
        self.stream.read_exact(&mut peer)?;
        if peer[0] != 0xff || peer[9] & 1 != 1 {
            return Err(proto("not a ZMTP peer (bad greeting signature)"));
        }
        if peer[10] < 3 {
            return Err(proto(format!(
                "ZMTP {}.x peer; 3.0 or later needed",
                peer[10]
            )));
        }
        if &peer[12..32] != b"NULL\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0" {
            return Err(proto("peer wants a security mechanism other than NULL"));
        }
        // The peer's READY (commands before it are skipped).
        loop {
            let (flags, body) = self.read_frame_blocking()?;
            if flags & FLAG_COMMAND == 0 {
                return Err(proto("message before READY"));
            }
            let Some((name, props)) = command(&body) else {
                return Err(proto("malformed command"));
            };
            match name {
                b"READY" => {
                    let ty = properties(props)
                        .ok_or_else(|| proto("malformed READY properties"))?
                        .into_iter()
                        .find(|(k, _)| k.eq_ignore_ascii_case(b"Socket-Type"))
                        .map(|(_, v)| v.to_vec())
                        .unwrap_or_default();
                    if !kind.accepts(&ty) {
                        return Err(proto(format!(
                            "peer is a {} socket, not one a {} can talk to",
                            String::from_utf8_lossy(&ty),
                            kind.name()
                        )));
                    }
                    break;
                }
                b"ERROR" => return Err(proto("peer refused the handshake")),
                _ => continue,
            }
        }
        if kind == SocketType::Sub {
            // ZMTP 3.0 subscription: a message whose first byte is 1; empty prefix = all.
            self.send(&[&[1u8]])?;
        }
        Ok(())
    }

    /// Sends one multi-frame message.
    pub fn send(&mut self, frames: &[&[u8]]) -> io::Result<()> {
        let mut out = Vec::new();
        for (i, f) in frames.iter().enumerate() {
            let more = if i + 1 < frames.len() { FLAG_MORE } else { 0 };
            frame_into(&mut out, more, f);
        }
        self.stream.write_all(&out)
    }

    /// The next whole message, or None if none came within `timeout`. Bytes of a
    /// message half-received at the timeout are kept for the next call. A closed
    /// connection is an `UnexpectedEof` error.
    pub fn recv(&mut self, timeout: Duration) -> io::Result<Option<Vec<Vec<u8>>>> {
        self.stream
            .set_read_timeout(Some(timeout.max(Duration::from_millis(1))))?;
        loop {
            while let Some((flags, body)) = self.parse_frame()? {
                if flags & FLAG_COMMAND != 0 {
                    match command(&body) {
                        Some((b"ERROR", _)) => return Err(proto("peer sent ERROR")),
                        Some((b"PING", _)) => {
                            // ZMTP 3.1 heartbeat (name, 2-byte TTL, context): PONG the context.
                            let ctx = body.get(7..).unwrap_or_default();
                            let mut pong = vec![4u8];
                            pong.extend_from_slice(b"PONG");
                            pong.extend_from_slice(ctx);
                            let mut out = Vec::new();
                            frame_into(&mut out, FLAG_COMMAND, &pong);
                            self.stream.write_all(&out)?;
                        }
                        _ => {}
                    }
                    continue;
                }
                self.partial.push(body);
                if flags & FLAG_MORE == 0 {
                    return Ok(Some(std::mem::take(&mut self.partial)));
                }
            }
            let mut chunk = [0u8; 64 * 1024];
            match self.stream.read(&mut chunk) {
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "publisher closed the connection",
                    ))
                }
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    return Ok(None)
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// One frame from the buffer, if it is all there.
    fn parse_frame(&mut self) -> io::Result<Option<(u8, Vec<u8>)>> {
        let Some(&flags) = self.buf.first() else {
            return Ok(None);
        };
        if flags & !(FLAG_MORE | FLAG_LONG | FLAG_COMMAND) != 0 {
            return Err(proto(format!("bad frame flags {flags:#04x}")));
        }
        let (head, len) = if flags & FLAG_LONG != 0 {
            let Some(b) = self.buf.get(1..9) else {
                return Ok(None);
            };
            (9, u64::from_be_bytes(b.try_into().expect("8 bytes")))
        } else {
            let Some(&b) = self.buf.get(1) else {
                return Ok(None);
            };
            (2, u64::from(b))
        };
        if len > MAX_FRAME {
            return Err(proto(format!("frame of {len} bytes is over the limit")));
        }
        let end = head + len as usize;
        if self.buf.len() < end {
            return Ok(None);
        }
        let body = self.buf[head..end].to_vec();
        self.buf.drain(..end);
        Ok(Some((flags, body)))
    }

    fn read_frame_blocking(&mut self) -> io::Result<(u8, Vec<u8>)> {
        loop {
            if let Some(f) = self.parse_frame()? {
                return Ok(f);
            }
            let mut chunk = [0u8; 4096];
            match self.stream.read(&mut chunk)? {
                0 => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "closed during the handshake",
                    ))
                }
                n => self.buf.extend_from_slice(&chunk[..n]),
            }
        }
    }
}

fn frame_into(out: &mut Vec<u8>, flags: u8, body: &[u8]) {
    if body.len() > 255 {
        out.push(flags | FLAG_LONG);
        out.extend_from_slice(&(body.len() as u64).to_be_bytes());
    } else {
        out.push(flags);
        out.push(body.len() as u8);
    }
    out.extend_from_slice(body);
}

fn property(out: &mut Vec<u8>, name: &str, value: &[u8]) {
    out.push(name.len() as u8);
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(&(value.len() as u32).to_be_bytes());
    out.extend_from_slice(value);
}

/// A command body → (name, data).
fn command(body: &[u8]) -> Option<(&[u8], &[u8])> {
    let (&n, rest) = body.split_first()?;
    let n = n as usize;
    Some((rest.get(..n)?, rest.get(n..)?))
}

fn properties(mut data: &[u8]) -> Option<Vec<(&[u8], &[u8])>> {
    let mut out = Vec::new();
    while !data.is_empty() {
        let (&n, rest) = data.split_first()?;
        let name = rest.get(..n as usize)?;
        let rest = &rest[n as usize..];
        let len = u32::from_be_bytes(rest.get(..4)?.try_into().ok()?) as usize;
        let value = rest.get(4..4 + len)?;
        out.push((name, value));
        data = &rest[4 + len..];
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_and_properties_round_trip() {
        let mut out = Vec::new();
        frame_into(&mut out, FLAG_MORE, b"abc");
        frame_into(&mut out, 0, &[7u8; 300]);
        assert_eq!(&out[..5], &[1, 3, b'a', b'b', b'c']);
        assert_eq!(out[5], FLAG_LONG);
        let mut p = Vec::new();
        property(&mut p, "Socket-Type", b"PUB");
        property(&mut p, "Identity", b"");
        assert_eq!(
            properties(&p).unwrap(),
            vec![
                (&b"Socket-Type"[..], &b"PUB"[..]),
                (&b"Identity"[..], &b""[..])
            ]
        );
        assert!(properties(&[5, b'a']).is_none());
        assert_eq!(command(&[3, b'a', b'b']), None);
    }

    #[test]
    fn endpoints_must_be_connectable_tcp() {
        assert!(resolve("tcp://127.0.0.1:5557").unwrap().len() == 1);
        assert!(resolve("tcp://*:5557").is_err());
        assert!(resolve("ipc:///tmp/x").is_err());
    }

    #[test]
    fn a_silent_or_foreign_peer_is_an_error_not_a_hang() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let _ = s.write_all(b"HTTP/1.1 200 OK\r\n\r\n0123456789012345678901234567890123456789012345678901234567890123");
            std::thread::sleep(Duration::from_millis(200));
        });
        let r = Socket::connect(
            &format!("tcp://{addr}"),
            SocketType::Sub,
            Duration::from_secs(2),
        );
        assert!(r.is_err());
        t.join().unwrap();
    }
}
