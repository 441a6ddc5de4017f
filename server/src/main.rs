use std::io::IsTerminal;
use std::process::ExitCode;

use clap::Parser;

/// `kvix-server [FLAGS]` serves; `kvix-server check [FLAGS]` checks what a start with
/// those flags needs, and exits.
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
    let check = args.get(1).is_some_and(|a| a == "check");
    if check {
        args.remove(1);
    }
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
    let outcome = match (valid, check) {
        (Err(e), _) => Err(e),
        (Ok(()), true) => return checked(&config),
        (Ok(()), false) => kvix_server::run(config),
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
