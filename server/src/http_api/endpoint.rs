//! ZMQ endpoints as Dynamo's indexer checks them at `/register`
//! (`services/common/zmq.rs`), with its messages: `scheme://address`; `tcp` needs a
//! host (`*` allowed, IPv6 in brackets) and a port; `ipc` and `inproc` any address.

/// An endpoint Dynamo's indexer does not take, and why, in its words.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid ZMQ endpoint `{endpoint}`: {why}")]
pub struct BadEndpoint {
    endpoint: String,
    why: String,
}

/// Whether `endpoint` is one Dynamo's indexer takes.
pub fn check(endpoint: &str) -> Result<(), BadEndpoint> {
    let bad = |why: &str| {
        Err(BadEndpoint {
            endpoint: endpoint.to_string(),
            why: why.to_string(),
        })
    };
    let Some((scheme, address)) = endpoint.split_once("://") else {
        return bad("missing scheme");
    };
    if address.is_empty() {
        return bad("missing address");
    }
    match scheme {
        "tcp" => {
            let (host, port) = if let Some(rest) = address.strip_prefix('[') {
                let Some((host, after)) = rest.split_once(']') else {
                    return bad("missing closing `]`");
                };
                let Some(port) = after.strip_prefix(':') else {
                    return bad("missing TCP port");
                };
                (host, port)
            } else {
                match address.rsplit_once(':') {
                    Some((host, _)) if host.contains(':') => return bad("missing TCP port"),
                    Some(hp) => hp,
                    None => return bad("missing TCP port"),
                }
            };
            if host.is_empty() {
                return bad("missing TCP host");
            }
            if let Err(e) = port.parse::<u16>() {
                return bad(&format!("invalid TCP port: {e}"));
            }
            Ok(())
        }
        "ipc" | "inproc" => Ok(()),
        other => bad(&format!("unsupported scheme `{other}`")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_checked_as_dynamo_checks_them() {
        for ok in [
            "tcp://127.0.0.1:5557",
            "tcp://*:5557",
            "tcp://[::1]:1",
            "ipc:///tmp/x",
            "inproc://a",
        ] {
            assert_eq!(check(ok), Ok(()), "{ok}");
        }
        let why = |ep: &str| check(ep).unwrap_err().to_string();
        assert_eq!(
            why("127.0.0.1:5557"),
            "invalid ZMQ endpoint `127.0.0.1:5557`: missing scheme"
        );
        assert!(why("tcp://").ends_with("missing address"));
        assert!(why("tcp://host").ends_with("missing TCP port"));
        assert!(why("tcp://::1:5").ends_with("missing TCP port"));
        assert!(why("tcp://:5").ends_with("missing TCP host"));
        assert!(why("tcp://[::1:5").ends_with("missing closing `]`"));
        assert!(why("tcp://h:99999").contains("invalid TCP port: "));
        assert!(why("udp://h:1").ends_with("unsupported scheme `udp`"));
    }
}
