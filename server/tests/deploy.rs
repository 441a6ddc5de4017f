//! The deployment kit against the server it deploys: every metric the Grafana dashboard
//! (`deploy/grafana/kvix-dashboard.json`) and the Prometheus rules
//! (`deploy/prometheus/kvix-alerts.yml`) name is served by a live server (one with the
//! write-ahead log, `--events-bind` and a fleet file, and a replica on a real
//! redis-server for the `kvix_log_*` family); the rules pass `promtool check rules` and
//! are docs/operations.md's Alerts table, alert for alert.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use common::redis::{self, Redis};
use common::*;

fn repo_file(path: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/..")).join(path)
}

fn read(path: &str) -> String {
    std::fs::read_to_string(repo_file(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// Every `kvix_…` identifier in `text`.
fn metrics_named(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("kvix_") {
        let name: String = rest[at..]
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
            .collect();
        rest = &rest[at + name.len()..];
        out.insert(name);
    }
    out
}

/// The series names a scrape serves: each family, with `_sum` and `_count` for summaries
/// and histograms (and `_bucket` for histograms).
fn served(scrape: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in scrape.lines() {
        let mut words = line.split_whitespace();
        if (words.next(), words.next()) != (Some("#"), Some("TYPE")) {
            continue;
        }
        let (Some(name), Some(kind)) = (words.next(), words.next()) else {
            continue;
        };
        out.insert(name.to_string());
        if kind == "summary" || kind == "histogram" {
            out.insert(format!("{name}_sum"));
            out.insert(format!("{name}_count"));
        }
        if kind == "histogram" {
            out.insert(format!("{name}_bucket"));
        }
    }
    out
}

#[test]
fn every_metric_the_dashboard_and_the_alert_rules_use_is_served() {
    if redis::available("every_metric_the_dashboard").is_none() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("kvix-deploy-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let fleet = dir.join("engines.txt");
    std::fs::write(&fleet, "# no engines\n").unwrap();
    let snapshot = dir.join("index.snapshot");
    let bind = format!("tcp://127.0.0.1:{}", free_port());
    let single = Server::start(&[
        "--cores",
        "1",
        "--snapshot",
        snapshot.to_str().unwrap(),
        "--wal",
        "--events-bind",
        &bind,
        "--engines",
        fleet.to_str().unwrap(),
    ]);
    let log = Redis::start("deploy");
    let replica = Server::start(&["--cores", "1", "--log-new", "--log", &log.url("kvix")]);
    let scrapes = [single.scrape(), replica.scrape()];
    let mut names = served(&scrapes[0]);
    names.extend(served(&scrapes[1]));
    assert!(names.contains("kvix_log_caught_up"), "{names:?}");
    golden_families(&scrapes);
    for path in [
        "deploy/grafana/kvix-dashboard.json",
        "deploy/prometheus/kvix-alerts.yml",
    ] {
        let used = metrics_named(&read(path));
        assert!(used.len() >= 10, "{path}: {used:?}");
        let missing: Vec<&String> = used.difference(&names).collect();
        assert!(
            missing.is_empty(),
            "{path} uses {missing:?}, which no server serves"
        );
    }
    let dashboard: serde_json::Value =
        serde_json::from_str(&read("deploy/grafana/kvix-dashboard.json")).unwrap();
    let panels = dashboard["panels"].as_array().expect("panels");
    assert!(panels
        .iter()
        .all(|p| p["targets"].as_array().is_some_and(|t| !t.is_empty())));
    drop((single, replica));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every family the two servers serve, one line each (name, type, label names): the
/// alert rules, the dashboard and the promtool test depend on them, so they change only
/// on purpose. `KVIX_BLESS=1` writes the file anew after such a change.
fn golden_families(scrapes: &[String]) {
    let mut families: BTreeMap<String, (String, BTreeSet<String>)> = BTreeMap::new();
    for text in scrapes {
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').unwrap();
                families.entry(name.into()).or_default().0 = kind.into();
            } else if line.starts_with("kvix_") {
                let name = line.split(['{', ' ']).next().unwrap();
                let family = ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|s| name.strip_suffix(s).filter(|f| families.contains_key(*f)))
                    .unwrap_or(name);
                let labels = line
                    .split_once('{')
                    .map(|(_, l)| l.split_once('}').unwrap().0)
                    .unwrap_or("");
                let keys = labels
                    .split(',')
                    .filter_map(|kv| kv.split_once('=').map(|(k, _)| k.to_string()))
                    .filter(|k| k != "le" && k != "quantile");
                families.entry(family.into()).or_default().1.extend(keys);
            }
        }
    }
    let text: String = families
        .iter()
        .map(|(name, (kind, labels))| {
            let labels: Vec<&str> = labels.iter().map(String::as_str).collect();
            format!("{name} {kind} {}\n", labels.join(","))
        })
        .collect();
    let golden = repo_file("server/tests/golden/metrics.txt");
    if std::env::var("KVIX_BLESS").is_ok() {
        std::fs::write(&golden, &text).unwrap();
    }
    let want = std::fs::read_to_string(&golden).unwrap_or_default();
    assert_eq!(
        text, want,
        "the metric families changed (name, type, labels); if on purpose, run with KVIX_BLESS=1 and update the alert rules, dashboard and docs/operations.md"
    );
}

/// The alerts table of a section of docs/operations.md: each alert's name (first
/// column) and its expression (the first `code` span of the second).
fn documented_alerts(section: &str) -> BTreeMap<String, String> {
    let doc = read("docs/operations.md");
    let table = doc
        .split(&format!("\n## {section}\n"))
        .nth(1)
        .and_then(|s| s.split("\n## ").next())
        .unwrap_or_else(|| panic!("docs/operations.md has no section {section:?}"));
    table
        .lines()
        .skip_while(|l| !l.starts_with("| alert |"))
        .skip(2)
        .take_while(|l| l.starts_with("| "))
        .map(|l| {
            let mut cells = l.split('|').skip(1);
            let name = cells.next().unwrap_or_default().trim().to_string();
            let expr = cells
                .next()
                .and_then(|c| c.split('`').nth(1))
                .unwrap_or_else(|| panic!("alert {name:?}: no `expression` in its row"))
                .to_string();
            (name, expr)
        })
        .collect()
}

/// A rules file's alerts: each one's summary and its expression.
fn rule_alerts(path: &str) -> BTreeMap<String, String> {
    let mut alerts = BTreeMap::new();
    let mut expr = None;
    for line in read(path).lines() {
        let line = line.trim();
        if let Some(e) = line.strip_prefix("expr: ") {
            expr = Some(e.to_string());
        } else if let Some(summary) = line.strip_prefix("summary: ") {
            let expr = expr
                .take()
                .expect("each rule's expr comes before its summary");
            alerts.insert(summary.to_string(), expr);
        }
    }
    alerts
}

/// kvix-server's rules and the endpoint picker's, each with the section of
/// docs/operations.md whose alerts table they are.
const RULES: [(&str, &str); 2] = [
    ("deploy/prometheus/kvix-alerts.yml", "Alerts"),
    (
        "deploy/prometheus/kvix-epp-alerts.yml",
        "Gateway API Inference Extension / llm-d",
    ),
];

#[test]
fn the_alert_rules_pass_promtool_and_are_the_documented_alerts() {
    let promtool = |rules: &Path| {
        Command::new("promtool")
            .arg("check")
            .arg("rules")
            .arg(rules)
            .output()
    };
    for (path, section) in RULES {
        let rules = repo_file(path);
        let out = match promtool(&rules) {
            Ok(out) => out,
            Err(_) => match apt_install("prometheus") {
                Ok(()) => promtool(&rules).expect("promtool runs once installed"),
                Err(why) => {
                    let how = format!("promtool is missing ({why}); `apt-get install prometheus`");
                    missing_part("promtool", &how);
                    return;
                }
            },
        };
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "promtool check rules {path}: {said}");
        // The same alerts, each with the same expression (the table is what an
        // operator copies from).
        let (rules, documented) = (rule_alerts(path), documented_alerts(section));
        assert!(!rules.is_empty(), "{path} has no alerts");
        assert_eq!(
            rules.keys().collect::<Vec<_>>(),
            documented.keys().collect::<Vec<_>>(),
            "{path} against docs/operations.md's {section:?}"
        );
        for (alert, expr) in &rules {
            assert_eq!(
                Some(expr),
                documented.get(alert),
                "alert {alert:?}: {path}'s expression, then the table's"
            );
        }
    }
}

/// The ConfigMap's `kvix.toml` (the block under `kvix.toml: |`).
fn configmap_toml(manifest: &str) -> String {
    let mut lines = manifest.lines().skip_while(|l| l.trim() != "kvix.toml: |");
    lines.next().expect("the ConfigMap has kvix.toml");
    lines
        .take_while(|l| l.starts_with("    "))
        .map(|l| format!("{}\n", &l[4..]))
        .collect()
}

/// Runs kubernetes-validate from the tests' Python environment; None when the tester
/// opted out of `python`.
fn kubernetes_validate(files: &[PathBuf]) -> Option<std::process::Output> {
    let python = common::python::interpreter()?;
    let validate = python.with_file_name("kubernetes-validate");
    let out = Command::new(&validate)
        .arg("--strict")
        .args(files)
        .output()
        .unwrap_or_else(|e| panic!("{} does not run: {e}", validate.display()));
    Some(out)
}

/// The Kubernetes manifests pass the API schemas (strict: no unknown field), and the
/// config they mount starts: its kvix.toml, pointed at a real redis-server and free
/// ports, passes `kvix-server check`. The image builds the binary as CI does.
#[test]
fn the_kubernetes_manifests_validate_and_their_config_checks() {
    // inferencepool.yaml is GAIE's custom resource, not in the API schemas: gateway/epp's
    // manifest_test.go admits it under GAIE's CRD (schema, CEL rules, pruning).
    let files: Vec<PathBuf> = ["kvix.yaml", "redis.yaml", "servicemonitor.yaml", "epp.yaml"]
        .iter()
        .map(|f| repo_file(&format!("deploy/kubernetes/{f}")))
        .collect();
    let Some(out) = kubernetes_validate(&files) else {
        return;
    };
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "kubernetes-validate: {said}");
    assert_eq!(said.matches("passed for resource").count(), 15, "{said}");

    let manifest = read("deploy/kubernetes/kvix.yaml");
    assert!(manifest
        .contains(r#"args: ["--config", "/etc/kvix/kvix.toml", "--cores", "$(KVIX_CORES)"]"#));
    assert!(manifest.contains("mountPath: /etc/kvix"));
    if redis::available("the_kubernetes_manifests_validate").is_none() {
        return;
    }
    let log = Redis::start("manifest");
    // Fenced: the log's URL (with the Redis password) comes from the environment, the
    // clients' token from a mounted Secret.
    assert!(manifest.contains(
        "- name: KVIX_LOG_URL\n              value: \"redis://:$(REDIS_PASSWORD)@kvix-redis:6379/kvix\""
    ));
    assert!(manifest.contains("secret: {secretName: kvix-auth"));
    let dir = std::env::temp_dir().join(format!("kvix-manifest-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let token = dir.join("token");
    std::fs::write(&token, "manifest-token\n").unwrap();
    let toml = configmap_toml(&manifest);
    assert!(
        toml.contains("auth-token-file = \"/etc/kvix-auth/token\"") && !toml.contains("log ="),
        "{toml}"
    );
    let toml = toml
        .replace("/etc/kvix-auth/token", token.to_str().unwrap())
        .replace("0.0.0.0:7420", &format!("127.0.0.1:{}", free_port()))
        .replace("0.0.0.0:7421", &format!("127.0.0.1:{}", free_port()))
        .replace("tcp://*:5557", &format!("tcp://127.0.0.1:{}", free_port()));
    let conf = dir.join("kvix.toml");
    std::fs::write(&conf, toml).unwrap();
    let check = Command::new(env!("CARGO_BIN_EXE_kvix-server"))
        .args(["check", "--config", conf.to_str().unwrap(), "--cores", "1"])
        .env_remove("KVIX_LISTEN")
        .env_remove("KVIX_METRICS")
        .env("KVIX_LOG_URL", log.url("kvix"))
        .output()
        .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&check.stdout),
        String::from_utf8_lossy(&check.stderr)
    );
    assert!(check.status.success(), "{said}");
    assert!(
        said.contains("log"),
        "check says nothing of the log: {said}"
    );
    let _ = std::fs::remove_dir_all(&dir);

    let build = "cargo build --release --locked -p kvix-server";
    assert!(read("deploy/Dockerfile").contains(&format!("RUN {build}")));
    assert!(
        read(".ci/run").contains(build),
        ".ci/run builds as the image does"
    );
}
