use super::*;

#[test]
fn topics_parse_by_the_template_and_others_do_not() {
    let t: TopicTemplate = "kv@{host}@{model}".parse().unwrap();
    assert_eq!(
        t.parse("kv@10.0.0.5@meta-llama/Llama-3.1-8B"),
        Some(("10.0.0.5".into(), "meta-llama/Llama-3.1-8B".into()))
    );
    assert_eq!(
        t.parse("kv@pod-a@m@x"),
        Some(("pod-a".into(), "m@x".into()))
    );
    for bad in ["", "kv", "kv@", "kv@@m", "kv@h@", "xv@h@m"] {
        assert_eq!(t.parse(bad), None, "{bad:?}");
    }
    let t: TopicTemplate = "{model}|{host}".parse().unwrap();
    assert_eq!(t.parse("m|h"), Some(("h".into(), "m".into())));
    for bad in [
        "kv@{host}",
        "{model}",
        "{host}{model}",
        "{host}@{host}@{model}",
    ] {
        assert!(bad.parse::<TopicTemplate>().is_err(), "{bad:?}");
    }
}

#[test]
fn ranks_offset_endpoints_as_the_engines_do() {
    assert_eq!(rank_endpoint("tcp://*:5557", 0).unwrap(), "tcp://*:5557");
    assert_eq!(rank_endpoint("tcp://*:5557", 3).unwrap(), "tcp://*:5560");
    assert_eq!(
        rank_endpoint("ipc:///tmp/kv", 2).unwrap(),
        "ipc:///tmp/kv_dp2"
    );
    assert!(rank_endpoint("tcp://*:65535", 1).is_err());
    assert!(rank_endpoint("tcp://*", 1).is_err());
}

#[test]
fn a_discovered_engine_is_named_by_its_host_and_rank() {
    let spec = BindSpec {
        endpoints: vec!["tcp://*:5557".into(), "tcp://*:5558".into()],
        topic: "kv@{host}@{model}".parse().unwrap(),
        replay_port: Some(5600),
        lanes: vec![kvix_wire::Lane::full(16)],
        grace: Duration::from_secs(60),
        allow: None,
    };
    let d = spec.discover(1, "kv@10.0.0.5@m").unwrap();
    assert_eq!(d.name, "10.0.0.5/dp1");
    assert_eq!(d.source.endpoint, "bound://1/kv@10.0.0.5@m");
    assert_eq!(d.source.replay, "tcp://10.0.0.5:5601");
    assert_eq!(d.source.model, "m");
    assert_eq!(
        parse_source_endpoint(&d.source.endpoint),
        Some((1, "kv@10.0.0.5@m"))
    );
    assert_eq!(
        spec.discover(0, "kv@fd00::1@m").unwrap().source.replay,
        "tcp://[fd00::1]:5600"
    );
    assert_eq!(
        spec.peer_of("kv@10.0.0.5@m"),
        Some("10.0.0.5".parse().unwrap())
    );
    assert_eq!(spec.peer_of("kv@pod-a@m"), None);
    assert_eq!(spec.discover(0, "other"), None);
}
