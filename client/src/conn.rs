//! One multiplexed connection: the transport halves, the write path, the reader task
//! and the map of pending request ids.
//!
//! Writes are synchronous and cancel-safe: a caller encodes its frame and writes it with
//! `try_write` under a short lock; whatever the socket does not take at once goes to a
//! backlog that a writer task drains when the socket is writable again. So a request
//! costs no task hop, and a deadline firing mid-request can never leave half a frame.

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use kvix_wire::{
    to_native, Announced, ErrorCode, ErrorReply, Frame, Kind, MessageRef, Roster, Stats,
    TieredAnswer, DEFAULT_MAX_FRAME,
};
use tokio::io::AsyncReadExt;
use tokio::net::{tcp, unix, TcpStream, UnixStream};
use tokio::sync::{oneshot, Notify};

use crate::counters::Counters;
use crate::tls::{Tls, TlsConn};
use crate::{Addr, ClientError};

/// Bit 63 of a request id: set on fire-and-forget requests (`FLAG_NO_REPLY`), whose only
/// possible answer is their refusal.
pub const QUIET_ID: u64 = 1 << 63;

/// A backlog past this means the server is not reading: the connection is given up.
const MAX_BACKLOG: usize = 64 << 20;

/// A reply, copied out of the read buffer.
#[derive(Debug)]
pub(crate) enum Reply {
    Answer(TieredAnswer),
    Announced(Announced),
    Ack,
    Stats(Stats),
    Echo(Vec<u8>),
    Roster(Roster),
    Error(ErrorReply),
}

impl Reply {
    /// Converts a validated message; `None` for kinds a server never sends.
    fn from_message(m: &MessageRef<'_>) -> Option<Reply> {
        Some(match m {
            MessageRef::TieredAnswer(a) => Reply::Answer(to_native::<TieredAnswer>(a)),
            MessageRef::Announced(a) => Reply::Announced(to_native::<Announced>(a)),
            MessageRef::Ack(_) => Reply::Ack,
            MessageRef::Stats(s) => Reply::Stats(to_native::<Stats>(s)),
            MessageRef::Echo(e) => Reply::Echo(e.payload.as_slice().to_vec()),
            MessageRef::Roster(r) => Reply::Roster(to_native::<Roster>(r)),
            MessageRef::ErrorReply(e) => Reply::Error(to_native::<ErrorReply>(e)),
            _ => return None,
        })
    }
}

pub(crate) enum ReadHalf {
    Tcp(tcp::OwnedReadHalf),
    Unix(unix::OwnedReadHalf),
    Tls(Arc<TlsConn>),
}

pub(crate) enum WriteHalf {
    Tcp(tcp::OwnedWriteHalf),
    Unix(unix::OwnedWriteHalf),
    Tls(Arc<TlsConn>),
}

impl ReadHalf {
    async fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            ReadHalf::Tcp(r) => r.read(buf).await,
            ReadHalf::Unix(r) => r.read(buf).await,
            ReadHalf::Tls(t) => t.read(buf).await,
        }
    }
}

impl WriteHalf {
    fn try_write(&self, buf: &[u8]) -> io::Result<usize> {
        match self {
            WriteHalf::Tcp(w) => w.try_write(buf),
            WriteHalf::Unix(w) => w.try_write(buf),
            WriteHalf::Tls(t) => t.try_write(buf),
        }
    }

    /// Until the socket takes more (TLS: until the records waiting went out).
    async fn writable(&self) -> io::Result<()> {
        match self {
            WriteHalf::Tcp(w) => w.writable().await,
            WriteHalf::Unix(w) => w.writable().await,
            WriteHalf::Tls(t) => t.writable().await,
        }
    }

    /// Whether bytes already taken still wait to go out (TLS records).
    fn pending(&self) -> bool {
        match self {
            WriteHalf::Tls(t) => t.pending(),
            _ => false,
        }
    }

    /// Resolves when the read side left bytes to send (TLS); never otherwise.
    async fn flush_wanted(&self) {
        match self {
            WriteHalf::Tls(t) => t.flush_wanted().await,
            _ => std::future::pending().await,
        }
    }
}

/// Opens the transport: TCP (through `tls` where given) or a Unix socket.
pub(crate) async fn dial(addr: &Addr, tls: Option<&Tls>) -> io::Result<(ReadHalf, WriteHalf)> {
    Ok(match addr {
        Addr::Tcp(a) => {
            let s = TcpStream::connect(a.as_str()).await?;
            s.set_nodelay(true)?;
            if let Some(tls) = tls {
                let t = Arc::new(tls.connect(a, s).await?);
                return Ok((ReadHalf::Tls(t.clone()), WriteHalf::Tls(t)));
            }
            let (r, w) = s.into_split();
            (ReadHalf::Tcp(r), WriteHalf::Tcp(w))
        }
        Addr::Unix(p) => {
            let (r, w) = UnixStream::connect(p).await?.into_split();
            (ReadHalf::Unix(r), WriteHalf::Unix(w))
        }
    })
}

/// Why reading stopped.
#[derive(Debug)]
pub(crate) enum ReadError {
    Eof,
    Io(io::Error),
    /// The peer sent something that is not a valid reply frame.
    Malformed(String),
}

/// A connection's read half and the frame reader of kvix-wire over it.
pub(crate) struct FrameReader {
    half: ReadHalf,
    frames: kvix_wire::FrameReader,
}

impl FrameReader {
    pub fn new(half: ReadHalf, max_frame: u32) -> Self {
        FrameReader {
            half,
            frames: kvix_wire::FrameReader::new(max_frame),
        }
    }

    /// Waits until a whole frame is buffered at the front.
    pub async fn ready(&mut self) -> Result<(), ReadError> {
        loop {
            match self.frames.next() {
                Ok(Some(_)) => return Ok(()),
                Ok(None) => {}
                Err(e) => return Err(ReadError::Malformed(e.to_string())),
            }
            let n = self
                .half
                .read(self.frames.spare())
                .await
                .map_err(ReadError::Io)?;
            if n == 0 {
                return Err(ReadError::Eof);
            }
            self.frames.filled(n);
        }
    }

    /// The frame at the front, once [`Self::ready`] said one is there.
    pub fn frame(&self) -> Option<Frame<'_>> {
        self.frames.next().ok().flatten()
    }

    pub fn consume(&mut self, len: usize) {
        self.frames.consume(len);
    }
}

struct Pending {
    closed: bool,
    map: HashMap<u64, (Kind, oneshot::Sender<Reply>)>,
}

struct Backlog {
    bytes: Vec<u8>,
    at: usize,
}

/// One established connection to one server.
pub(crate) struct Conn {
    pub addr: Addr,
    /// The server's frame limit, from Welcome (the default until then).
    max_frame: AtomicU32,
    half: WriteHalf,
    backlog: Mutex<Backlog>,
    write_wake: Notify,
    pending: Mutex<Pending>,
    next_id: AtomicU64,
    closed: AtomicBool,
    closed_wake: Notify,
}

impl Conn {
    pub fn new(addr: Addr, half: WriteHalf) -> Arc<Conn> {
        Arc::new(Conn {
            addr,
            max_frame: AtomicU32::new(DEFAULT_MAX_FRAME),
            half,
            backlog: Mutex::new(Backlog {
                bytes: Vec::new(),
                at: 0,
            }),
            write_wake: Notify::new(),
            pending: Mutex::new(Pending {
                closed: false,
                map: HashMap::new(),
            }),
            next_id: AtomicU64::new(1),
            closed: AtomicBool::new(false),
            closed_wake: Notify::new(),
        })
    }

    /// The largest frame the server accepts.
    pub fn max_frame(&self) -> u32 {
        self.max_frame.load(Ordering::Relaxed)
    }

    pub fn set_max_frame(&self, max: u32) {
        self.max_frame.store(max, Ordering::Relaxed);
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Resolves once the connection is closed.
    pub async fn closed(&self) {
        loop {
            let notified = self.closed_wake.notified();
            if self.is_closed() {
                return;
            }
            notified.await;
        }
    }

    /// A fresh request id.
    pub fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Registers a request expecting a reply of kind `want` (or an ErrorReply).
    pub fn register(&self, id: u64, want: Kind) -> Result<oneshot::Receiver<Reply>, ClientError> {
        let (tx, rx) = oneshot::channel();
        let mut p = self.pending.lock().map_err(|_| ClientError::Disconnected)?;
        if p.closed {
            return Err(ClientError::Disconnected);
        }
        p.map.insert(id, (want, tx));
        Ok(rx)
    }

    /// Forgets a request whose caller stopped waiting.
    pub fn forget(&self, id: u64) {
        if let Ok(mut p) = self.pending.lock() {
            p.map.remove(&id);
        }
    }

    /// Writes whole frames without waiting: what the socket does not take now is
    /// queued for the writer task, behind anything already queued.
    pub fn send(&self, frame: &[u8]) -> Result<(), ClientError> {
        if self.is_closed() {
            return Err(ClientError::Disconnected);
        }
        let mut b = self.backlog.lock().map_err(|_| ClientError::Disconnected)?;
        let mut rest = frame;
        if b.at == b.bytes.len() {
            while !rest.is_empty() {
                match self.half.try_write(rest) {
                    Ok(0) => {
                        drop(b);
                        self.close();
                        return Err(ClientError::Disconnected);
                    }
                    Ok(n) => rest = &rest[n..],
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(_) => {
                        drop(b);
                        self.close();
                        return Err(ClientError::Disconnected);
                    }
                }
            }
            if rest.is_empty() {
                if self.half.pending() {
                    drop(b);
                    self.write_wake.notify_one();
                }
                return Ok(());
            }
        }
        if b.bytes.len() - b.at + rest.len() > MAX_BACKLOG {
            drop(b);
            self.close();
            return Err(ClientError::Disconnected);
        }
        b.bytes.extend_from_slice(rest);
        drop(b);
        self.write_wake.notify_one();
        Ok(())
    }

    /// Drains the backlog whenever there is one; ends when the connection closes.
    pub async fn write_loop(self: Arc<Self>) {
        loop {
            tokio::select! {
                _ = self.write_wake.notified() => {}
                _ = self.half.flush_wanted() => {}
                _ = self.closed() => return,
            }
            loop {
                let done = {
                    let Ok(mut b) = self.backlog.lock() else {
                        return self.close();
                    };
                    loop {
                        if b.at == b.bytes.len() {
                            b.bytes.clear();
                            b.at = 0;
                            break true;
                        }
                        let at = b.at;
                        match self.half.try_write(&b.bytes[at..]) {
                            Ok(0) => return self.close(),
                            Ok(n) => b.at += n,
                            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break false,
                            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                            Err(_) => return self.close(),
                        }
                    }
                };
                if done && !self.half.pending() {
                    break;
                }
                tokio::select! {
                    r = self.half.writable() => if r.is_err() { return self.close() },
                    _ = self.closed() => return,
                }
            }
        }
    }

    /// Reads replies and hands each to its waiter until the connection ends. A frame
    /// that cannot be read, or a reply of the wrong kind, closes the connection.
    /// `refused` hears of every fire-and-forget request a server refused (its id, the code).
    pub async fn read_loop(
        self: Arc<Self>,
        mut reader: FrameReader,
        counters: Arc<Counters>,
        refused: Arc<dyn Fn(u64, ErrorCode) + Send + Sync>,
    ) {
        let why = loop {
            tokio::select! {
                r = reader.ready() => if let Err(e) = r { break e },
                _ = self.closed() => break ReadError::Eof,
            }
            let Some(frame) = reader.frame() else {
                break ReadError::Malformed("frame vanished".into());
            };
            let len = frame.len;
            if let Err(e) = self.deliver(&frame, &counters, &*refused) {
                break ReadError::Malformed(e);
            }
            reader.consume(len);
        };
        match why {
            ReadError::Malformed(m) => {
                Counters::bump(&counters.n.malformed_replies);
                tracing::warn!(server = %self.addr, "malformed reply, closing connection: {m}");
            }
            ReadError::Io(e) => tracing::debug!(server = %self.addr, "connection error: {e}"),
            ReadError::Eof => tracing::debug!(server = %self.addr, "connection closed"),
        }
        self.close();
    }

    fn deliver(
        &self,
        frame: &Frame<'_>,
        counters: &Counters,
        refused: &(dyn Fn(u64, ErrorCode) + Send + Sync),
    ) -> Result<(), String> {
        let msg = frame.message().map_err(|e| e.to_string())?;
        let id = frame.header.request_id;
        if id & QUIET_ID != 0 {
            // A fire-and-forget write the server refused: counted, and logged now and then.
            let MessageRef::ErrorReply(e) = msg else {
                return Err(format!(
                    "server sent a {} frame to a fire-and-forget request",
                    msg.kind().name()
                ));
            };
            let e: ErrorReply = to_native(e);
            let n = counters.write_refused(e.code);
            refused(id & !QUIET_ID, e.code);
            if n.is_power_of_two() {
                tracing::warn!(server = %self.addr, code = ?e.code, "a fire-and-forget write was refused ({n} so far): {}", e.message);
            }
            return Ok(());
        }
        let waiter = self.pending.lock().ok().and_then(|mut p| p.map.remove(&id));
        let kind = msg.kind();
        let Some((want, tx)) = waiter else {
            // A reply after its request timed out: valid, just nobody waits for it.
            return if is_reply_kind(kind) {
                Counters::bump(&counters.n.late_replies);
                Ok(())
            } else {
                Err(format!("server sent a {} frame", kind.name()))
            };
        };
        if kind != want && kind != Kind::ErrorReply {
            return Err(format!(
                "{} reply to a request expecting {}",
                kind.name(),
                want.name()
            ));
        }
        let reply = Reply::from_message(&msg)
            .ok_or_else(|| format!("server sent a {} frame", kind.name()))?;
        let _ = tx.send(reply);
        Ok(())
    }

    /// Closes the connection: pending requests see `Disconnected`.
    pub fn close(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        let drained = match self.pending.lock() {
            Ok(mut p) => {
                p.closed = true;
                std::mem::take(&mut p.map)
            }
            Err(_) => HashMap::new(),
        };
        drop(drained);
        self.closed_wake.notify_waiters();
        self.write_wake.notify_one();
    }
}

fn is_reply_kind(k: Kind) -> bool {
    matches!(
        k,
        Kind::Welcome
            | Kind::Answer
            | Kind::TieredAnswer
            | Kind::Announced
            | Kind::Ack
            | Kind::Applied
            | Kind::Stats
            | Kind::Echo
            | Kind::Roster
            | Kind::ErrorReply
    )
}
