use super::*;

#[test]
fn hosts_outside_the_allowed_networks_are_refused() {
    let allow: Vec<ipnet::IpNet> = vec![
        "127.0.0.0/8".parse().unwrap(),
        "10.0.0.0/8".parse().unwrap(),
    ];
    let src = |ep: &str, replay: &str| EventSource {
        endpoint: ep.into(),
        replay: replay.into(),
        model: String::new(),
        salt: String::new(),
    };
    let ok = |ep, replay| check_hosts(&src(ep, replay), Some(&allow[..]));
    assert_eq!(ok("tcp://127.0.0.1:5", "tcp://10.1.2.3:6"), Ok(()));
    assert_eq!(ok("ipc:///tmp/x", ""), Ok(()));
    assert_eq!(ok("tcp://localhost:5", ""), Ok(()));
    assert!(matches!(
        ok("tcp://8.8.8.8:5", ""),
        Err(SourceError::NotAllowed { .. })
    ));
    assert!(matches!(
        ok("tcp://127.0.0.1:5", "tcp://[2001:db8::1]:6"),
        Err(SourceError::NotAllowed { .. })
    ));
    assert_eq!(check_hosts(&src("tcp://8.8.8.8:5", ""), None), Ok(()));
}

#[test]
fn endpoints_are_checked_as_libzmq_connects_to_them() {
    for ok in [
        "tcp://127.0.0.1:5557",
        "tcp://[::1]:5557",
        "tcp://engine-0:1",
        "ipc:///tmp/kv.sock",
    ] {
        assert_eq!(check_endpoint(ok, 0), Ok(()), "{ok}");
    }
    for bad in [
        "",
        "tcp://127.0.0.1",
        "tcp://:5557",
        "tcp://h:0",
        "tcp://h:x",
        "udp://h:1",
        "ipc://",
        "inproc://kv",
        &format!("ipc:///{}", "x".repeat(120)),
    ] {
        assert!(
            matches!(check_endpoint(bad, 0), Err(SourceError::Endpoint(_))),
            "{bad}"
        );
    }
    assert!(matches!(
        check_endpoint("tcp://*:5557", 0),
        Err(SourceError::Wildcard(_))
    ));
    assert_eq!(check_endpoint("bound://1/kv@h@m", 2), Ok(()));
    for bad in ["bound://2/kv@h@m", "bound://0/", "bound://x/t", "bound://0"] {
        assert!(
            matches!(check_endpoint(bad, 2), Err(SourceError::NotBound(_))),
            "{bad}"
        );
    }
    assert!(matches!(
        check_endpoint("bound://0/kv@h@m", 0),
        Err(SourceError::NotBound(_))
    ));
}
