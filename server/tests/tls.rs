//! TLS on the kvix port through the real binary and the real clients, with certificates
//! made here (rcgen): a CA, the server's certificate for 127.0.0.1 and localhost, a
//! client's certificate. What does not fit is refused loudly on both sides.

mod common;

use std::path::Path;
use std::time::Duration;

use common::tls::Pki;
use common::*;
use kvix_client::wire::{Feed, Keyspace, Lane};
use kvix_client::{Addr, Client, ClientConfig, ClientError, ClientTls, QueryOptions, QueryOutcome};

fn start(args: &[String]) -> Server {
    Server::start(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

fn config(server: &Server, tls: Option<ClientTls>) -> ClientConfig {
    ClientConfig {
        deadline: Duration::from_secs(2),
        reconnect_min: Duration::from_millis(5),
        reconnect_max: Duration::from_millis(50),
        tls,
        ..ClientConfig::new([Addr::tcp(server.addr.to_string())])
    }
}

/// Announce, place and query over TLS: the answer is the placement.
async fn round_trip(c: &Client) {
    let ks = Keyspace::tokens("m");
    let feed = Feed::Placements {
        capacity_blocks: 100,
        ttl_ms: 0,
    };
    c.announce("w", vec![Lane::full(16)], feed).await.unwrap();
    let chain = chain_of(&ks, 0, 8);
    assert!(c.publish_placement("w", &ks, chain.clone()));
    for _ in 0..400 {
        if let QueryOutcome::Scores(s) = c.query_chain(&ks, &chain, &QueryOptions::default()).await
        {
            if s[0].blocks == 8 {
                assert_eq!(s[0].name.as_deref(), Some("w"));
                return;
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the placement never scored over TLS");
}

fn tls_error(r: Result<Client, ClientError>) -> String {
    match r {
        Err(ClientError::Tls { message, .. }) => message,
        Err(e) => panic!("not a TLS error: {e}"),
        Ok(c) => panic!("connected: {}", c.is_connected()),
    }
}

/// Waits until the server counted `n` failed handshakes.
fn await_failures(server: &Server, n: u64) {
    eventually("handshake failures counted", || {
        (server.metric("kvix_tls_handshake_failures_total") >= n).then_some(())
    });
}

#[tokio::test]
async fn a_tls_port_serves_tls_clients_and_refuses_the_rest_loudly() {
    let pki = Pki::new("port");
    let server = start(&pki.server_args(false));
    let c = Client::connect(config(&server, Some(pki.client("ca.pem", false))))
        .await
        .unwrap();
    assert!(c.is_connected());
    round_trip(&c).await;
    // Far more than rustls buffers (64 KiB): the rest waits in the connection's
    // backlog and goes out as the socket takes it, nothing lost.
    let ks = Keyspace::tokens("m");
    let feed = Feed::Placements {
        capacity_blocks: 1 << 20,
        ttl_ms: 0,
    };
    c.announce("bulk", vec![Lane::full(16)], feed)
        .await
        .unwrap();
    for i in 0..2_000 {
        assert!(c.publish_placement("bulk", &ks, chain_of(&ks, 1_000_000 + i * 64, 32)));
    }
    // (Waited for on the runtime: the client's tasks send them.)
    for _ in 0..2_000 {
        if server.metric("kvix_placements_total") >= 2_001 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(server.metric("kvix_placements_total"), 2_001);
    assert_eq!(c.counters().placements_sent, 2_001);

    // A certificate from a CA the client does not trust.
    let untrusted = Client::connect(config(&server, Some(pki.client("other-ca.pem", false))));
    let why = tls_error(untrusted.await);
    assert!(why.contains("certificate"), "{why}");
    // A client without TLS: the server counts the failed handshake.
    let plain = Client::connect(config(&server, None)).await.unwrap();
    assert!(!plain.is_connected());
    await_failures(&server, 2);
    drop(plain);

    // A TLS client at a plain port is told so.
    let bare = Server::start(&["--cores", "1"]);
    let why = tls_error(Client::connect(config(&bare, Some(pki.client("ca.pem", false)))).await);
    assert!(why.contains("is its port TLS"), "{why}");
}

#[tokio::test]
async fn with_a_client_ca_only_clients_with_its_certificates_get_in() {
    let pki = Pki::new("mutual");
    let server = start(&pki.server_args(true));
    let without =
        tls_error(Client::connect(config(&server, Some(pki.client("ca.pem", false)))).await);
    assert!(without.to_lowercase().contains("certificate"), "{without}");
    await_failures(&server, 1);
    let with = Client::connect(config(&server, Some(pki.client("ca.pem", true))))
        .await
        .unwrap();
    assert!(with.is_connected());
    round_trip(&with).await;
}

#[test]
fn tls_files_that_do_not_read_refuse_the_start_naming_the_file() {
    let pki = Pki::new("files");
    std::fs::write(pki.path("empty.pem"), "").unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvix-server"))
        .args(["check", "--tls-cert"])
        .arg(pki.path("empty.pem"))
        .arg("--tls-key")
        .arg(pki.path("server.key"))
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("empty.pem") && text.contains("no certificate"),
        "{text}"
    );
    assert!(Path::new(&pki.path("server.pem")).exists());
}
