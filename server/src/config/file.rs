//! `--config FILE` (or `KVIX_CONFIG`): every flag in a TOML file, keyed by its long name
//! without the dashes (`max-blocks = 1000000`, `source-allow = ["10.0.0.0/8"]`,
//! `wal = true`). The file's values become flags placed before the command line's, and a
//! flag the command line gives, or whose environment variable is set, keeps that value:
//! command line, then environment, then file, then the default. One parser (clap's)
//! reads all three, so a file value is checked exactly as the flag would be.

use std::ffi::OsString;

use clap::CommandFactory;

use super::{Config, ConfigError};

/// The flags a config file stands for, for the command line `args` (program name
/// first): the file's flags inserted after the program name, or `args` as they are
/// without a file. Errors name the file and the key.
pub fn expand(args: Vec<OsString>) -> Result<Vec<OsString>, ConfigError> {
    let Some(path) = config_path(&args) else {
        return Ok(args);
    };
    let file = |why: String| ConfigError::File {
        path: path.clone(),
        why,
    };
    let text = std::fs::read_to_string(&path).map_err(|e| file(e.to_string()))?;
    let table: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| file(e.message().to_string()))?;
    let command = Config::command();
    let mut flags = Vec::new();
    for (key, value) in &table {
        let err = |why: String| file(format!("{key}: {why}"));
        let arg = command
            .get_arguments()
            .find(|a| a.get_long() == Some(key.as_str()))
            .filter(|a| a.get_long() != Some("config"))
            .ok_or_else(|| {
                err("no such flag (keys are the long flags of --help, without the dashes)".into())
            })?;
        let given = args.iter().skip(1).any(|a| {
            a.to_str()
                .is_some_and(|a| a == format!("--{key}") || a.starts_with(&format!("--{key}=")))
        });
        let from_env = arg
            .get_env()
            .is_some_and(|name| std::env::var_os(name).is_some());
        if given || from_env {
            continue;
        }
        let takes_value = arg.get_action().takes_values();
        match value {
            toml::Value::Boolean(b) if !takes_value => {
                if *b {
                    flags.push(format!("--{key}"));
                }
            }
            toml::Value::Array(items) => {
                let items = items
                    .iter()
                    .map(scalar)
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| err(e.to_string()))?;
                for item in &items {
                    parses(&command, arg, item).map_err(|e| err(e.to_string()))?;
                }
                flags.push(format!("--{key}={}", items.join(",")));
            }
            other => {
                if !takes_value {
                    return Err(err("true or false".into()));
                }
                let value = scalar(other).map_err(|e| err(e.to_string()))?;
                parses(&command, arg, &value).map_err(|e| err(e.to_string()))?;
                flags.push(format!("--{key}={value}"));
            }
        }
    }
    let mut out = Vec::with_capacity(args.len() + flags.len());
    let mut args = args.into_iter();
    out.extend(args.next());
    out.extend(flags.into_iter().map(OsString::from));
    out.extend(args);
    Ok(out)
}

/// `--config PATH`, `--config=PATH` or `KVIX_CONFIG`.
fn config_path(args: &[OsString]) -> Option<String> {
    let mut it = args.iter().skip(1).filter_map(|a| a.to_str());
    while let Some(a) = it.next() {
        if a == "--config" {
            return it.next().map(str::to_string);
        }
        if let Some(p) = a.strip_prefix("--config=") {
            return Some(p.to_string());
        }
    }
    std::env::var("KVIX_CONFIG").ok().filter(|p| !p.is_empty())
}

/// Whether `value` is one the flag takes, checked here so that the error names the file
/// and key (clap's, later, would name only the flag). Only the value is judged: a flag
/// that needs another (`tls-cert` wants `tls-key`) is checked with the whole command line.
fn parses(command: &clap::Command, arg: &clap::Arg, value: &str) -> Result<(), ValueWhy> {
    use clap::error::ErrorKind;
    let long = arg.get_long().unwrap_or_default();
    let alone = command.clone().color(clap::ColorChoice::Never);
    match alone.try_get_matches_from(["kvix-server".to_string(), format!("--{long}={value}")]) {
        Err(e)
            if !matches!(
                e.kind(),
                ErrorKind::MissingRequiredArgument | ErrorKind::ArgumentConflict
            ) =>
        {
            let text = e.to_string();
            let first = text.lines().next().unwrap_or_default();
            Err(ValueWhy(first.trim_start_matches("error: ").to_string()))
        }
        _ => Ok(()),
    }
}

fn scalar(v: &toml::Value) -> Result<String, ValueWhy> {
    match v {
        toml::Value::String(s) => Ok(s.clone()),
        toml::Value::Integer(i) => Ok(i.to_string()),
        toml::Value::Float(f) => Ok(f.to_string()),
        toml::Value::Boolean(b) => Ok(b.to_string()),
        other => Err(ValueWhy(format!(
            "{} is not a flag's value",
            other.type_str()
        ))),
    }
}

/// Why a file's value is not one its flag takes (clap's words).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct ValueWhy(String);

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn with_file(text: &str, cli: &[&str]) -> Result<Config, Box<dyn std::error::Error>> {
        let path = std::env::temp_dir().join(format!(
            "kvix-config-{}-{}.toml",
            std::process::id(),
            text.len()
        ));
        std::fs::write(&path, text).unwrap();
        let mut args: Vec<OsString> =
            vec!["kvix-server".into(), "--config".into(), path.clone().into()];
        args.extend(cli.iter().map(OsString::from));
        let out = expand(args)
            .map_err(Into::into)
            .and_then(|a| Config::try_parse_from(a).map_err(Into::into));
        let _ = std::fs::remove_file(&path);
        out
    }

    #[test]
    fn a_file_sets_flags_and_the_command_line_wins() {
        let c = with_file(
            "cores = 3\nwal = true\nsnapshot = \"/tmp/x\"\nsource-allow = [\"10.0.0.0/8\", \"::1/128\"]\npin = false\nmax-blocks = 1000\n",
            &["--max-blocks", "7"],
        )
        .unwrap();
        assert_eq!(c.executors.cores, 3);
        assert!(c.durability.wal);
        assert!(!c.executors.pin);
        assert_eq!(c.index.max_blocks, 7, "the command line wins");
        assert_eq!(c.ingest.source_allow, ["10.0.0.0/8", "::1/128"]);
        assert_eq!(
            c.durability.snapshot.as_deref(),
            Some(std::path::Path::new("/tmp/x"))
        );
    }

    #[test]
    fn keys_and_values_that_are_not_flags_are_named() {
        let e = with_file("colour = 1\n", &[]).unwrap_err().to_string();
        assert!(e.contains("colour: no such flag"), "{e}");
        let e = with_file("cores = \"many\"\n", &[])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--config") && e.contains(": cores: invalid value 'many'"),
            "{e}"
        );
        let e = with_file("wal-recover = \"maybe\"\n", &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains(": wal-recover: invalid value 'maybe'"), "{e}");
        let e = with_file("wal = 1\n", &[]).unwrap_err().to_string();
        assert!(e.contains("wal: true or false"), "{e}");
        let e = with_file("cores = [\n", &[]).unwrap_err().to_string();
        assert!(e.contains("--config"), "{e}");
        let e = with_file("listen = { a = 1 }\n", &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("listen"), "{e}");
    }
}

#[cfg(test)]
mod every_flag {
    use super::*;
    use clap::Parser;

    /// Each flag, a value it takes on the command line ("-": none, a switch) and the same
    /// in TOML, and the flags it needs beside it.
    const SAMPLES: &[(&str, &str, &str, &[&str])] = &[
        ("listen", "127.0.0.1:9000", "\"127.0.0.1:9000\"", &[]),
        ("unix", "/tmp/x.sock", "\"/tmp/x.sock\"", &[]),
        ("metrics", "", "\"\"", &[]),
        ("cores", "3", "3", &[]),
        ("pin", "false", "false", &[]),
        ("block-size", "32", "32", &[]),
        ("max-frame", "65536", "65536", &[]),
        ("max-inflight", "7", "7", &[]),
        ("max-connections", "9", "9", &[]),
        ("max-unsent", "1048576", "1048576", &[]),
        ("stall-timeout-ms", "11", "11", &[]),
        ("handshake-timeout-ms", "12", "12", &[]),
        ("idle-timeout-s", "13", "13", &[]),
        ("auth-token", "s3cret", "\"s3cret\"", &[]),
        ("auth-token-file", "/tmp/token", "\"/tmp/token\"", &[]),
        (
            "tls-cert",
            "/tmp/c.pem",
            "\"/tmp/c.pem\"",
            &["--tls-key", "/tmp/k.pem"],
        ),
        (
            "tls-key",
            "/tmp/k.pem",
            "\"/tmp/k.pem\"",
            &["--tls-cert", "/tmp/c.pem"],
        ),
        (
            "tls-client-ca",
            "/tmp/ca.pem",
            "\"/tmp/ca.pem\"",
            &["--tls-cert", "/tmp/c.pem", "--tls-key", "/tmp/k.pem"],
        ),
        ("unix-mode", "660", "\"660\"", &[]),
        ("http", "127.0.0.1:7422", "\"127.0.0.1:7422\"", &[]),
        ("snapshot", "/tmp/s", "\"/tmp/s\"", &[]),
        ("wal", "-", "true", &[]),
        ("wal-sync-ms", "0", "0", &[]),
        ("wal-recover", "truncate", "\"truncate\"", &[]),
        (
            "log",
            "redis://127.0.0.1:6379/k",
            "\"redis://127.0.0.1:6379/k\"",
            &[],
        ),
        (
            "fleet",
            "f1",
            "\"f1\"",
            &["--log", "redis://127.0.0.1:6379/k"],
        ),
        (
            "log-new",
            "-",
            "true",
            &["--log", "redis://127.0.0.1:6379/k"],
        ),
        (
            "log-empty-wait",
            "5",
            "5",
            &["--log", "redis://127.0.0.1:6379/k"],
        ),
        ("snapshot-every", "5", "5", &[]),
        ("spin-us", "4", "4", &[]),
        ("ingest-threads", "2", "2", &[]),
        ("max-workers", "1000", "1000", &[]),
        ("fill-in-blocks", "10", "10", &[]),
        ("fill-in-ttl", "20", "20", &[]),
        ("max-sources", "30", "30", &[]),
        ("events-bind", "tcp://*:5557", "\"tcp://*:5557\"", &[]),
        ("events-ranks", "2", "2", &[]),
        (
            "events-topic",
            "kv@{host}@{model}x",
            "\"kv@{host}@{model}x\"",
            &[],
        ),
        ("events-replay-port", "5600", "5600", &[]),
        (
            "events-lanes",
            "full_attention@16",
            "\"full_attention@16\"",
            &[],
        ),
        ("events-grace", "9", "9", &[]),
        ("engines", "/tmp/engines.txt", "\"/tmp/engines.txt\"", &[]),
        ("max-blocks", "100", "100", &[]),
        (
            "source-allow",
            "10.0.0.0/8,::1/128",
            "[\"10.0.0.0/8\", \"::1/128\"]",
            &[],
        ),
        ("steering", "none", "\"none\"", &[]),
    ];

    fn parsed(args: Vec<OsString>) -> String {
        let args = expand(args).unwrap_or_else(|e| panic!("{e}"));
        format!(
            "{:?}",
            Config::try_parse_from(args).unwrap_or_else(|e| panic!("{e}"))
        )
    }

    /// Every flag is documented in docs/operations.md's Flags table and every flag there
    /// exists; each is taken on the command line and as a `--config` key, alike.
    #[test]
    fn every_documented_flag_and_toml_key_is_accepted() {
        let docs = include_str!("../../../docs/operations.md");
        let table = docs
            .split("## Flags")
            .nth(1)
            .unwrap()
            .split("\n## ")
            .next()
            .unwrap();
        let documented: Vec<&str> = table
            .lines()
            .filter_map(|l| l.strip_prefix("| `--"))
            .map(|l| l.split([' ', '`']).next().unwrap())
            .collect();
        let command = Config::command();
        let flags: Vec<&str> = command
            .get_arguments()
            .filter_map(|a| a.get_long())
            .filter(|l| !["help", "version"].contains(l))
            .collect();
        for f in &flags {
            assert!(
                documented.contains(f),
                "--{f} is not in docs/operations.md's Flags table"
            );
        }
        for d in &documented {
            assert!(
                flags.contains(d),
                "docs/operations.md documents --{d}, which is no flag"
            );
        }
        for f in flags.iter().filter(|f| **f != "config") {
            let (_, cli, toml, with) = SAMPLES
                .iter()
                .find(|s| s.0 == *f)
                .unwrap_or_else(|| panic!("--{f} has no sample value here"));
            let mut args: Vec<OsString> = vec!["kvix-server".into()];
            args.push(format!("--{f}").into());
            if *cli != "-" {
                args.push(cli.into());
            }
            args.extend(with.iter().map(OsString::from));
            let from_flags = parsed(args);
            let path = std::env::temp_dir()
                .join(format!("kvix-every-flag-{}-{f}.toml", std::process::id()));
            std::fs::write(&path, format!("{f} = {toml}\n")).unwrap();
            let mut args: Vec<OsString> =
                vec!["kvix-server".into(), "--config".into(), path.clone().into()];
            args.extend(with.iter().map(OsString::from));
            let from_file = parsed(args).replace(&format!("Some({:?})", path), "None");
            let _ = std::fs::remove_file(&path);
            assert_eq!(
                from_file, from_flags,
                "--{f}: the file's value and the flag's differ"
            );
        }
    }
}
