//! `--engines FILE`: the engines a server ingests, declared in a file instead of
//! announced by a controller. Applied once the server has restored and again on
//! SIGHUP: each declared worker new or changed since the last application is announced,
//! each one no longer declared is retired, both through the one write route a client's
//! announce and retire take (sent over executor 0's ingest inbox). A file that does not
//! read changes nothing: the error names its line, is logged and counted.
//!
//! One engine per line, `#` starts a comment:
//!
//! ```text
//! # NAME      ENDPOINT                  KEY=VALUE ...
//! engine-a    tcp://10.0.0.5:5557       replay=tcp://10.0.0.5:5558 model=llama dp=2
//! engine-b    tcp://10.0.0.6:5557       model=qwen lanes=full_attention@16,sliding_window:4096@16
//! ```
//!
//! Keys: `model` (required), `replay`, `salt`, `lanes` (`KIND[:PARAM]@TOKENS`, comma
//! separated; default one full-attention lane of `--block-size`), `dp` (data-parallel
//! ranks, default 1: rank r is the worker `NAME/dp<r>` at the endpoint's and replay's
//! port + r, as the engines offset them).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use futures::channel::mpsc;
use futures::SinkExt;
use kvix_wire::{EventSource, Feed, Lane, LaneKind, WorkerId};

use super::bound::rank_endpoint;
use super::METRICS;
use crate::write::record::Write;

/// One worker the file declares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Declared {
    pub lanes: Vec<Lane>,
    pub source: EventSource,
    /// The file's line that declares it (1-based).
    pub line: usize,
}

/// A file that does not read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FleetError {
    #[error("{path}: {why}")]
    Unreadable { path: String, why: String },
    #[error("{path}:{line}: {why}")]
    Line {
        path: String,
        line: usize,
        why: String,
    },
}

/// The workers `text` declares, by name.
pub fn parse(path: &str, text: &str, block: u32) -> Result<BTreeMap<String, Declared>, FleetError> {
    let mut out: BTreeMap<String, Declared> = BTreeMap::new();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        let err = |why: String| FleetError::Line {
            path: path.to_string(),
            line,
            why,
        };
        let content = raw.split('#').next().unwrap_or("").trim();
        if content.is_empty() {
            continue;
        }
        let mut fields = content.split_whitespace();
        let name = fields.next().expect("not empty");
        let endpoint = fields
            .next()
            .ok_or_else(|| err(format!("{name}: expected NAME ENDPOINT KEY=VALUE ...")))?;
        let (mut model, mut replay, mut salt) = (None, String::new(), String::new());
        let (mut lanes, mut dp) = (vec![Lane::full(block)], 1usize);
        for kv in fields {
            let (key, value) = kv
                .split_once('=')
                .ok_or_else(|| err(format!("{kv:?}: expected KEY=VALUE")))?;
            match key {
                "model" => model = Some(value.to_string()),
                "replay" => replay = value.to_string(),
                "salt" => salt = value.to_string(),
                "lanes" => lanes = parse_lanes(value).map_err(|e| err(e.to_string()))?,
                "dp" => {
                    dp = value
                        .parse()
                        .ok()
                        .filter(|n| (1..=256).contains(n))
                        .ok_or_else(|| err(format!("dp={value}: expected 1 to 256 ranks")))?
                }
                other => {
                    return Err(err(format!(
                        "unknown key {other:?} (known: model, replay, salt, lanes, dp)"
                    )))
                }
            }
        }
        let model = model.ok_or_else(|| err(format!("{name}: model=... is required")))?;
        for rank in 0..dp {
            let worker = match rank {
                0 => name.to_string(),
                r => format!("{name}/dp{r}"),
            };
            let offset =
                |ep: &str| rank_endpoint(ep, rank).map_err(|e| err(format!("endpoint {e}")));
            let declared = Declared {
                lanes: lanes.clone(),
                source: EventSource {
                    endpoint: offset(endpoint)?,
                    replay: if replay.is_empty() {
                        String::new()
                    } else {
                        offset(&replay)?
                    },
                    model: model.clone(),
                    salt: salt.clone(),
                },
                line,
            };
            if let Some(first) = out.insert(worker.clone(), declared) {
                return Err(err(format!(
                    "{worker} is declared on line {} already",
                    first.line
                )));
            }
        }
    }
    Ok(out)
}

/// `KIND[:PARAM]@TOKENS,...`
pub fn parse_lanes(text: &str) -> Result<Vec<Lane>, BadLane> {
    text.split(',')
        .map(|lane| {
            let named = |why| BadLane {
                lane: lane.to_string(),
                why,
            };
            let (kind, tokens) = lane.rsplit_once('@').ok_or_else(|| named(LaneWhy::Form))?;
            let kind = LaneKind::parse(kind).map_err(|e| named(LaneWhy::Kind(e)))?;
            let block_tokens = tokens
                .parse()
                .ok()
                .filter(|&t: &u32| t > 0)
                .ok_or_else(|| named(LaneWhy::Tokens(tokens.to_string())))?;
            Ok(Lane { kind, block_tokens })
        })
        .collect()
}

/// A lane of `--events-lanes` or a fleet file that does not read.
#[derive(Debug, thiserror::Error)]
#[error("lane {lane:?}: {why}")]
pub struct BadLane {
    lane: String,
    why: LaneWhy,
}

#[derive(Debug, thiserror::Error)]
pub enum LaneWhy {
    #[error("expected KIND[:PARAM]@TOKENS")]
    Form,
    #[error(transparent)]
    Kind(kvix_wire::LaneError),
    #[error("{0:?} is not a block size in tokens")]
    Tokens(String),
}

/// A worker whose engine's events the ingest takes: its name (for the log and for this
/// file) and its source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sourced {
    pub name: String,
    pub source: EventSource,
}

/// Every worker with a source, by id: the ingest's one record of them, kept as announces
/// and retires are applied.
pub type Sources = Arc<std::sync::Mutex<BTreeMap<WorkerId, Sourced>>>;

/// The thread that applies the file: once started, then at each SIGHUP.
pub struct Applier {
    pub path: PathBuf,
    pub block: u32,
    /// Executor 0's ingest inbox: announces and retires take the write route from there.
    pub inbox: mpsc::Sender<Write>,
    /// The workers with a source, to retire by name one the file no longer declares.
    pub sources: Sources,
    pub stop: Arc<AtomicBool>,
}

impl Applier {
    pub fn run(mut self) {
        let hup = Arc::new(AtomicBool::new(false));
        if let Err(e) = signal_hook::flag::register(signal_hook::consts::SIGHUP, hup.clone()) {
            tracing::error!("--engines: SIGHUP cannot be caught ({e}); the file is read once");
        }
        let mut applied = BTreeMap::new();
        self.apply(&mut applied);
        while !self.stop.load(Relaxed) {
            std::thread::sleep(Duration::from_millis(100));
            if hup.swap(false, Relaxed) {
                self.apply(&mut applied);
            }
        }
    }

    /// Reads the file and sends what changed since `applied`, which becomes the file's
    /// workers; a file that does not read leaves everything as it was.
    fn apply(&mut self, applied: &mut BTreeMap<String, Declared>) {
        let path = self.path.display().to_string();
        let declared = std::fs::read_to_string(&self.path)
            .map_err(|e| FleetError::Unreadable {
                path: path.clone(),
                why: e.to_string(),
            })
            .and_then(|text| parse(&path, &text, self.block));
        let declared = match declared {
            Ok(d) => d,
            Err(e) => {
                METRICS.fleet_errors.fetch_add(1, Relaxed);
                tracing::error!("--engines: {e}; nothing changed");
                return;
            }
        };
        let mut writes = Vec::new();
        for (name, d) in &declared {
            // Line numbers move when lines are added: only what is declared counts.
            let same = applied
                .get(name)
                .is_some_and(|a: &Declared| a.lanes == d.lanes && a.source == d.source);
            if !same {
                writes.push(Write::Announce {
                    name: name.clone(),
                    lanes: d.lanes.clone(),
                    feed: Feed::Events,
                    source: Some(d.source.clone()),
                });
            }
        }
        for name in applied.keys().filter(|n| !declared.contains_key(*n)) {
            let sources = self.sources.lock().expect("not poisoned");
            let id = (sources.iter()).find_map(|(w, s)| (s.name == *name).then_some(*w));
            drop(sources);
            match id {
                Some(worker) => writes.push(Write::Retire { worker }),
                None => {
                    tracing::info!(worker = %name, "--engines: no longer declared and not active")
                }
            }
        }
        tracing::info!(
            engines = declared.len(),
            changes = writes.len(),
            "--engines: {path} applied"
        );
        for w in writes {
            if futures::executor::block_on(self.inbox.send(w)).is_err() {
                return;
            }
        }
        METRICS.fleet_applies.fetch_add(1, Relaxed);
        METRICS.fleet_workers.store(declared.len() as u64, Relaxed);
        *applied = declared;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_declare_workers_ranks_expanded() {
        let text = "# the fleet\n\
            a tcp://10.0.0.5:5557 replay=tcp://10.0.0.5:5558 model=llama dp=2 # two ranks\n\
            \n\
            b ipc:///run/kv model=qwen salt=s lanes=full_attention@16,sliding_window:4096@32\n";
        let d = parse("f", text, 16).unwrap();
        assert_eq!(d.keys().collect::<Vec<_>>(), ["a", "a/dp1", "b"]);
        assert_eq!(d["a/dp1"].source.endpoint, "tcp://10.0.0.5:5558");
        assert_eq!(d["a/dp1"].source.replay, "tcp://10.0.0.5:5559");
        assert_eq!(d["a"].lanes, vec![Lane::full(16)]);
        assert_eq!(d["a"].line, 2);
        assert_eq!(d["b"].source.salt, "s");
        assert_eq!(
            d["b"].lanes,
            vec![
                Lane::full(16),
                Lane {
                    kind: LaneKind::SlidingWindow { window: 4096 },
                    block_tokens: 32
                }
            ]
        );
    }

    #[test]
    fn a_line_that_does_not_read_is_named() {
        for (text, line, says) in [
            ("a tcp://h:1", 1, "model=... is required"),
            ("a", 1, "expected NAME ENDPOINT"),
            (
                "\na tcp://h:1 model=m colour=red",
                2,
                "unknown key \"colour\"",
            ),
            ("a tcp://h:1 model=m dp=0", 1, "1 to 256"),
            (
                "a tcp://h:1 model=m lanes=full_attention",
                1,
                "KIND[:PARAM]@TOKENS",
            ),
            ("a tcp://h:1 model=m lanes=warp@16", 1, "unknown lane kind"),
            ("a tcp://h:65535 model=m dp=2", 1, "past 65535"),
            (
                "a tcp://h:1 model=m\n\na tcp://h:2 model=m",
                3,
                "on line 1 already",
            ),
            (
                "a tcp://h:1 model=m dp=2\na/dp1 tcp://h:9 model=m",
                2,
                "on line 1",
            ),
            ("a tcp://h:1 model=m novalue", 1, "KEY=VALUE"),
        ] {
            match parse("fleet.txt", text, 16) {
                Err(FleetError::Line { line: l, why, .. }) => {
                    assert_eq!(l, line, "{text:?}: {why}");
                    assert!(why.contains(says), "{text:?}: {why}");
                }
                other => panic!("{text:?}: {other:?}"),
            }
        }
    }
}
