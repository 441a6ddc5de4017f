//! The sessions and engines both routing benchmarks run: `sim` in simulated time,
//! `fleet` in real time on the wire.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, clap::Args)]
pub struct Workload {
    /// Seed of everything drawn: sessions' contents, gateways, think times, arrivals.
    #[arg(long, default_value_t = Workload::default().seed)]
    pub seed: u64,
    /// Turns per session (turn t+1 extends turn t's prompt and output).
    #[arg(long, default_value_t = Workload::default().turns)]
    pub turns: u32,
    /// Tokens of the system prefix all sessions share.
    #[arg(long, default_value_t = Workload::default().system_tokens)]
    pub system_tokens: u32,
    /// Mean tokens of the first user message (uniform in [mean/2, 3·mean/2]).
    #[arg(long, default_value_t = Workload::default().user_tokens)]
    pub user_tokens: u32,
    /// Mean tokens of each follow-up user message.
    #[arg(long, default_value_t = Workload::default().followup_tokens)]
    pub followup_tokens: u32,
    /// Mean output tokens per turn.
    #[arg(long, default_value_t = Workload::default().output_tokens)]
    pub output_tokens: u32,
    /// Mean think time between a reply and the next turn (exponential), ms.
    #[arg(long, default_value_t = Workload::default().think_ms)]
    pub think_ms: f64,
    /// Each worker's prefix cache, in blocks.
    #[arg(long, default_value_t = Workload::default().capacity_blocks)]
    pub capacity_blocks: u32,
    #[arg(long, default_value_t = Workload::default().block_tokens)]
    pub block_tokens: u32,
    /// Load penalty: blocks of reuse one more request in flight is worth.
    #[arg(long, default_value_t = Workload::default().alpha)]
    pub alpha: f64,
    /// Prefill µs per uncached prompt token.
    #[arg(long, default_value_t = Workload::default().prefill_us_per_token)]
    pub prefill_us_per_token: f64,
    /// Decode ms per output token.
    #[arg(long, default_value_t = Workload::default().decode_ms_per_token)]
    pub decode_ms_per_token: f64,
    /// Each worker's CPU tier, in blocks (0: none): what the GPU cache computes is
    /// offloaded there too (vLLM's offloading connector), and a prompt continuing from
    /// it is loaded rather than recomputed.
    #[arg(long, default_value_t = Workload::default().cpu_capacity_blocks)]
    pub cpu_capacity_blocks: u32,
    /// µs to load one block from the CPU tier (recomputing it costs
    /// `block_tokens` × `prefill_us_per_token`).
    #[arg(long, default_value_t = Workload::default().cpu_load_us_per_block)]
    pub cpu_load_us_per_block: f64,
}

impl Default for Workload {
    fn default() -> Self {
        Workload {
            seed: 1,
            turns: 2,
            system_tokens: 2048,
            user_tokens: 1024,
            followup_tokens: 128,
            output_tokens: 256,
            think_ms: 2000.0,
            capacity_blocks: 4096,
            block_tokens: 16,
            alpha: 4.0,
            prefill_us_per_token: 50.0,
            decode_ms_per_token: 10.0,
            cpu_capacity_blocks: 0,
            cpu_load_us_per_block: 80.0,
        }
    }
}
