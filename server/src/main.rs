use anyhow::Context;
use clap::Parser;

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KVIX_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .with_target(false)
        .init();
    let config = kvix_server::Config::parse();
    config
        .validate()
        .map_err(anyhow::Error::msg)
        .context("invalid flags")?;
    kvix_server::run(config).context("kvix-server stopped")
}
