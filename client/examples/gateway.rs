//! A gateway's use of kvix-client, end to end:
//!
//! ```text
//! cargo run -p kvix-client --example gateway [ADDR]   # default 127.0.0.1:7420
//! ```
//!
//! Connects, announces two workers, publishes a placement for one of them, queries the
//! same prompt and prints the outcome and the client's counters. Exits with a clear
//! message (status 2) when no server is running.

use std::time::Duration;

use kvix_client::wire::{Feed, Keyspace, Lane};
use kvix_client::{Addr, Client, ClientConfig, QueryOptions, QueryOutcome};

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let addr: Addr = match std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:7420".into())
        .parse()
    {
        Ok(a) => a,
        Err(e) => {
            eprintln!("gateway: {e}");
            std::process::exit(2);
        }
    };
    let config = ClientConfig {
        name: "example-gateway".into(),
        ..ClientConfig::new([addr.clone()])
    };
    let client = match Client::connect(config).await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("gateway: {e}");
            std::process::exit(2);
        }
    };
    if !client.wait_connected(Duration::from_millis(500)).await {
        eprintln!(
            "gateway: no kvix server at {addr} (start one with `kvix-server`, or pass an address)"
        );
        std::process::exit(2);
    }

    // Two plain workers of the fleet, one full-attention lane each.
    let block = client.config().token_block;
    for name in ["worker-a", "worker-b"] {
        match client
            .announce(
                name,
                vec![Lane::full(block)],
                Feed::Placements {
                    capacity_blocks: 100_000,
                    ttl_ms: 0,
                },
            )
            .await
        {
            Ok(id) => println!("announced {name} as worker {id}"),
            Err(e) => {
                eprintln!("gateway: announcing {name}: {e}");
                std::process::exit(1);
            }
        }
    }

    // A request was routed to worker-a: tell the index.
    let keyspace = Keyspace::tokens("example-model");
    let prompt: Vec<u32> = (0..(8 * block)).map(|t| t * 31 % 50_000).collect();
    let chain = client.token_chain(&keyspace, &prompt);
    client.publish_placement("worker-a", &keyspace, chain);
    // Placements are fire-and-forget; give this one a moment to land before asking,
    // and warm the connection up with an echo (the transport floor) meanwhile.
    tokio::time::sleep(Duration::from_millis(50)).await;
    if let Ok(reply) = client.echo(vec![0; 64], 256).await {
        println!("echo: {} bytes back", reply.len());
    }

    let outcome = client
        .query_tokens(&keyspace, &prompt, &QueryOptions::default())
        .await;
    match &outcome {
        QueryOutcome::Scores(scores) => {
            for s in scores {
                println!(
                    "worker {} ({}) can reuse {} blocks",
                    s.worker,
                    s.name.as_deref().unwrap_or("?"),
                    s.blocks
                );
            }
        }
        other => println!("no index answer ({}): route by load instead", other.kind()),
    }

    let n = client.counters();
    println!(
        "counters: queries={} scores={} empty={} timeouts={} disconnected={} rejected={} \
         placements_sent={} placement_drops={} reconnects={} malformed_replies={} p50={:?} p99={:?}",
        n.queries(),
        n.scores,
        n.empty,
        n.timeouts,
        n.disconnected,
        n.rejected,
        n.placements_sent,
        n.placement_drops,
        n.reconnects,
        n.malformed_replies,
        n.latency_quantile(0.5),
        n.latency_quantile(0.99)
    );
}
