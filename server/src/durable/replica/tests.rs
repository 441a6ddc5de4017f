use super::*;

/// A replica that stops following its log answers the writes waiting to be read
/// back (they waited for ever), and refuses the next before it is appended.
#[test]
fn stopping_to_follow_answers_the_writes_waiting() {
    use futures::FutureExt;
    let url: LogUrl = "redis://127.0.0.1:1/kvix".parse().unwrap();
    let r = Replica::new(url, "g".into(), ("f".into(), 16), "0-0".into(), Vec::new()).unwrap();
    let (tx, mut waiting) = oneshot::channel();
    assert!(r.expect(tx).is_some());
    assert!(waiting.try_recv().unwrap().is_none());
    r.stop_following(Stopped::Unreadable, "a record it cannot read".into());
    let answered = waiting.now_or_never().expect("answered").expect("sent");
    assert!(matches!(answered, Err(Failure::LogUnavailable(why)) if why.contains("cannot read")));
    let (tx, later) = oneshot::channel();
    assert!(r.expect(tx).is_none(), "appended after the stop");
    let refused = later.now_or_never().expect("answered").expect("sent");
    assert!(matches!(refused, Err(Failure::LogUnavailable(_))));
}

#[test]
fn log_urls_name_a_server_and_a_key() {
    let u: LogUrl = "redis://127.0.0.1:6379/kvix".parse().unwrap();
    assert_eq!(u.server, LogServer::Direct("redis://127.0.0.1:6379".into()));
    assert_eq!(u.key, "kvix");
    let s: LogUrl = "redis+sentinel://10.0.0.1:26379,10.0.0.2:26379/logmaster/kvix"
        .parse()
        .unwrap();
    assert_eq!(
        s.server,
        LogServer::Sentinel {
            sentinels: vec![
                "redis://10.0.0.1:26379".into(),
                "redis://10.0.0.2:26379".into()
            ],
            master: "logmaster".into()
        }
    );
    assert_eq!(s.key, "kvix");
    assert_eq!(
        s.server.to_string(),
        "redis+sentinel://10.0.0.1:26379,10.0.0.2:26379/logmaster"
    );
    for bad in [
        "redis://127.0.0.1:6379",
        "redis://127.0.0.1:6379/",
        "http://x/k",
        "redis:///k",
        "redis+sentinel://10.0.0.1:26379/logmaster",
        "redis+sentinel://10.0.0.1:26379//kvix",
        "redis+sentinel://,10.0.0.1:26379/m/kvix",
    ] {
        assert!(bad.parse::<LogUrl>().is_err(), "{bad}");
    }
    let err = "redis://:s3cret@10.0.0.1:6379"
        .parse::<LogUrl>()
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("redis://:***@10.0.0.1:6379") && !err.contains("s3cret"),
        "{err}"
    );
    assert!(id_key("12-3") < id_key("12-10"));
    assert!(id_key("9-99") < id_key("10-0"));
}

/// A rebuild waits for the replicas that reported following the log in the last 10 s:
/// not itself, not the stored snapshot's entry, not one silent longer.
#[test]
fn the_peers_a_rebuild_waits_for_reported_lately() {
    let url: LogUrl = "redis://127.0.0.1:1/kvix".parse().unwrap();
    let r = Replica::new(url, "g".into(), ("f".into(), 16), "0-0".into(), Vec::new()).unwrap();
    let now = 1_000_000;
    let reports: HashMap<String, String> = [
        (r.id.clone(), format!("5-0 {now}")),
        ("snapshot".into(), format!("4-0 {}", u64::MAX)),
        ("fresh".into(), format!("5-0 {}", now - 2_000)),
        ("silent".into(), format!("3-0 {}", now - 60_000)),
        ("garbled".into(), "5-0".into()),
    ]
    .into_iter()
    .collect();
    r.saw_peers(&reports, now);
    assert_eq!(r.peers(), vec!["fresh".to_string()]);
}
