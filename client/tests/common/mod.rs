//! A fake kvix server for the client's tests: speaks the protocol through kvix-wire,
//! records everything it receives, and can be told to misbehave.
#![allow(dead_code)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvix_client::wire::{
    encode, to_native, Ack, AlignedVec, Announce, Announced, Depths, Echo, ErrorCode, ErrorReply,
    FrameReader, Header, Hello, Kind, MessageRef, Placement, Retire, Roster, RosterEntry,
    RosterRequest, Stats, TieredAnswer, TieredQuery, TieredScore, Welcome, BYTE_CHUNK,
    DEFAULT_MAX_FRAME, HEADER_LEN,
};
use kvix_client::Addr;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::{mpsc, watch};

/// How the fake answers queries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mode {
    /// Scores from the placements it was sent (longest common prefix per worker).
    Normal,
    /// The normal answer, sent this much later.
    Delay(Duration),
    /// A reply frame whose magic is wrong.
    BadMagic,
    /// A valid Answer header over a body that is not a valid Answer.
    GarbageBody,
    /// An Ack (a reply of the wrong kind) with the query's request id.
    WrongKind,
    /// Close the connection on receiving a query.
    CloseOnQuery,
    /// Hold query replies until this many are held, then send them in reverse order.
    Hold(usize),
    /// Answer queries with this error.
    Reject(ErrorCode),
    /// Never answer queries.
    Silent,
    /// The normal answer, saying the replica is behind its log (`stale`).
    Stale,
}

/// What the fake is, fixed at start.
#[derive(Debug, Clone)]
pub struct Opts {
    pub token_block: u32,
    pub auth: Option<String>,
    /// Ids are assigned from here on, in announce order.
    pub first_worker_id: u32,
    /// Misbehave at handshake instead of sending a proper Welcome.
    pub bad_welcome: Option<BadWelcome>,
}

/// Ways to answer Hello wrongly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BadWelcome {
    /// A Welcome that claims another token block size than the one accepted.
    OtherBlock(u32),
    /// Bytes that are not a frame.
    Garbage,
    /// A frame of a kind that is not a reply to Hello.
    WrongKind,
}

impl Default for Opts {
    fn default() -> Self {
        Opts {
            token_block: 16,
            auth: None,
            first_worker_id: 1,
            bad_welcome: None,
        }
    }
}

/// One received message, in native form.
#[derive(Debug, Clone)]
pub enum Msg {
    Hello(Hello),
    Query(TieredQuery),
    Announce(Announce),
    Retire(Retire),
    Placement(Placement),
    Stats,
    Echo(Echo),
    Roster(RosterRequest),
    Other(Kind),
}

#[derive(Debug, Clone)]
pub struct Got {
    /// Connection number on this server, from 0.
    pub conn: usize,
    pub flags: u8,
    pub msg: Msg,
}

pub struct State {
    pub mode: Mode,
    pub received: Vec<Got>,
    pub workers: HashMap<String, u32>,
    next_worker: u32,
    pub placements: HashMap<u32, Vec<u64>>,
    pub conns: usize,
}

pub struct FakeServer {
    pub addr: Addr,
    pub socket: Option<SocketAddr>,
    pub opts: Opts,
    pub state: Arc<Mutex<State>>,
    stop: watch::Sender<bool>,
}

enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener, PathBuf),
}

impl FakeServer {
    /// A fake on a fresh loopback port.
    pub async fn start(opts: Opts) -> FakeServer {
        Self::start_tcp("127.0.0.1:0".parse().unwrap(), opts).await
    }

    /// A fake on this TCP address (to come back on the same port after `kill`).
    pub async fn start_tcp(at: SocketAddr, opts: Opts) -> FakeServer {
        let l = TcpListener::bind(at).await.expect("bind");
        let local = l.local_addr().unwrap();
        Self::run(
            Listener::Tcp(l),
            Addr::tcp(local.to_string()),
            Some(local),
            opts,
        )
    }

    /// A fake on a Unix socket path.
    pub async fn start_unix(path: PathBuf, opts: Opts) -> FakeServer {
        let _ = std::fs::remove_file(&path);
        let l = UnixListener::bind(&path).expect("bind unix");
        Self::run(
            Listener::Unix(l, path.clone()),
            Addr::unix(path),
            None,
            opts,
        )
    }

    fn run(listener: Listener, addr: Addr, socket: Option<SocketAddr>, opts: Opts) -> FakeServer {
        let state = Arc::new(Mutex::new(State {
            mode: Mode::Normal,
            received: Vec::new(),
            workers: HashMap::new(),
            next_worker: opts.first_worker_id,
            placements: HashMap::new(),
            conns: 0,
        }));
        let (stop, _) = watch::channel(false);
        let (st, o, mut stop_rx) = (state.clone(), opts.clone(), stop.subscribe());
        tokio::spawn(async move {
            loop {
                let conn_no = {
                    let mut s = st.lock().unwrap();
                    s.conns += 1;
                    s.conns - 1
                };
                let (st, o, stop) = (st.clone(), o.clone(), stop_rx.clone());
                tokio::select! {
                    _ = stop_rx.wait_for(|s| *s) => break,
                    r = accept(&listener) => match r {
                        Some(Accepted::Tcp(s)) => { tokio::spawn(serve(s, st, o, conn_no, stop)); }
                        Some(Accepted::Unix(s)) => { tokio::spawn(serve(s, st, o, conn_no, stop)); }
                        None => break,
                    }
                }
            }
            if let Listener::Unix(_, p) = &listener {
                let _ = std::fs::remove_file(p);
            }
        });
        FakeServer {
            addr,
            socket,
            opts,
            state,
            stop,
        }
    }

    pub fn set_mode(&self, mode: Mode) {
        self.state.lock().unwrap().mode = mode;
    }

    pub fn received(&self) -> Vec<Got> {
        self.state.lock().unwrap().received.clone()
    }

    pub fn queries(&self) -> usize {
        self.count(|m| matches!(m, Msg::Query(_)))
    }

    pub fn count(&self, f: impl Fn(&Msg) -> bool) -> usize {
        self.state
            .lock()
            .unwrap()
            .received
            .iter()
            .filter(|g| f(&g.msg))
            .count()
    }

    /// Polls until `f` holds over the state, at most `timeout`; returns whether it did.
    pub async fn wait_until(&self, timeout: Duration, f: impl Fn(&State) -> bool) -> bool {
        let until = Instant::now() + timeout;
        loop {
            if f(&self.state.lock().unwrap()) {
                return true;
            }
            if Instant::now() > until {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// Stops listening and drops every connection, as a crashed server would.
    pub async fn kill(self) {
        let _ = self.stop.send(true);
        // Let the tasks see it and drop their sockets.
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

enum Accepted {
    Tcp(tokio::net::TcpStream),
    Unix(tokio::net::UnixStream),
}

async fn accept(l: &Listener) -> Option<Accepted> {
    match l {
        Listener::Tcp(l) => l.accept().await.ok().map(|(s, _)| {
            s.set_nodelay(true).ok();
            Accepted::Tcp(s)
        }),
        Listener::Unix(l, _) => l.accept().await.ok().map(|(s, _)| Accepted::Unix(s)),
    }
}

fn bytes(f: AlignedVec) -> Vec<u8> {
    f.as_slice().to_vec()
}

fn frame<M: kvix_client::wire::Body>(m: &M, id: u64) -> Vec<u8> {
    bytes(encode(m, id, 0).unwrap())
}

async fn serve<S>(
    s: S,
    st: Arc<Mutex<State>>,
    opts: Opts,
    conn: usize,
    mut stop: watch::Receiver<bool>,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut rd, mut wr) = tokio::io::split(s);
    let (tx, mut rx) = mpsc::unbounded_channel::<Option<Vec<u8>>>();
    let mut wstop = stop.clone();
    let writer = tokio::spawn(async move {
        loop {
            let m = tokio::select! {
                m = rx.recv() => m.flatten(),
                _ = wstop.wait_for(|s| *s) => None,
            };
            match m {
                Some(b) => {
                    if wr.write_all(&b).await.is_err() {
                        break;
                    }
                }
                None => break,
            }
        }
        let _ = wr.shutdown().await;
    });
    let mut frames = FrameReader::new(DEFAULT_MAX_FRAME);
    let mut hello_done = false;
    let mut held: Vec<Vec<u8>> = Vec::new();
    'outer: loop {
        let n = tokio::select! {
            r = rd.read(frames.spare()) => match r { Ok(0) | Err(_) => break, Ok(n) => n },
            _ = stop.wait_for(|s| *s) => break,
        };
        frames.filled(n);
        loop {
            let f = match frames.next() {
                Ok(Some(f)) => f,
                Ok(None) => break,
                Err(_) => break 'outer,
            };
            let (id, flags, len) = (f.header.request_id, f.header.flags, f.len);
            let Ok(msg) = f.message() else { break 'outer };
            let native = to_msg(&msg);
            frames.consume(len);
            st.lock().unwrap().received.push(Got {
                conn,
                flags,
                msg: native.clone(),
            });
            if !hello_done {
                let Msg::Hello(h) = native else { break 'outer };
                let refuse = if h.token_block != opts.token_block {
                    Some(ErrorCode::BlockSizeMismatch)
                } else if opts.auth.is_some() && h.auth != opts.auth {
                    Some(ErrorCode::Unauthorized)
                } else {
                    None
                };
                if let Some(code) = refuse {
                    let _ = tx.send(Some(frame(
                        &ErrorReply {
                            code,
                            message: format!("{code:?}"),
                        },
                        id,
                    )));
                    break 'outer;
                }
                match opts.bad_welcome {
                    Some(BadWelcome::Garbage) => {
                        let _ = tx.send(Some(vec![0x5A; 64]));
                        continue;
                    }
                    Some(BadWelcome::WrongKind) => {
                        let _ = tx.send(Some(frame(&Ack {}, id)));
                        continue;
                    }
                    _ => {}
                }
                let token_block = match opts.bad_welcome {
                    Some(BadWelcome::OtherBlock(b)) => b,
                    _ => opts.token_block,
                };
                let _ = tx.send(Some(frame(
                    &Welcome {
                        server: "fake".into(),
                        token_block,
                        byte_chunk: BYTE_CHUNK,
                        shards: 1,
                        max_frame: DEFAULT_MAX_FRAME,
                    },
                    id,
                )));
                hello_done = true;
                continue;
            }
            let wants_reply = flags & kvix_client::wire::FLAG_NO_REPLY == 0;
            let reply: Option<Vec<u8>> = match native {
                Msg::Query(q) => {
                    let mode = st.lock().unwrap().mode.clone();
                    let answer = || frame(&answer(&st.lock().unwrap(), &q), id);
                    match mode {
                        Mode::Normal => Some(answer()),
                        Mode::Delay(d) => {
                            let (a, tx) = (answer(), tx.clone());
                            tokio::spawn(async move {
                                tokio::time::sleep(d).await;
                                let _ = tx.send(Some(a));
                            });
                            None
                        }
                        Mode::BadMagic => {
                            let mut a = answer();
                            a[..4].copy_from_slice(b"XXXX");
                            Some(a)
                        }
                        Mode::GarbageBody => {
                            let mut head = [0u8; HEADER_LEN];
                            Header {
                                version: kvix_client::wire::PROTOCOL_VERSION,
                                kind: Kind::TieredAnswer as u8,
                                flags: 0,
                                request_id: id,
                                body_len: 16,
                            }
                            .write(&mut head);
                            let mut a = head.to_vec();
                            a.extend_from_slice(&[0xFF; 16]);
                            Some(a)
                        }
                        Mode::WrongKind => Some(frame(&Ack {}, id)),
                        Mode::CloseOnQuery => break 'outer,
                        Mode::Hold(n) => {
                            held.push(answer());
                            if held.len() >= n {
                                for a in held.drain(..).rev() {
                                    let _ = tx.send(Some(a));
                                }
                            }
                            None
                        }
                        Mode::Reject(code) => Some(frame(
                            &ErrorReply {
                                code,
                                message: "told to refuse".into(),
                            },
                            id,
                        )),
                        Mode::Silent => None,
                        Mode::Stale => {
                            let a = TieredAnswer {
                                stale: true,
                                ..self::answer(&st.lock().unwrap(), &q)
                            };
                            Some(frame(&a, id))
                        }
                    }
                }
                Msg::Announce(a) => {
                    let mut s = st.lock().unwrap();
                    let next = s.next_worker;
                    let created = !s.workers.contains_key(&a.name);
                    let worker = *s.workers.entry(a.name.clone()).or_insert(next);
                    if created {
                        s.next_worker += 1;
                    }
                    Some(frame(&Announced { worker, created }, id))
                }
                Msg::Retire(r) => {
                    let mut s = st.lock().unwrap();
                    let before = s.workers.len();
                    s.workers.retain(|_, w| *w != r.worker);
                    s.placements.remove(&r.worker);
                    Some(if s.workers.len() < before {
                        frame(&Ack {}, id)
                    } else {
                        frame(
                            &ErrorReply {
                                code: ErrorCode::UnknownWorker,
                                message: "no such worker".into(),
                            },
                            id,
                        )
                    })
                }
                Msg::Placement(p) => {
                    st.lock()
                        .unwrap()
                        .placements
                        .insert(p.worker, p.chain.clone());
                    Some(frame(&Ack {}, id))
                }
                Msg::Stats => {
                    let s = st.lock().unwrap();
                    Some(frame(
                        &Stats {
                            workers: s.workers.len() as u32,
                            queries: s
                                .received
                                .iter()
                                .filter(|g| matches!(g.msg, Msg::Query(_)))
                                .count() as u64,
                            ..Default::default()
                        },
                        id,
                    ))
                }
                Msg::Roster(r) => {
                    let s = st.lock().unwrap();
                    let mut workers: Vec<RosterEntry> = s
                        .workers
                        .iter()
                        .filter(|(n, w)| **w >= r.from || r.names.contains(n))
                        .map(|(name, &worker)| RosterEntry {
                            worker,
                            name: name.clone(),
                        })
                        .collect();
                    workers.sort_by_key(|w| w.worker);
                    Some(frame(
                        &Roster {
                            workers,
                            next: s.next_worker,
                            more: false,
                            reissued: 0,
                        },
                        id,
                    ))
                }
                Msg::Echo(e) => Some(frame(
                    &Echo {
                        payload: vec![0xAB; e.reply_len as usize],
                        reply_len: e.reply_len,
                    },
                    id,
                )),
                Msg::Hello(_) | Msg::Other(_) => Some(frame(
                    &ErrorReply {
                        code: ErrorCode::BadFrame,
                        message: "unexpected".into(),
                    },
                    id,
                )),
            };
            if let Some(r) = reply {
                if wants_reply {
                    let _ = tx.send(Some(r));
                }
            }
        }
    }
    let _ = tx.send(None);
    let _ = writer.await;
}

fn to_msg(m: &MessageRef<'_>) -> Msg {
    match m {
        MessageRef::Hello(h) => Msg::Hello(to_native::<Hello>(h)),
        MessageRef::TieredQuery(q) => Msg::Query(to_native::<TieredQuery>(q)),
        MessageRef::Announce(a) => Msg::Announce(to_native::<Announce>(a)),
        MessageRef::Retire(r) => Msg::Retire(to_native::<Retire>(r)),
        MessageRef::Placement(p) => Msg::Placement(to_native::<Placement>(p)),
        MessageRef::StatsRequest(_) => Msg::Stats,
        MessageRef::Echo(e) => Msg::Echo(to_native::<Echo>(e)),
        MessageRef::RosterRequest(r) => Msg::Roster(to_native::<RosterRequest>(r)),
        other => Msg::Other(other.kind()),
    }
}

/// Per worker with a placement: the common prefix of its chain and the query's (on GPU).
fn answer(s: &State, q: &TieredQuery) -> TieredAnswer {
    let mut scores: Vec<TieredScore> = s
        .placements
        .iter()
        .filter(|(w, _)| q.candidates.is_empty() || q.candidates.contains(w))
        .map(|(w, chain)| TieredScore {
            worker: *w,
            tiers: Depths::gpu_only(
                chain
                    .iter()
                    .zip(&q.chain)
                    .take_while(|(a, b)| a == b)
                    .count() as u32,
            ),
            suspect: None,
        })
        .filter(|s| s.tiers.storage > 0)
        .collect();
    scores.sort_by(|a, b| {
        b.tiers
            .storage
            .cmp(&a.tiers.storage)
            .then(a.worker.cmp(&b.worker))
    });
    if q.top_k > 0 {
        scores.truncate(q.top_k as usize);
    }
    TieredAnswer {
        scores,
        ..TieredAnswer::default()
    }
}
