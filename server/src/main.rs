use std::io::IsTerminal;
use std::process::ExitCode;

use clap::Parser;

/// `kvix-server [FLAGS]` serves; `kvix-server check [FLAGS]` checks what a start with
/// those flags needs, and exits; `kvix-server log reset [FLAGS]` begins an empty log on
/// the key of `--log` where it has none (the operator's word that no replica holds the
/// fleet's state).
fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KVIX_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .with_target(false)
        .with_ansi(colour())
        .with_writer(std::io::stderr)
        .init();
    let mut args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    // The command and how many words name it, before the flags.
    let (command, words) = match args.get(1).and_then(|a| a.to_str()) {
        Some("check") => (Command::Check, 1),
        Some("log") => match args.get(2).and_then(|a| a.to_str()) {
            Some("reset") => (Command::LogReset, 2),
            other => {
                eprintln!(
                    "kvix-server log: unknown command {:?}: `kvix-server log reset [FLAGS]` \
                     begins an empty log on --log's key where it has none",
                    other.unwrap_or("")
                );
                return ExitCode::from(2);
            }
        },
        _ => (Command::Serve, 0),
    };
    args.drain(1..1 + words);
    let args = match kvix_server::config::file::expand(args) {
        Ok(args) => args,
        Err(e) => {
            eprintln!("kvix-server: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut config = kvix_server::Config::parse_from(args);
    let valid = config
        .load_auth_token_file()
        .and_then(|()| config.validate())
        .map_err(kvix_server::error::StartError::from);
    let outcome = match (valid, command) {
        (Err(e), _) => Err(e),
        (Ok(()), Command::Check) => return checked(&config),
        (Ok(()), Command::LogReset) => return log_reset(&config),
        (Ok(()), Command::Serve) => kvix_server::run(config),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line naming the cause; no backtrace for an operator's mistake.
            eprintln!("kvix-server: {e}");
            ExitCode::FAILURE
        }
    }
}

#[derive(Clone, Copy)]
enum Command {
    Serve,
    Check,
    LogReset,
}

/// `kvix-server log reset`: an empty log begun on a key that has none; a live log is
/// left alone, and said so with a failure.
fn log_reset(config: &kvix_server::Config) -> ExitCode {
    use kvix_server::durable::replica::start::{reset, Reset};
    let Some(log) = &config.durability.log else {
        eprintln!("kvix-server log reset: give the log with --log (or KVIX_LOG_URL)");
        return ExitCode::from(2);
    };
    match reset(&log.server, &log.key, &config.fleet()) {
        Ok(Reset::Started(generation)) => {
            println!(
                "the write log at {}/{} was empty: it is now a new, empty log (generation \
                 {generation}); replicas waiting on it start",
                log.server, log.key
            );
            ExitCode::SUCCESS
        }
        Ok(Reset::Live(generation)) => {
            eprintln!(
                "kvix-server log reset: the write log at {}/{} is live (generation \
                 {generation}): nothing was reset",
                log.server, log.key
            );
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("kvix-server log reset: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Colour in the log only on a terminal, and never with NO_COLOR set (no-color.org): a
/// log file or a collector gets plain text.
fn colour() -> bool {
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

/// Prints each check of `kvix-server check`; failure if any failed.
fn checked(config: &kvix_server::Config) -> ExitCode {
    println!("ok    flags");
    let mut failed = false;
    for c in kvix_server::check::run(config) {
        match c.result {
            Ok(found) => println!("ok    {}: {found}", c.what),
            Err(why) => {
                failed = true;
                println!("FAIL  {}: {why}", c.what);
            }
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
