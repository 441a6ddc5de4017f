//! NVIDIA Dynamo's standalone KV indexer (`dynamo-kv-router` 1.6.1) served on an address
//! of the caller's choosing, as `kvix-bench latency --http --dynamo` queries it: its own
//! router (`create_router`) on a listener of this process's, one indexer thread, the
//! listeners released at once (`signal_ready`). Not Dynamo's `run_server`, which binds
//! 0.0.0.0 and installs its own Ctrl-C handler.
//!
//!     dynamo-indexer 127.0.0.1:7430

use std::sync::Arc;

use dynamo_kv_router::services::indexer::server::{create_router, AppState};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:7430".into());
    if addr == "-h" || addr == "--help" {
        println!("usage: dynamo-indexer [ADDR]   (default 127.0.0.1:7430)");
        return Ok(());
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(&addr).await?;
        let state = Arc::new(AppState::new(1).map_err(|e| e.to_string())?);
        state.registry.signal_ready();
        println!("dynamo-indexer on http://{}", listener.local_addr()?);
        axum::serve(listener, create_router(state)).await?;
        Ok(())
    })
}
