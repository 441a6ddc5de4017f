//! The bodies of Dynamo's standalone indexer API (`dynamo-kv-router` 1.6.1,
//! `services/indexer/server.rs`), field for field: what is required, what defaults,
//! what `null` means; and the responses' shapes. Unknown fields are ignored, as serde
//! ignores them there.

use serde::Deserialize;
use serde_json::json;

fn default_group() -> String {
    "default".into()
}

#[derive(Debug, Deserialize)]
pub struct RegisterRequest {
    pub instance_id: u64,
    pub endpoint: String,
    pub model_name: String,
    #[serde(default = "default_group")]
    pub routing_group: String,
    /// Parsed and ignored (a legacy field), as Dynamo does.
    #[serde(default = "default_group")]
    pub tenant_id: String,
    pub block_size: u32,
    #[serde(default)]
    pub dp_rank: Option<u32>,
    #[serde(default)]
    pub replay_endpoint: Option<String>,
    /// Accepted and ignored, as Dynamo does.
    #[serde(default, alias = "additionalsalt")]
    pub additional_salt: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct UnregisterRequest {
    pub instance_id: u64,
    pub model_name: String,
    /// Absent or null: the instance in whatever group it is.
    #[serde(default)]
    pub routing_group: Option<String>,
    #[serde(default)]
    pub tenant_id: Option<String>,
    #[serde(default)]
    pub dp_rank: Option<u32>,
}

// The query bodies repeat the partition's fields rather than `#[serde(flatten)]` one
// struct: flatten buffers the whole map first, a second copy of an 8 MiB body's tokens.
#[derive(Debug, Deserialize)]
pub struct QueryRequest {
    pub token_ids: Vec<u32>,
    pub model_name: String,
    #[serde(default = "default_group")]
    pub routing_group: String,
    #[serde(default = "default_group")]
    pub tenant_id: String,
    #[serde(default)]
    pub lora_name: Option<String>,
    #[serde(default)]
    pub cache_salt: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct QueryByHashRequest {
    pub block_hashes: Vec<i64>,
    pub model_name: String,
    #[serde(default = "default_group")]
    pub routing_group: String,
    #[serde(default = "default_group")]
    pub tenant_id: String,
    #[serde(default)]
    pub cache_salt: Option<String>,
}

/// How a body that did not parse is answered, as axum's `Json` answers it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rejection {
    /// 400: not JSON (a syntax error, or the body ends early).
    Syntax(String),
    /// 422: JSON, but not the request's shape.
    Shape(String),
}

/// Reads a request body as `T`.
pub fn parse<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T, Rejection> {
    serde_json::from_slice(body).map_err(|e| {
        use serde_json::error::Category;
        match e.classify() {
            Category::Data => Rejection::Shape(format!(
                "Failed to deserialize the JSON body into the target type: {e}"
            )),
            Category::Syntax | Category::Eof | Category::Io => {
                Rejection::Syntax(format!("Failed to parse the request body as JSON: {e}"))
            }
        }
    })
}

/// A handler's error body.
pub fn error(message: impl std::fmt::Display) -> Vec<u8> {
    json!({ "error": message.to_string() })
        .to_string()
        .into_bytes()
}

/// A mutation's success body.
pub fn ok() -> Vec<u8> {
    json!({ "status": "ok" }).to_string().into_bytes()
}

/// One rank's reuse, in tokens: GPU alone, then continuing from CPU, then storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankTokens {
    pub instance: u64,
    pub rank: u32,
    pub gpu: u32,
    pub cpu: u32,
    pub disk: u32,
}

/// `/query`'s answer: `scores` (GPU tokens by instance and rank, ranks with some),
/// `frequencies` (always empty, as in Dynamo 1.6.1), and `instances` (per instance the
/// maxima over its ranks, `dp` its ranks' GPU tokens, `longest_matched` the largest).
/// Written straight out: built as maps of `Value`s it cost more than the query itself.
pub fn scores(ranks: &[RankTokens]) -> Vec<u8> {
    use std::fmt::Write;
    let mut ranks = ranks.to_vec();
    ranks.sort_by_key(|r| (r.instance, r.rank));
    ranks.dedup_by_key(|r| (r.instance, r.rank));
    let instances = || ranks.chunk_by(|a, b| a.instance == b.instance);
    let mut out = String::with_capacity(64 + ranks.len() * 96);
    let mut first = true;
    out.push_str("{\"scores\":{");
    for group in instances().filter(|g| g.iter().any(|r| r.gpu > 0)) {
        let comma = if std::mem::take(&mut first) { "" } else { "," };
        let _ = write!(out, "{comma}\"{}\":{{", group[0].instance);
        let held = group.iter().filter(|r| r.gpu > 0);
        for (i, r) in held.enumerate() {
            let comma = if i == 0 { "" } else { "," };
            let _ = write!(out, "{comma}\"{}\":{}", r.rank, r.gpu);
        }
        out.push('}');
    }
    out.push_str("},\"frequencies\":[],\"instances\":{");
    for (i, group) in instances().enumerate() {
        let max = |f: fn(&RankTokens) -> u32| group.iter().map(f).max().unwrap_or(0);
        let (gpu, cpu, disk) = (max(|r| r.gpu), max(|r| r.cpu), max(|r| r.disk));
        let comma = if i == 0 { "" } else { "," };
        let _ = write!(
            out,
            "{comma}\"{}\":{{\"gpu\":{gpu},\"cpu\":{cpu},\"disk\":{disk},\"longest_matched\":{},\"dp\":{{",
            group[0].instance,
            gpu.max(cpu).max(disk)
        );
        for (j, r) in group.iter().enumerate() {
            let comma = if j == 0 { "" } else { "," };
            let _ = write!(out, "{comma}\"{}\":{}", r.rank, r.gpu);
        }
        out.push_str("}}");
    }
    out.push_str("}}");
    out.into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    #[test]
    fn rejections_say_what_axum_says() {
        let r = parse::<QueryRequest>(b"{\"token_ids\": [1, 2]");
        assert!(
            matches!(r, Err(Rejection::Syntax(m)) if m.starts_with("Failed to parse the request body as JSON: "))
        );
        let r = parse::<QueryRequest>(b"{\"token_ids\": [1, 2]}");
        assert!(matches!(r, Err(Rejection::Shape(m)) if m.contains("missing field `model_name`")));
        let r = parse::<QueryRequest>(b"{\"token_ids\": [-1], \"model_name\": \"m\"}");
        assert!(matches!(r, Err(Rejection::Shape(_))));
        let r = parse::<QueryRequest>(
            b"{\"token_ids\": [], \"model_name\": \"m\", \"routing_group\": null}",
        );
        assert!(
            matches!(r, Err(Rejection::Shape(_))),
            "null where a string defaults"
        );
        let q = parse::<QueryRequest>(b"{\"token_ids\": [7], \"model_name\": \"m\", \"extra\": 1}")
            .unwrap();
        assert_eq!(
            (q.routing_group.as_str(), q.token_ids),
            ("default", vec![7])
        );
        let both = parse::<RegisterRequest>(br#"{"instance_id":1,"endpoint":"tcp://a:1","model_name":"m","block_size":16,"additional_salt":"a","additionalsalt":"b"}"#);
        assert!(matches!(both, Err(Rejection::Shape(_))), "both spellings");
    }

    #[test]
    fn scores_are_dynamos_shape() {
        let r = |instance, rank, gpu, cpu, disk| RankTokens {
            instance,
            rank,
            gpu,
            cpu,
            disk,
        };
        let v: Value = serde_json::from_slice(&scores(&[
            r(8, 0, 0, 16, 32),
            r(7, 1, 16, 64, 64),
            r(7, 0, 32, 48, 48),
            r(10, 0, 0, 0, 0),
        ]))
        .expect("valid JSON");
        let want = json!({
            "frequencies": [],
            "scores": {"7": {"0": 32, "1": 16}},
            "instances": {
                "7": {"gpu": 32, "cpu": 64, "disk": 64, "longest_matched": 64, "dp": {"0": 32, "1": 16}},
                "8": {"gpu": 0, "cpu": 16, "disk": 32, "longest_matched": 32, "dp": {"0": 0}},
                "10": {"gpu": 0, "cpu": 0, "disk": 0, "longest_matched": 0, "dp": {"0": 0}},
            },
        });
        assert_eq!(v, want);
        let none: Value = serde_json::from_slice(&scores(&[])).expect("valid JSON");
        assert_eq!(
            none,
            json!({"scores": {}, "frequencies": [], "instances": {}})
        );
    }
}
