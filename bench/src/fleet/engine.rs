//! A mock inference engine: a prefix cache of a set block capacity (LRU), request slots
//! (continuous batching: beyond them requests queue, first come first served), a time
//! model (prefill per uncached prompt token, decode per output token) and, as a vLLM 0.34
//! engine started with `--kv-events-config '{"publisher": "zmq", "endpoint":
//! "tcp://kvix:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv@<host>@<model>"}'`
//! does, its KV events on a PUB socket connected to kvix, with a replay ROUTER
//! (`kvix_events::encode` writes the batches byte for byte as vLLM does).
//!
//! With a CPU tier (`cpu_capacity_blocks`), every block the GPU cache stores is also
//! offloaded to a CPU LRU, as vLLM 0.34's offloading connector does, and published as a
//! CPU store (`medium: CPU`, self-describing: tokens and parent); each tier's evictions
//! are its own removals. A prompt loads the GPU prefix, then what continues from CPU
//! (`cpu_load_us_per_block` each), and prefills the rest.
//!
//! What it reports for each request is the truth the fleet's figures use: the blocks of
//! the prompt it actually held, by tier, when the request's prefill started.

use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kvix_events::encode::vllm_batch;
use kvix_events::payload::{Batch, EngineEvent, Medium, Removed, Stored};
use kvix_wire::chain::chain_tokens;
use tokio::sync::Semaphore;

use crate::lru::{Admitted, LruCache};
use crate::rng::mix;

/// Batches an engine keeps for replay (vLLM's `buffer_steps` default).
const REPLAY_BUFFER: usize = 10_000;
/// The replay's end marker, as vLLM sends it: seq -1.
const END_SEQ: [u8; 8] = (-1i64).to_be_bytes();

/// How long a request takes on an engine.
#[derive(Debug, Clone, Copy)]
pub struct TimeModel {
    pub prefill_us_per_token: f64,
    pub decode_ms_per_token: f64,
    pub cpu_load_us_per_block: f64,
}

impl TimeModel {
    /// Time to first token's own part: loading `from_cpu` blocks and prefilling
    /// `uncached_tokens`.
    pub fn prefill(&self, uncached_tokens: usize, from_cpu: u32) -> Duration {
        Duration::from_secs_f64(
            (uncached_tokens as f64 * self.prefill_us_per_token
                + f64::from(from_cpu) * self.cpu_load_us_per_block)
                * 1e-6,
        )
    }

    fn decode(&self, output_tokens: usize) -> Duration {
        Duration::from_secs_f64(output_tokens as f64 * self.decode_ms_per_token * 1e-3)
    }
}

/// What every engine of a fleet is.
#[derive(Debug, Clone, Copy)]
pub struct EngineSpec {
    pub capacity_blocks: usize,
    /// The CPU tier's blocks (0: none).
    pub cpu_capacity_blocks: usize,
    pub block_tokens: u32,
    /// Requests it runs at once.
    pub slots: usize,
    pub time: TimeModel,
}

/// Where an engine publishes its KV events.
#[derive(Debug, Clone)]
pub struct EventsTo {
    /// kvix's `--events-bind` endpoint, which the engine's PUB connects to.
    pub kvix: String,
    /// The port of the replay ROUTER the engine binds at its own host.
    pub replay_port: u16,
    /// The model named in the topic `kv@<host>@<model>`.
    pub model: String,
}

/// One engine's KV event publisher: PUB connected to kvix, replay ROUTER bound at the
/// engine's host, and the last batches for replay.
struct Publisher {
    socket: zmq::Socket,
    replay: zmq::Socket,
    topic: Vec<u8>,
    next_seq: u64,
    buffer: VecDeque<(u64, Vec<u8>)>,
}

impl Publisher {
    fn start(ctx: &zmq::Context, host: &str, to: &EventsTo) -> anyhow::Result<Publisher> {
        let socket = ctx.socket(zmq::PUB)?;
        socket.set_linger(0)?;
        socket.set_sndhwm(100_000)?;
        // From the engine's own address, as each engine pod has its own.
        let kvix = to.kvix.trim_start_matches("tcp://");
        socket.connect(&format!("tcp://{host}:0;{kvix}"))?;
        let replay = ctx.socket(zmq::ROUTER)?;
        replay.set_linger(0)?;
        // A whole buffer and its end marker fit the send queue (vLLM 0.34 does this; its
        // older releases kept libzmq's 1,000 and lost replies).
        replay.set_sndhwm(REPLAY_BUFFER as i32 + 1)?;
        let at = format!("tcp://{host}:{}", to.replay_port);
        replay
            .bind(&at)
            .map_err(|e| anyhow::anyhow!("engine {host}: replay bind {at}: {e}"))?;
        Ok(Publisher {
            socket,
            replay,
            topic: format!("kv@{host}@{}", to.model).into_bytes(),
            next_seq: 0,
            buffer: VecDeque::new(),
        })
    }

    fn publish(&mut self, events: Vec<EngineEvent>) {
        let payload = payload_now(events);
        let seq = self.next_seq;
        self.next_seq += 1;
        // A PUB never blocks: past its high-water mark it drops, as the engine's does;
        // replay fills the hole.
        let _ = self.socket.send_multipart(
            [&self.topic[..], &seq.to_be_bytes()[..], &payload[..]],
            zmq::DONTWAIT,
        );
        if self.buffer.len() == REPLAY_BUFFER {
            self.buffer.pop_front();
        }
        self.buffer.push_back((seq, payload));
    }

    /// Answers the replay requests waiting: `[id, "", start]` gets every buffered batch
    /// from `start` on, then the end marker.
    fn serve_replay(&mut self) {
        while let Ok(req) = self.replay.recv_multipart(zmq::DONTWAIT) {
            let [id, _, start] = &req[..] else { continue };
            let Ok(start) = <[u8; 8]>::try_from(&start[..]).map(u64::from_be_bytes) else {
                continue;
            };
            for (seq, payload) in self.buffer.iter().filter(|(s, _)| *s >= start) {
                let frames = [
                    &id[..],
                    b"",
                    &self.topic[..],
                    &seq.to_be_bytes()[..],
                    &payload[..],
                ];
                let _ = self.replay.send_multipart(frames, zmq::DONTWAIT);
            }
            let _ = self
                .replay
                .send_multipart([&id[..], b"", b"", &END_SEQ[..], b""], zmq::DONTWAIT);
        }
    }
}

struct State {
    cache: LruCache,
    cpu: Option<LruCache>,
    events: Option<Publisher>,
    published: u64,
}

/// A session's tokens so far and the chain of their whole blocks, hashed as they come.
#[derive(Debug, Clone)]
pub struct Conversation {
    pub tokens: Vec<u32>,
    pub chain: Vec<u64>,
    seed: u64,
    block_tokens: u32,
}

impl Conversation {
    /// An empty conversation in the keyspace of `seed`.
    pub fn new(seed: u64, block_tokens: u32) -> Self {
        Conversation {
            tokens: Vec::new(),
            chain: Vec::new(),
            seed,
            block_tokens,
        }
    }

    /// Appends `more`, hashing the blocks it completes from where the chain ends.
    pub fn extend(&mut self, more: &[u32]) {
        self.tokens.extend_from_slice(more);
        let from = self.chain.len() * self.block_tokens as usize;
        let seed = self.chain.last().copied().unwrap_or(self.seed);
        chain_tokens(
            seed,
            self.block_tokens,
            &self.tokens[from..],
            &mut self.chain,
        );
    }
}

/// The leading blocks of a prompt an engine holds: on GPU, and continuing from CPU
/// (cumulative: `cpu >= gpu`, the blocks loaded rather than prefilled).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Held {
    pub gpu: u32,
    pub cpu: u32,
}

/// What serving one request came to.
#[derive(Debug, Clone, Copy)]
pub struct Served {
    /// Prompt blocks the engine held (any tier) when the prefill started.
    pub reused_blocks: u32,
    /// Of those, the blocks loaded from CPU.
    pub from_cpu: u32,
    /// Arrival to the first token: the wait for a slot, then loading and prefill.
    pub ttft: Duration,
    /// The time model's loading and prefill alone (no wait): what the choice of engine
    /// cost, free of queues and of this machine's timing.
    pub prefill: Duration,
    /// Arrival to completion.
    pub e2e: Duration,
}

/// One mock engine; its name is the host its replay endpoint is bound at, and the name
/// of its worker in kvix.
pub struct Engine {
    pub name: String,
    spec: EngineSpec,
    slots: Semaphore,
    state: Mutex<State>,
}

impl Engine {
    /// An engine at loopback address `host` (127.x.y.z: every engine has its own, as
    /// every pod has its own IP); with `events`, it publishes its KV events.
    pub fn start(
        ctx: &zmq::Context,
        host: String,
        spec: &EngineSpec,
        events: Option<&EventsTo>,
    ) -> anyhow::Result<Engine> {
        let events = events
            .map(|to| Publisher::start(ctx, &host, to))
            .transpose()?;
        Ok(Engine {
            name: host,
            spec: *spec,
            slots: Semaphore::new(spec.slots),
            state: Mutex::new(State {
                cache: LruCache::new(spec.capacity_blocks),
                cpu: cpu_tier(spec),
                events,
                published: 0,
            }),
        })
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The leading blocks of `chain` this engine holds now, by tier (what an oracle
    /// reads).
    pub fn held(&self, chain: &[u64]) -> Held {
        self.state().held(chain)
    }

    /// The blocks of `chain` this engine can reuse now from any tier.
    pub fn reusable(&self, chain: &[u64]) -> u32 {
        self.held(chain).cpu
    }

    /// Admits `chain` (of `tokens`) to the GPU cache, and offloads it to the CPU tier,
    /// publishing what that stored and evicted; what was held before.
    pub fn admit(&self, chain: &[u64], tokens: &[u32]) -> Held {
        let mut st = self.state();
        let held = st.held(chain);
        let on_gpu = st.cache.admit(chain);
        let mut events = self.events(&on_gpu, Medium::Gpu, chain, tokens);
        if let Some(cpu) = st.cpu.as_mut() {
            let on_cpu = cpu.admit(chain);
            events.extend(self.events(&on_cpu, Medium::Cpu, chain, tokens));
        }
        if let (Some(p), false) = (st.events.as_mut(), events.is_empty()) {
            p.publish(events);
            st.published += 1;
        }
        held
    }

    /// The engine's events for one admission to one tier: a store per new run (engine
    /// hashes, the parent's, the run's tokens), one removal for what was evicted.
    fn events(
        &self,
        admitted: &Admitted,
        medium: Medium,
        chain: &[u64],
        tokens: &[u32],
    ) -> Vec<EngineEvent> {
        let bt = self.spec.block_tokens as usize;
        let mut events: Vec<EngineEvent> = admitted
            .stored
            .iter()
            .map(|&(start, len)| {
                let (s, e) = (start as usize, (start + len) as usize);
                EngineEvent::Stored(Stored {
                    medium,
                    ..Stored::plain(
                        chain[s..e].iter().map(|&h| engine_hash(h)).collect(),
                        s.checked_sub(1).map(|p| engine_hash(chain[p])),
                        tokens[s * bt..e * bt].to_vec(),
                        self.spec.block_tokens,
                    )
                })
            })
            .collect();
        if !admitted.evicted.is_empty() {
            let evicted = admitted.evicted.iter().map(|&h| engine_hash(h)).collect();
            events.push(EngineEvent::Removed(Removed::new(evicted, medium, 0)));
        }
        events
    }

    /// Serves one request that arrived at `arrival`: waits for a slot, prefills what the
    /// cache lacks of the conversation so far (the prompt), decodes `output` onto it, and
    /// keeps the prompt and the output's whole blocks cached.
    pub async fn serve(
        &self,
        conversation: &mut Conversation,
        output: &[u32],
        arrival: Instant,
    ) -> Served {
        let _slot = self.slots.acquire().await.expect("slots are never closed");
        let held = self.admit(&conversation.chain, &conversation.tokens);
        let uncached = conversation
            .tokens
            .len()
            .saturating_sub(held.cpu as usize * self.spec.block_tokens as usize);
        let from_cpu = held.cpu - held.gpu;
        let prefill = self.spec.time.prefill(uncached, from_cpu);
        tokio::time::sleep(prefill).await;
        let ttft = arrival.elapsed();
        tokio::time::sleep(self.spec.time.decode(output.len())).await;
        conversation.extend(output);
        self.admit(&conversation.chain, &conversation.tokens);
        Served {
            reused_blocks: held.cpu,
            from_cpu,
            ttft,
            prefill,
            e2e: arrival.elapsed(),
        }
    }

    /// An empty batch, as an engine's first message may be lost before its PUB has
    /// connected: kvix announces the worker at the first one it sees and replays the rest.
    pub fn heartbeat(&self) {
        if let Some(p) = self.state().events.as_mut() {
            p.publish(Vec::new());
        }
    }

    /// Answers replay requests waiting on this engine's ROUTER.
    pub fn serve_replay(&self) {
        if let Some(p) = self.state().events.as_mut() {
            p.serve_replay();
        }
    }

    /// The engine process restarts: its cache is empty, its sequence starts again at 0
    /// on new sockets, its replay buffer is gone. Requests wait meanwhile, as for a
    /// process that is starting.
    pub fn restart(&self, ctx: &zmq::Context, to: Option<&EventsTo>) -> anyhow::Result<()> {
        let mut st = self.state();
        st.cache = LruCache::new(self.spec.capacity_blocks);
        st.cpu = cpu_tier(&self.spec);
        if let Some(to) = to {
            st.events = None; // closes the old sockets
                              // libzmq releases the old replay port in its I/O thread, a moment later.
            let deadline = Instant::now() + Duration::from_secs(5);
            st.events = Some(loop {
                match Publisher::start(ctx, &self.name, to) {
                    Ok(p) => break p,
                    Err(_) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(10))
                    }
                    Err(e) => return Err(e),
                }
            });
        }
        Ok(())
    }

    /// Batches published so far.
    pub fn published(&self) -> u64 {
        self.state().published
    }
}

impl State {
    fn held(&self, chain: &[u64]) -> Held {
        let gpu = self.cache.reusable(chain);
        let from_cpu = self
            .cpu
            .as_ref()
            .map_or(0, |cpu| cpu.reusable(&chain[gpu..]));
        Held {
            gpu: gpu as u32,
            cpu: (gpu + from_cpu) as u32,
        }
    }
}

fn cpu_tier(spec: &EngineSpec) -> Option<LruCache> {
    (spec.cpu_capacity_blocks > 0).then(|| LruCache::new(spec.cpu_capacity_blocks))
}

/// A vLLM 0.34 batch of `events` from DP rank 0, stamped now, as an engine publishes it.
pub fn payload_now(events: Vec<EngineEvent>) -> Vec<u8> {
    let ts = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    vllm_batch(&Batch {
        ts,
        events,
        dp_rank: 0,
    })
}

/// The engine's own hash of a block: unrelated to kvix's keys, as a real engine's are;
/// kvix rehashes the tokens.
fn engine_hash(key: u64) -> u64 {
    mix(key ^ 0x5EED_0FE9_61E5)
}
