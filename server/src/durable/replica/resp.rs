//! A connection to the log's Redis on an executor: commands go out and replies come in
//! on the executor's own io_uring, so a write's append and its return through the
//! follower cost no hand-off to another thread (each such wake-up cost tens of µs on
//! the acknowledged write's path, docs/benchmarks.md §8).
//!
//! The redis crate encodes the commands and decodes the replies; this file only finds
//! where a reply ends (RESP2: no HELLO is sent) and moves the bytes.

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;

use futures::{AsyncReadExt, AsyncWriteExt};
use glommio::net::TcpStream;
use redis::{ConnectionAddr, ErrorKind, FromRedisValue, RedisError, RedisResult, Value};

use super::{Link, IO_TIMEOUT};

/// One connection: commands in order, replies in the same order.
pub struct Resp {
    stream: TcpStream,
    /// Bytes read and not yet taken as a reply.
    buf: Vec<u8>,
    /// What one read takes, before it joins `buf`.
    chunk: Box<[u8]>,
}

fn error(what: &'static str, detail: String) -> RedisError {
    RedisError::from((ErrorKind::Io, what, detail))
}

impl Resp {
    /// Connects to the log's current primary (Sentinel and the name service are asked
    /// on glommio's blocking thread: neither has another form here) and logs in with the
    /// URL's password, if it has one; every step bounded by [`IO_TIMEOUT`]. (The log's
    /// URL names no database: its path is the stream's key.) The connection is named
    /// `name` (`CLIENT LIST` shows which replica's appender or follower it is).
    pub async fn open(link: &Arc<Link>, name: &str) -> RedisResult<Resp> {
        let to_ask = link.clone();
        let (info, addrs) = glommio::executor()
            .spawn_blocking(move || -> RedisResult<_> {
                let info = to_ask.primary()?;
                let addrs = resolve(info.addr())?;
                Ok((info, addrs))
            })
            .await?;
        // Each address in turn, as the redis crate does (a name may resolve to an IPv6
        // address first and an IPv4 one the server listens on).
        let mut refused = Vec::new();
        let mut connected = None;
        for addr in addrs {
            match TcpStream::connect_timeout(addr, IO_TIMEOUT).await {
                Ok(s) => {
                    connected = Some(s);
                    break;
                }
                Err(e) => refused.push(format!("{addr}: {e}")),
            }
        }
        let stream = connected.ok_or_else(|| error("connecting to the log", refused.join("; ")))?;
        let io = |e: glommio::GlommioError<()>| error("log socket", e.to_string());
        stream.set_nodelay(true).map_err(io)?;
        stream.set_read_timeout(Some(IO_TIMEOUT)).map_err(io)?;
        stream.set_write_timeout(Some(IO_TIMEOUT)).map_err(io)?;
        let mut conn = Resp {
            stream,
            buf: Vec::with_capacity(64 * 1024),
            chunk: vec![0; 16 * 1024].into_boxed_slice(),
        };
        let settings = info.redis_settings();
        if let Some(password) = settings.password() {
            let mut auth = redis::cmd("AUTH");
            if let Some(user) = settings.username() {
                auth.arg(user);
            }
            conn.query::<()>(auth.arg(password)).await?;
        }
        conn.query::<()>(redis::cmd("CLIENT").arg("SETNAME").arg(name))
            .await?;
        Ok(conn)
    }

    pub async fn query<T: FromRedisValue>(&mut self, cmd: &redis::Cmd) -> RedisResult<T> {
        self.send(&cmd.get_packed_command()).await?;
        let v = self.reply().await?.extract_error()?;
        Ok(T::from_redis_value(v)?)
    }

    /// The pipeline's replies as one array (as the redis crate's own connection gives
    /// them); a command refused fails the whole.
    pub async fn pipeline<T: FromRedisValue>(&mut self, pipe: &redis::Pipeline) -> RedisResult<T> {
        self.send(&pipe.get_packed_pipeline()).await?;
        let replies = self.replies(pipe.len()).await?;
        Ok(T::from_redis_value(Value::Array(replies).extract_error()?)?)
    }

    pub async fn send(&mut self, bytes: &[u8]) -> RedisResult<()> {
        self.stream
            .write_all(bytes)
            .await
            .map_err(|e| error("writing to the log", e.to_string()))
    }

    /// The next `n` replies, each as it came (a refusal is a `Value::ServerError`).
    pub async fn replies(&mut self, n: usize) -> RedisResult<Vec<Value>> {
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            out.push(self.reply().await?);
        }
        Ok(out)
    }

    /// The next reply, as it came (a refusal is a `Value::ServerError`).
    pub async fn reply(&mut self) -> RedisResult<Value> {
        loop {
            if let Some(end) = frame_end(&self.buf, 0)? {
                let v = redis::parse_redis_value(&self.buf[..end]);
                self.buf.drain(..end);
                return v;
            }
            let n = self
                .stream
                .read(&mut self.chunk[..])
                .await
                .map_err(|e| error("reading from the log", e.to_string()))?;
            self.buf.extend_from_slice(&self.chunk[..n]);
            if n == 0 {
                return Err(error(
                    "reading from the log",
                    "the connection closed".into(),
                ));
            }
        }
    }
}

/// Whether `e` is Redis refusing a command (its reply came whole: the connection is
/// still in step) rather than the connection failing (a reply late, cut or garbled:
/// the connection must go, or its next reply would answer the wrong command).
pub fn refused(e: &RedisError) -> bool {
    matches!(e.kind(), ErrorKind::Server(_) | ErrorKind::Extension)
}

/// The primary's socket addresses (a name is resolved here, off the executor).
fn resolve(addr: &ConnectionAddr) -> RedisResult<Vec<SocketAddr>> {
    let ConnectionAddr::Tcp(host, port) = addr else {
        return Err(error(
            "unsupported log address",
            format!("{addr:?}: only plain TCP"),
        ));
    };
    let addrs: Vec<SocketAddr> = (host.as_str(), *port)
        .to_socket_addrs()
        .map_err(|e| error("log address", format!("{host}:{port}: {e}")))?
        .collect();
    if addrs.is_empty() {
        return Err(error(
            "log address",
            format!("{host}:{port} resolves to nothing"),
        ));
    }
    Ok(addrs)
}

/// Where the RESP2 reply starting at `at` ends, if `buf` holds all of it.
fn frame_end(buf: &[u8], at: usize) -> RedisResult<Option<usize>> {
    nested_end(buf, at, 0)
}

/// Replies kvix reads nest 5 deep (XREAD: streams, stream, entries, entry, fields).
const MAX_DEPTH: usize = 16;

fn nested_end(buf: &[u8], at: usize, depth: usize) -> RedisResult<Option<usize>> {
    if depth > MAX_DEPTH {
        return Err(RedisError::from((
            ErrorKind::Parse,
            "a Redis reply nested deeper than any kvix reads",
        )));
    }
    let Some(kind) = buf.get(at) else {
        return Ok(None);
    };
    let Some(crlf) = buf[at..].windows(2).position(|w| w == b"\r\n") else {
        return Ok(None);
    };
    let line_end = at + crlf + 2;
    let count = || -> RedisResult<i64> {
        std::str::from_utf8(&buf[at + 1..at + crlf])
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| {
                RedisError::from((ErrorKind::Parse, "a malformed length in a Redis reply"))
            })
    };
    match kind {
        b'+' | b'-' | b':' => Ok(Some(line_end)),
        b'$' => {
            let n = count()?;
            if n < 0 {
                return Ok(Some(line_end));
            }
            let end = usize::try_from(n)
                .ok()
                .and_then(|n| line_end.checked_add(n)?.checked_add(2))
                .ok_or_else(|| RedisError::from((ErrorKind::Parse, "a bulk string too long")))?;
            Ok((end <= buf.len()).then_some(end))
        }
        b'*' => {
            let n = count()?;
            let mut end = line_end;
            for _ in 0..n.max(0) {
                match nested_end(buf, end, depth + 1)? {
                    Some(e) => end = e,
                    None => return Ok(None),
                }
            }
            Ok(Some(end))
        }
        other => Err(RedisError::from((
            ErrorKind::Parse,
            "an unknown reply type from Redis",
            format!("{:?}", *other as char),
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::frame_end;
    use kvix_bench::resp::Reply;
    use proptest::prelude::*;

    /// The bytes of a RESP2 reply.
    fn encode(r: &Reply, out: &mut Vec<u8>) {
        match r {
            Reply::Simple(s) => out.extend_from_slice(format!("+{s}\r\n").as_bytes()),
            Reply::Error(s) => out.extend_from_slice(format!("-{s}\r\n").as_bytes()),
            Reply::Int(i) => out.extend_from_slice(format!(":{i}\r\n").as_bytes()),
            Reply::Bulk(None) => out.extend_from_slice(b"$-1\r\n"),
            Reply::Bulk(Some(b)) => {
                out.extend_from_slice(format!("${}\r\n", b.len()).as_bytes());
                out.extend_from_slice(b);
                out.extend_from_slice(b"\r\n");
            }
            Reply::Array(None) => out.extend_from_slice(b"*-1\r\n"),
            Reply::Array(Some(items)) => {
                out.extend_from_slice(format!("*{}\r\n", items.len()).as_bytes());
                for i in items {
                    encode(i, out);
                }
            }
        }
    }

    fn reply() -> impl Strategy<Value = Reply> {
        let line = "[a-zA-Z0-9 -]{0,12}";
        let leaf = prop_oneof![
            line.prop_map(Reply::Simple),
            line.prop_map(Reply::Error),
            any::<i64>().prop_map(Reply::Int),
            // Bulk strings may hold CR LF and anything else.
            proptest::option::of(proptest::collection::vec(any::<u8>(), 0..40))
                .prop_map(Reply::Bulk),
        ];
        leaf.prop_recursive(4, 64, 8, |inner| {
            proptest::option::of(proptest::collection::vec(inner, 0..8)).prop_map(Reply::Array)
        })
    }

    proptest! {
        /// Where a reply ends is found only once all of it arrived, whatever follows
        /// it, and the redis crate reads exactly those bytes as one reply.
        #[test]
        fn a_reply_ends_where_its_encoding_ends(r in reply(), after in proptest::collection::vec(any::<u8>(), 0..8)) {
            let mut bytes = Vec::new();
            encode(&r, &mut bytes);
            let end = bytes.len();
            for cut in 0..end {
                prop_assert_eq!(frame_end(&bytes[..cut], 0).unwrap(), None);
            }
            bytes.extend_from_slice(&after);
            prop_assert_eq!(frame_end(&bytes, 0).unwrap(), Some(end));
            prop_assert!(redis::parse_redis_value(&bytes[..end]).is_ok());
        }

        /// Any bytes: an end, a wait for more, or a parse error; never a panic.
        #[test]
        fn any_bytes_are_read_without_a_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = frame_end(&bytes, 0);
        }
    }

    #[test]
    fn a_reply_ends_only_where_all_of_it_arrived() {
        let whole: &[u8] = b"*2\r\n*2\r\n$3\r\nkey\r\n*1\r\n*2\r\n$3\r\n1-0\r\n*2\r\n$1\r\nr\r\n$2\r\nab\r\n$-1\r\n+rest";
        let end = whole.len() - b"+rest".len();
        assert_eq!(frame_end(whole, 0).unwrap(), Some(end));
        for cut in 0..end {
            assert_eq!(frame_end(&whole[..cut], 0).unwrap(), None, "{cut}");
        }
        assert_eq!(frame_end(b"-ERR no\r\n", 0).unwrap(), Some(9));
        assert_eq!(frame_end(b":12\r\n", 0).unwrap(), Some(5));
        assert_eq!(frame_end(b"*-1\r\n", 0).unwrap(), Some(5));
        assert!(frame_end(b"$x\r\n", 0).is_err());
        assert!(frame_end(b"%1\r\n", 0).is_err());
        assert!(frame_end(&b"*1\r\n".repeat(100), 0).is_err());
        let v = redis::parse_redis_value(&whole[..end]).unwrap();
        assert!(matches!(v, redis::Value::Array(ref a) if a.len() == 2));
    }
}
