//! The HTTP API (`--http`): Dynamo's standalone KV indexer API over kvix, fed by real
//! vLLM 0.34 publishers (scripts/engines.py), driven over plain HTTP/1.1. Answers are
//! worked out here from the token ids, in tokens, per instance, rank and tier.

mod common;

use std::time::Duration;

use common::engines::{available, Ports};
use common::http::{Http, Reply};
use common::*;
use serde_json::{json, Value};

const V034: &str = "vllm-0.34.0";

/// Prompt `p`'s tokens of 16-token blocks `from..to`.
fn toks(p: u32, from: u32, to: u32) -> Vec<u32> {
    (from * 16..to * 16).map(|i| p * 100_000 + i).collect()
}

/// A vLLM 0.34 store of blocks `from..to` of prompt `p` in `medium`; block i's engine
/// hash is `base + i`.
fn stored(p: u32, from: u32, to: u32, base: u64, medium: &str) -> Value {
    let hash = |i: u32| json!(0xF000_0000_0000_0000u64 | (base + u64::from(i)));
    json!({
        "type": "BlockStored",
        "block_hashes": (from..to).map(hash).collect::<Vec<_>>(),
        "parent_block_hash": (from > 0).then(|| hash(from - 1)),
        "token_ids": toks(p, from, to),
        "block_size": 16,
        "lora_id": null,
        "medium": medium,
        "lora_name": null,
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    })
}

fn register(http: &mut Http, instance: u64, rank: u32, ports: &Ports, model: &str) -> Reply {
    http.post(
        "/register",
        &json!({
            "instance_id": instance,
            "endpoint": ports.endpoint(rank as u16),
            "replay_endpoint": ports.replay(rank as u16),
            "model_name": model,
            "block_size": 16,
            "dp_rank": rank,
        }),
    )
}

/// Waits (bounded) until `/query` with `body` answers `want`.
fn expect_query(http: &mut Http, body: &Value, want: &Value, what: &str) {
    let mut last = None;
    for _ in 0..600 {
        let r = http.post("/query", body);
        if r.status == 200 && &r.json() == want {
            return;
        }
        last = Some((r.status, r.text()));
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("{what}: expected {want}, last {last:?}");
}

fn http_server(flags: &[&str]) -> (Server, Http) {
    let server = Server::start(&[&["--http", "127.0.0.1:0"], flags].concat());
    let http = Http::open(server.http.expect("the HTTP API's address"));
    (server, http)
}

/// Two ranks of one instance register, their engines publish (GPU on both, CPU on one),
/// and `/query` answers Dynamo's shape in tokens: `scores` GPU by rank, `instances` the
/// maxima over ranks with CPU and disk cumulative. Registrations that clash are 409s,
/// and unregistering a rank, then the instance, takes them out.
#[test]
fn registered_engines_are_queried_in_tokens_by_rank_and_tier() {
    if available("registered_engines_are_queried").is_none() {
        return;
    }
    let (server, mut http) = http_server(&["--cores", "2"]);
    let (ports, mut publishers) = Ports::start_ranks(V034, 2);
    for rank in 0..2 {
        let r = register(&mut http, 7, rank, &ports, "m");
        assert_eq!((r.status, r.json()), (201, json!({"status": "ok"})));
    }
    let mut rank1 = publishers.pop().unwrap();
    let mut rank0 = publishers.pop().unwrap();
    // Rank 0: blocks 0..3 on GPU. Rank 1: block 0 on GPU, 0..4 on CPU.
    // Four blocks and a partial one (not a block: left out, as Dynamo leaves it).
    let tokens = [toks(1, 0, 4), vec![1, 2, 3]].concat();
    let query = json!({"token_ids": tokens, "model_name": "m"});
    let want = json!({
        "frequencies": [],
        "scores": {"7": {"0": 48, "1": 16}},
        "instances": {"7": {"gpu": 48, "cpu": 64, "disk": 64, "longest_matched": 64, "dp": {"0": 48, "1": 16}}},
    });
    for _ in 0..600 {
        rank0.publish(vec![stored(1, 0, 3, 1, "GPU")]);
        rank1.publish(vec![stored(1, 0, 1, 1, "GPU"), stored(1, 0, 4, 1, "CPU")]);
        if http.post("/query", &query).json() == want {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    expect_query(&mut http, &query, &want, "both ranks, both tiers");
    let workers = http.get("/workers?model_name=m").json();
    let listed = &workers.as_array().expect("a list")[0];
    assert_eq!(listed["instance_id"], 7);
    assert_eq!(listed["block_size"], 16);
    assert_eq!(listed["endpoints"]["1"], ports.endpoint(1).as_str());
    assert_eq!(http.get("/workers?model_name=other").json(), json!([]));

    let r = register(&mut http, 7, 0, &ports, "m");
    assert_eq!(
        (r.status, r.error()),
        (409, "instance 7 dp_rank 0 already registered".into())
    );
    let r = register(&mut http, 7, 2, &ports, "other");
    assert_eq!(r.status, 409);
    assert!(
        r.error().contains("already registered for model=m"),
        "{}",
        r.error()
    );
    let mut wide = json!({"instance_id": 8, "endpoint": ports.endpoint(0), "model_name": "m", "block_size": 32});
    let r = http.post("/register", &wide);
    assert_eq!(r.status, 409);
    assert!(
        r.error().starts_with("block_size mismatch"),
        "{}",
        r.error()
    );
    wide["block_size"] = json!(16);
    wide["endpoint"] = json!("127.0.0.1:5557");
    let r = http.post("/register", &wide);
    assert_eq!(
        (r.status, r.error()),
        (
            400,
            "invalid ZMQ endpoint `127.0.0.1:5557`: missing scheme".into()
        )
    );
    let r = http.post("/query", &json!({"token_ids": [1], "model_name": "x"}));
    assert_eq!(
        (r.status, r.error()),
        (404, "no indexer for model=x routing_group=default".into())
    );

    let r = http.post(
        "/unregister",
        &json!({"instance_id": 7, "model_name": "m", "routing_group": "default", "dp_rank": 1}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let only0 = json!({
        "frequencies": [],
        "scores": {"7": {"0": 48}},
        "instances": {"7": {"gpu": 48, "cpu": 48, "disk": 48, "longest_matched": 48, "dp": {"0": 48}}},
    });
    expect_query(&mut http, &query, &only0, "rank 1 gone");
    let r = http.post(
        "/unregister",
        &json!({"instance_id": 7, "model_name": "other"}),
    );
    assert_eq!(r.status, 404);
    let r = http.post("/unregister", &json!({"instance_id": 7, "model_name": "m"}));
    assert_eq!(r.status, 200);
    let r = http.post("/query", &query);
    assert_eq!(
        r.status, 404,
        "the partition is gone with its last instance"
    );
    assert!(server.metric("kvix_http_responses_total{code=\"201\"}") >= 2);
    assert!(server.metric("kvix_http_requests_total{route=\"query\"}") >= 4);
    rank0.stop();
    rank1.stop();
}

/// Bad input on the HTTP port gets a bounded, typed refusal, in Dynamo's shape where it
/// has one (axum's plain-text rejections, `{"error"}` from handlers), and the server
/// stays up for everyone else.
#[test]
fn bad_input_gets_bounded_typed_refusals() {
    let (server, mut http) = http_server(&["--cores", "1"]);
    let r = http.request("POST", "/query", &[], b"{}").unwrap();
    assert_eq!(
        (r.status, r.text().as_str()),
        (
            415,
            "Expected request with `Content-Type: application/json`"
        )
    );
    let json_type = [("Content-Type", "application/json")];
    let r = http
        .request("POST", "/query", &json_type, b"{\"token_ids\": [1,")
        .unwrap();
    assert_eq!(r.status, 400);
    assert!(
        r.text()
            .starts_with("Failed to parse the request body as JSON: "),
        "{}",
        r.text()
    );
    assert_eq!(r.header("content-type"), Some("text/plain; charset=utf-8"));
    let r = http
        .request("POST", "/query", &json_type, b"{\"token_ids\": [1]}")
        .unwrap();
    assert_eq!(r.status, 422);
    assert!(
        r.text().contains("missing field `model_name`"),
        "{}",
        r.text()
    );
    let r = http
        .request(
            "POST",
            "/query",
            &json_type,
            b"{\"token_ids\": [-1], \"model_name\": \"m\"}",
        )
        .unwrap();
    assert_eq!(r.status, 422);
    let r = http.post(
        "/query_by_hash",
        &json!({"block_hashes": [1], "model_name": "m", "cache_salt": ""}),
    );
    assert_eq!(r.status, 400);
    assert!(
        r.error().starts_with("cache_salt is not accepted"),
        "{}",
        r.error()
    );
    let r = http.post(
        "/query_by_hash",
        &json!({"block_hashes": [1], "model_name": "m"}),
    );
    assert_eq!(r.status, 404);
    let r = http.get("/dump");
    assert_eq!(r.status, 501);
    assert!(r.error().contains("not implemented by kvix"));
    let r = http.get("/health");
    assert_eq!((r.status, r.body.len()), (200, 0));
    let r = http.request("HEAD", "/health", &[], b"").unwrap();
    assert_eq!(r.status, 200);
    let r = http.get("/nowhere");
    assert_eq!(r.status, 404);
    let r = http.get("/query");
    assert_eq!((r.status, r.header("allow")), (405, Some("POST")));
    // All of that on one kept-alive connection.

    // A body over the limit is refused before it is read, and the connection closed.
    let mut big = Http::open(server.http.unwrap());
    let huge = (9u64 << 20).to_string();
    big.send_raw(
        format!("POST /query HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: {huge}\r\n\r\n")
            .as_bytes(),
    );
    let r = big.read_reply(false).unwrap();
    assert_eq!(
        (r.status, r.text().as_str()),
        (
            413,
            "Failed to buffer the request body: length limit exceeded"
        )
    );
    assert!(big.closed());
    // The bound holds on every route: a GET announcing a huge body is refused alike.
    let mut big_get = Http::open(server.http.unwrap());
    big_get.send_raw(format!("GET /health HTTP/1.1\r\nContent-Length: {huge}\r\n\r\n").as_bytes());
    assert_eq!(big_get.read_reply(false).unwrap().status, 413);
    assert!(big_get.closed());
    // The echo (the latency bench's floor): N bytes back whatever came, N bounded.
    let sent = vec![b'x'; 70_000];
    let r = http.request("POST", "/echo?bytes=300", &[], &sent).unwrap();
    assert_eq!((r.status, r.body.len()), (200, 300));
    for bad in ["/echo", "/echo?bytes=65537", "/echo?bytes=x"] {
        assert_eq!(
            http.request("POST", bad, &[], b"").unwrap().status,
            400,
            "{bad}"
        );
    }
    assert!(server.metric("kvix_http_requests_total{route=\"echo\"}") >= 4);
    let mut chunked = Http::open(server.http.unwrap());
    let r = chunked
        .request(
            "POST",
            "/register",
            &[
                ("Content-Type", "application/json"),
                ("Transfer-Encoding", "chunked"),
            ],
            b"",
        )
        .unwrap();
    assert_eq!(r.status, 411);
    let mut long = Http::open(server.http.unwrap());
    long.send_raw(format!("GET /health HTTP/1.1\r\nX: {}\r\n\r\n", "a".repeat(20_000)).as_bytes());
    assert_eq!(long.read_reply(false).unwrap().status, 431);
    let mut garbage = Http::open(server.http.unwrap());
    garbage.send_raw(b"\x16\x03\x01 hello\r\n\r\n");
    assert_eq!(garbage.read_reply(false).unwrap().status, 400);

    for code in [
        "400", "404", "405", "411", "413", "415", "422", "431", "501",
    ] {
        let name = format!("kvix_http_responses_total{{code=\"{code}\"}}");
        assert!(server.metric(&name) >= 1, "{name}");
    }
    assert!(server.metric("kvix_http_requests_total{route=\"unknown\"}") >= 1);
    assert_eq!(
        http.get("/health").status,
        200,
        "the first connection still serves"
    );
}

/// With `--auth-token`, every request needs it as a bearer token.
#[test]
fn a_bearer_token_is_required_when_set() {
    let (_server, mut http) = http_server(&["--cores", "1", "--auth-token", "s3cret"]);
    let r = http.get("/workers");
    assert_eq!(r.status, 401);
    assert!(r.error().contains("bearer token"));
    let r = http
        .request("GET", "/workers", &[("Authorization", "Bearer wrong")], b"")
        .unwrap();
    assert_eq!(r.status, 401);
    let r = http
        .request(
            "GET",
            "/workers",
            &[("Authorization", "Bearer s3cret")],
            b"",
        )
        .unwrap();
    assert_eq!((r.status, r.json()), (200, json!([])));
}

/// A query body of megabytes is parsed (and its tokens hashed) on a thread aside: the
/// executor that read it answers queries on the kvix port meanwhile. (One executor:
/// parsed in place, the body would hold that executor, its metrics endpoint included,
/// and the gauge below would never be seen above 0.)
#[test]
fn large_bodies_are_parsed_aside_while_the_executor_answers_queries() {
    let (server, mut http) = http_server(&["--cores", "1"]);
    let r = http.post(
        "/register",
        &json!({"instance_id": 1, "endpoint": "tcp://127.0.0.1:1", "model_name": "m", "block_size": 16}),
    );
    assert_eq!(r.status, 201);
    let tokens: Vec<u32> = (0..1_150_000).map(|i| 100_000 + i).collect();
    let body = json!({"token_ids": tokens, "model_name": "m"}).to_string();
    assert!(body.len() > 7 << 20 && body.len() < 8 << 20);
    let addr = server.http.unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let big = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut big = Http::open(addr);
            let mut answered = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let r = big
                    .request(
                        "POST",
                        "/query",
                        &[("Content-Type", "application/json")],
                        body.as_bytes(),
                    )
                    .expect("a reply");
                assert_eq!(r.status, 200, "{}", r.text());
                answered += 1;
            }
            answered
        })
    };
    let mut c = server.session();
    let ks = kvix_wire::Keyspace::tokens("m");
    let mut seen = false;
    let mut zero = 0;
    for _ in 0..500 {
        if server.metric("kvix_http_bodies_parsing_aside") == 0 {
            zero += 1;
            std::thread::sleep(Duration::from_millis(2));
            continue;
        }
        // A body is being parsed: the executor answers a query, and the parse is still
        // going once it has.
        c.query(&ks, &[1, 2, 3]);
        if server.metric("kvix_http_bodies_parsing_aside") == 1 {
            seen = true;
            break;
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let answered = big.join().unwrap();
    assert!(seen, "no query was answered while a body was parsed aside ({zero} polls saw none, {answered} bodies answered)");
    assert!(answered >= 1);
}
