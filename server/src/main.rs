use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KVIX_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .with_target(false)
        .with_writer(std::io::stderr)
        .init();
    let mut config = kvix_server::Config::parse();
    let outcome = config
        .load_auth_token_file()
        .and_then(|()| config.validate())
        .map_err(anyhow::Error::msg)
        .context("invalid flags")
        .and_then(|()| kvix_server::run(config).context("kvix-server stopped"));
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line with the whole cause chain; no backtrace for an operator's mistake.
            eprintln!("kvix-server: {e:#}");
            ExitCode::FAILURE
        }
    }
}
