//! Network helpers shared by `latency`, `load`, `redis` and `trace` against a server:
//!
//! - [`WireConn`]: a minimal kvix-wire connection for what a *worker* (not a gateway)
//!   sends — announces and event batches — since kvix-client is the gateway's library;
//! - [`Dataset`]: prompts and who holds which prefix of them, preloaded into a server
//!   (and into Redis) so the measured queries hit;
//! - [`gateway`]: a kvix-client connection configured for measurement.
//!
//! Every address must be a loopback address: benches never leave 127.0.0.1.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{bail, Context};
use kvix_client::{Addr, Client, ClientConfig};
use kvix_wire::chain::token_chain;
use kvix_wire::{
    encode, to_native, AlignedVec, Announce, Announced, Applied, Body, ErrorCode, Event,
    EventBatch, Feed, FrameReader, Header, Hello, Keyspace, Lane, MessageRef, Retire, Welcome,
    DEFAULT_MAX_FRAME,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::rng::Rng;

/// Parses `addr` and refuses anything but a loopback address.
pub fn loopback(addr: &str) -> anyhow::Result<SocketAddr> {
    let a: SocketAddr = addr
        .parse()
        .with_context(|| format!("{addr:?} is not an ip:port address"))?;
    if !a.ip().is_loopback() {
        bail!("{addr}: benches only talk to loopback addresses (127.0.0.1)");
    }
    Ok(a)
}

/// A received frame, owned: its header, kind and body.
pub struct Received {
    pub header: Header,
    kind: kvix_wire::Kind,
    body: AlignedVec,
}

impl Received {
    /// The validated message, borrowed from the body.
    pub fn message(&self) -> anyhow::Result<MessageRef<'_>> {
        Ok(MessageRef::view(self.kind, &self.body)?)
    }
}

/// The transport of a [`WireConn`]: TCP, or TLS over it.
enum Stream {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
}

impl Stream {
    async fn write_all(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        match self {
            Stream::Plain(s) => s.write_all(bytes).await,
            Stream::Tls(s) => {
                s.write_all(bytes).await?;
                s.flush().await
            }
        }
    }

    async fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Stream::Plain(s) => s.read(buf).await,
            Stream::Tls(s) => s.read(buf).await,
        }
    }

    /// What can be read without waiting (`WouldBlock`: nothing).
    fn try_read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        use std::task::{Context, Poll, Waker};
        match self {
            Stream::Plain(s) => s.try_read(buf),
            Stream::Tls(s) => {
                let mut read = tokio::io::ReadBuf::new(buf);
                let mut cx = Context::from_waker(Waker::noop());
                match tokio::io::AsyncRead::poll_read(
                    std::pin::Pin::new(&mut **s),
                    &mut cx,
                    &mut read,
                ) {
                    Poll::Ready(Ok(())) => Ok(read.filled().len()),
                    Poll::Ready(Err(e)) => Err(e),
                    Poll::Pending => Err(std::io::ErrorKind::WouldBlock.into()),
                }
            }
        }
    }
}

/// One kvix-wire connection speaking the protocol directly (worker side).
pub struct WireConn {
    stream: Stream,
    next_id: u64,
    pub welcome: Welcome,
    wbuf: AlignedVec,
    frames: FrameReader,
}

/// Batch `seq` of `worker`: `chain` stored from block 0 on lane 0, without engine hashes.
pub fn stored(worker: u32, seq: u64, keyspace: &Keyspace, chain: Vec<u64>) -> EventBatch {
    EventBatch {
        worker,
        seq,
        keyspace: keyspace.clone(),
        events: vec![Event::Stored {
            lane: 0,
            start: 0,
            parent: None,
            chain,
            engine: Vec::new(),
        }],
    }
}

impl WireConn {
    /// Connects and shakes hands with `token_block`.
    pub async fn connect(addr: SocketAddr, token_block: u32) -> anyhow::Result<WireConn> {
        Self::connect_with(addr, token_block, None).await
    }

    /// Connects (through `tls` where given: a server with `--tls-cert`) and shakes
    /// hands with `token_block`.
    pub async fn connect_with(
        addr: SocketAddr,
        token_block: u32,
        tls: Option<&kvix_client::ClientTls>,
    ) -> anyhow::Result<WireConn> {
        let tcp = tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(addr))
            .await
            .context("connect timed out")?
            .with_context(|| format!("connecting to {addr}"))?;
        tcp.set_nodelay(true)?;
        let stream = match tls {
            None => Stream::Plain(tcp),
            Some(t) => {
                let name = match &t.server_name {
                    Some(n) => rustls::pki_types::ServerName::try_from(n.clone())?,
                    None => rustls::pki_types::ServerName::from(addr.ip()),
                };
                let tls = tokio_rustls::TlsConnector::from(t.rustls_config()?)
                    .connect(name, tcp)
                    .await
                    .with_context(|| format!("TLS with {addr}"))?;
                Stream::Tls(Box::new(tls))
            }
        };
        let mut c = WireConn {
            stream,
            next_id: 1,
            welcome: Welcome {
                server: String::new(),
                token_block,
                byte_chunk: 0,
                shards: 0,
                max_frame: DEFAULT_MAX_FRAME,
            },
            wbuf: AlignedVec::new(),
            frames: FrameReader::new(u32::MAX),
        };
        c.send(
            &Hello {
                client: "kvix-bench-worker".into(),
                token_block,
                auth: None,
            },
            0,
        )
        .await?;
        let r = c.recv().await?;
        match r.message()? {
            MessageRef::Welcome(w) => c.welcome = to_native::<Welcome>(w),
            MessageRef::ErrorReply(e) => bail!("handshake refused: {}", e.message),
            other => bail!("unexpected {:?} to Hello", other.kind()),
        }
        Ok(c)
    }

    /// Queues `msg` in the write buffer (sent by [`WireConn::flush`]); returns its id.
    pub fn queue<M: Body>(&mut self, msg: &M, flags: u8) -> anyhow::Result<u64> {
        let id = self.next_id;
        self.next_id += 1;
        let buf = std::mem::take(&mut self.wbuf);
        self.wbuf = kvix_wire::encode_into(msg, id, flags, buf)?;
        Ok(id)
    }

    pub async fn flush(&mut self) -> anyhow::Result<()> {
        if !self.wbuf.is_empty() {
            self.stream.write_all(&self.wbuf).await?;
            self.wbuf.clear();
        }
        Ok(())
    }

    /// Sends one message now.
    pub async fn send<M: Body>(&mut self, msg: &M, flags: u8) -> anyhow::Result<u64> {
        let id = self.next_id;
        self.next_id += 1;
        let frame = encode(msg, id, flags)?;
        self.stream.write_all(&frame).await?;
        Ok(id)
    }

    /// The error codes of the refusals the server has sent so far to requests sent
    /// without wanting a reply (it answers those only to refuse them), without waiting.
    pub fn refusals(&mut self) -> anyhow::Result<Vec<ErrorCode>> {
        loop {
            match self.stream.try_read(self.frames.spare()) {
                Ok(0) => bail!("the server closed the connection"),
                Ok(n) => self.frames.filled(n),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(e.into()),
            }
        }
        let mut codes = Vec::new();
        while let Some(f) = self.frames.next()? {
            let len = f.len;
            if let MessageRef::ErrorReply(e) = f.message()? {
                codes.push(to_native::<kvix_wire::ErrorReply>(e).code);
            }
            self.frames.consume(len);
        }
        Ok(codes)
    }

    /// Reads one frame.
    pub async fn recv(&mut self) -> anyhow::Result<Received> {
        loop {
            if let Some(f) = self.frames.next()? {
                let (header, kind, len) = (f.header, f.kind, f.len);
                let mut body = AlignedVec::with_capacity(f.body.len());
                body.extend_from_slice(f.body);
                self.frames.consume(len);
                return Ok(Received { header, kind, body });
            }
            let n = tokio::time::timeout(
                Duration::from_secs(10),
                self.stream.read(self.frames.spare()),
            )
            .await
            .context("no reply within 10 s")??;
            if n == 0 {
                bail!("the server closed the connection");
            }
            self.frames.filled(n);
        }
    }

    /// Announces a plain worker (one full-attention lane) and returns its id.
    pub async fn announce(&mut self, name: &str, feed: Feed) -> anyhow::Result<u32> {
        let block = self.welcome.token_block;
        self.send(
            &Announce {
                name: name.into(),
                lanes: vec![Lane::full(block)],
                feed,
                source: None,
            },
            0,
        )
        .await?;
        let r = self.recv().await?;
        match r.message()? {
            MessageRef::Announced(a) => Ok(to_native::<Announced>(a).worker),
            MessageRef::ErrorReply(e) => bail!("announce {name} refused: {}", e.message),
            other => bail!("unexpected {:?} to Announce", other.kind()),
        }
    }

    /// Retires a worker (forgets it and its blocks).
    pub async fn retire(&mut self, worker: u32) -> anyhow::Result<()> {
        self.send(&Retire { worker }, 0).await?;
        let r = self.recv().await?;
        match r.message()? {
            MessageRef::Ack(_) => Ok(()),
            MessageRef::ErrorReply(e) => bail!("retire {worker} refused: {}", e.message),
            other => bail!("unexpected {:?} to Retire", other.kind()),
        }
    }

    /// Sends event batches with replies, at most `window` in flight, and checks every
    /// reply is `Applied`.
    pub async fn apply_all(&mut self, batches: &[EventBatch], window: usize) -> anyhow::Result<()> {
        let mut pending = 0usize;
        for b in batches {
            self.queue(b, 0)?;
            pending += 1;
            if pending >= window {
                self.flush().await?;
                while pending > window / 2 {
                    self.expect_applied().await?;
                    pending -= 1;
                }
            }
        }
        self.flush().await?;
        while pending > 0 {
            self.expect_applied().await?;
            pending -= 1;
        }
        Ok(())
    }

    pub async fn expect_applied(&mut self) -> anyhow::Result<()> {
        let r = self.recv().await?;
        match r.message()? {
            MessageRef::Applied(a) => {
                let _ = to_native::<Applied>(a);
                Ok(())
            }
            MessageRef::ErrorReply(e) => bail!("event batch refused: {}", e.message),
            other => bail!("unexpected {:?} to EventBatch", other.kind()),
        }
    }
}

/// A kvix-client connection for measurement: one server, a generous deadline unless
/// given (latency runs measure, they do not fail open), optional spinning.
pub async fn gateway(
    addrs: &[SocketAddr],
    token_block: u32,
    deadline: Duration,
    spin: Option<Duration>,
    name: &str,
) -> anyhow::Result<Client> {
    gateway_with(addrs, token_block, deadline, spin, name, None).await
}

/// [`gateway`], over TLS where `tls` is given.
pub async fn gateway_with(
    addrs: &[SocketAddr],
    token_block: u32,
    deadline: Duration,
    spin: Option<Duration>,
    name: &str,
    tls: Option<kvix_client::ClientTls>,
) -> anyhow::Result<Client> {
    let cfg = ClientConfig {
        tls,
        token_block,
        deadline,
        name: name.into(),
        spin_before_park: spin,
        placement_queue: 1 << 16,
        // Several addresses are replicas of one log (kvix-server --log).
        replicas: addrs.len() > 1,
        ..ClientConfig::new(addrs.iter().map(|a| Addr::tcp(a.to_string())))
    };
    let shown = addrs
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let c = Client::connect(cfg)
        .await
        .map_err(|e| anyhow::anyhow!("kvix-client connect to {shown}: {e}"))?;
    if !c.wait_connected(Duration::from_secs(5)).await {
        bail!("kvix-client: no connection to {shown} within 5 s");
    }
    Ok(c)
}

/// Prompts grouped by chain length, and who holds which prefix of each.
#[derive(Debug, Clone)]
pub struct Dataset {
    pub keyspace: Keyspace,
    pub token_block: u32,
    pub workers: Vec<String>,
    /// `chains[g]`: the prompts of length `lengths[g]` blocks.
    pub lengths: Vec<u32>,
    pub chains: Vec<Vec<Vec<u64>>>,
    /// `tokens[g][c]`: the token ids `chains[g][c]` hashes.
    pub tokens: Vec<Vec<Vec<u32>>>,
    /// (worker index, length group, chain index, held prefix blocks).
    pub holdings: Vec<(usize, usize, usize, u32)>,
    /// Blocks of the system prefix every worker holds.
    pub system_blocks: u32,
}

impl Dataset {
    /// `per_length` prompts of each length; each prompt starts with a system prefix of
    /// `system_blocks` blocks every worker holds, and is held whole by one worker, to
    /// half its length by another and to a quarter by a third.
    pub fn build(
        seed: u64,
        token_block: u32,
        workers: usize,
        lengths: &[u32],
        per_length: usize,
        system_blocks: u32,
    ) -> Dataset {
        let keyspace = Keyspace::tokens("kvix-bench");
        let ks_seed = keyspace.seed(token_block);
        let mut rng = Rng::new(seed);
        let rand_tokens = |rng: &mut Rng, n: usize| -> Vec<u32> {
            (0..n).map(|_| (rng.next_u64() >> 40) as u32).collect()
        };
        let system = rand_tokens(&mut rng, (system_blocks * token_block) as usize);
        let workers_n = workers.max(1);
        let (mut chains, mut all_tokens) = (Vec::new(), Vec::new());
        let mut holdings = Vec::new();
        for (g, &len) in lengths.iter().enumerate() {
            let (mut group, mut group_tokens) = (Vec::new(), Vec::new());
            for c in 0..per_length {
                let sys = system_blocks.min(len) as usize * token_block as usize;
                let mut tokens = system[..sys].to_vec();
                tokens.extend(rand_tokens(
                    &mut rng,
                    (len as usize * token_block as usize).saturating_sub(sys),
                ));
                group.push(token_chain(ks_seed, token_block, &tokens));
                group_tokens.push(tokens);
                for (k, depth) in [(0u64, len), (1, len / 2), (2, len / 4)] {
                    if depth == 0 {
                        continue;
                    }
                    let w = (rng.below(workers_n as u64) + k) as usize % workers_n;
                    holdings.push((w, g, c, depth));
                }
            }
            chains.push(group);
            all_tokens.push(group_tokens);
        }
        Dataset {
            keyspace,
            token_block,
            workers: (0..workers_n)
                .map(|w| format!("bench-worker-{w}"))
                .collect(),
            lengths: lengths.to_vec(),
            chains,
            tokens: all_tokens,
            holdings,
            system_blocks,
        }
    }

    /// The chain of the system prefix (every worker holds it).
    pub fn system_chain(&self) -> Vec<u64> {
        self.chains
            .iter()
            .flatten()
            .find(|c| c.len() >= self.system_blocks as usize)
            .map(|c| c[..self.system_blocks as usize].to_vec())
            .unwrap_or_default()
    }

    /// Per worker, the (start, chain) prefixes it holds, system prefix first.
    pub fn held(&self) -> Vec<Vec<Vec<u64>>> {
        let sys = self.system_chain();
        let mut out: Vec<Vec<Vec<u64>>> = vec![vec![sys]; self.workers.len()];
        for &(w, g, c, depth) in &self.holdings {
            out[w].push(self.chains[g][c][..depth as usize].to_vec());
        }
        out
    }

    /// Announces every worker (event feed) and stores its holdings on a server; returns
    /// the worker ids in dataset order.
    pub async fn preload(&self, conn: &mut WireConn) -> anyhow::Result<Vec<u32>> {
        // Announce, retire, announce again: a fresh worker whatever an earlier run left
        // (its blocks and its sequence baseline), so every batch below is applied.
        let mut ids = Vec::with_capacity(self.workers.len());
        for name in &self.workers {
            let id = conn.announce(name, Feed::Events).await?;
            conn.retire(id).await?;
            ids.push(conn.announce(name, Feed::Events).await?);
        }
        let mut batches = Vec::new();
        for (w, held) in self.held().into_iter().enumerate() {
            for (seq, chain) in held.into_iter().enumerate() {
                batches.push(stored(ids[w], seq as u64 + 1, &self.keyspace, chain));
            }
        }
        conn.apply_all(&batches, 64).await?;
        Ok(ids)
    }
}
