//! `--config FILE` (or `KVIX_CONFIG`): every flag in a TOML file, keyed by its long name
//! without the dashes (`max-blocks = 1000000`, `source-allow = ["10.0.0.0/8"]`,
//! `wal = true`). The file's values become flags placed before the command line's, and a
//! flag the command line gives, or whose environment variable is set, keeps that value:
//! command line, then environment, then file, then the default. One parser (clap's)
//! reads all three, so a file value is checked exactly as the flag would be.

use std::ffi::OsString;

use clap::CommandFactory;

use crate::config::Config;

/// The flags a config file stands for, for the command line `args` (program name
/// first): the file's flags inserted after the program name, or `args` as they are
/// without a file. Errors name the file and the key.
pub fn expand(args: Vec<OsString>) -> Result<Vec<OsString>, String> {
    let Some(path) = config_path(&args) else {
        return Ok(args);
    };
    let text = std::fs::read_to_string(&path).map_err(|e| format!("--config {}: {e}", path))?;
    let table: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| format!("--config {path}: {}", e.message()))?;
    let command = Config::command();
    let mut flags = Vec::new();
    for (key, value) in &table {
        let err = |why: String| format!("--config {path}: {key}: {why}");
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
                    .map_err(err)?;
                for item in &items {
                    parses(&command, arg, item).map_err(err)?;
                }
                flags.push(format!("--{key}={}", items.join(",")));
            }
            other => {
                if !takes_value {
                    return Err(err("true or false".into()));
                }
                let value = scalar(other).map_err(err)?;
                parses(&command, arg, &value).map_err(err)?;
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
fn parses(command: &clap::Command, arg: &clap::Arg, value: &str) -> Result<(), String> {
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
            Err(first.trim_start_matches("error: ").to_string())
        }
        _ => Ok(()),
    }
}

fn scalar(v: &toml::Value) -> Result<String, String> {
    match v {
        toml::Value::String(s) => Ok(s.clone()),
        toml::Value::Integer(i) => Ok(i.to_string()),
        toml::Value::Float(f) => Ok(f.to_string()),
        toml::Value::Boolean(b) => Ok(b.to_string()),
        other => Err(format!("{} is not a flag's value", other.type_str())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn with_file(text: &str, cli: &[&str]) -> Result<Config, String> {
        let path = std::env::temp_dir().join(format!(
            "kvix-config-{}-{}.toml",
            std::process::id(),
            text.len()
        ));
        std::fs::write(&path, text).unwrap();
        let mut args: Vec<OsString> =
            vec!["kvix-server".into(), "--config".into(), path.clone().into()];
        args.extend(cli.iter().map(OsString::from));
        let out = expand(args).and_then(|a| Config::try_parse_from(a).map_err(|e| e.to_string()));
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
        assert_eq!(c.cores, 3);
        assert!(c.wal);
        assert!(!c.pin);
        assert_eq!(c.max_blocks, 7, "the command line wins");
        assert_eq!(c.source_allow, ["10.0.0.0/8", "::1/128"]);
        assert_eq!(c.snapshot.as_deref(), Some(std::path::Path::new("/tmp/x")));
    }

    #[test]
    fn keys_and_values_that_are_not_flags_are_named() {
        let e = with_file("colour = 1\n", &[]).unwrap_err();
        assert!(e.contains("colour: no such flag"), "{e}");
        let e = with_file("cores = \"many\"\n", &[]).unwrap_err();
        assert!(
            e.contains("--config") && e.contains(": cores: invalid value 'many'"),
            "{e}"
        );
        let e = with_file("wal-recover = \"maybe\"\n", &[]).unwrap_err();
        assert!(e.contains(": wal-recover: invalid value 'maybe'"), "{e}");
        let e = with_file("wal = 1\n", &[]).unwrap_err();
        assert!(e.contains("wal: true or false"), "{e}");
        let e = with_file("cores = [\n", &[]).unwrap_err();
        assert!(e.contains("--config"), "{e}");
        let e = with_file("listen = { a = 1 }\n", &[]).unwrap_err();
        assert!(e.contains("listen"), "{e}");
    }
}
