//! The one place bytes from an HTTP client become a request head: the request line and
//! the headers this API reads, from a buffer that holds at least the whole head.
//! HTTP/1.1 only (Dynamo's indexer speaks nothing else); a head that is not one is an
//! error, never a panic.

/// Largest request head taken; a longer one is refused with 431.
pub const MAX_HEAD: usize = 16 * 1024;

/// A request's method.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    Get,
    Head,
    Post,
    /// Any other token (answered 405 on a known path).
    Other,
}

/// What this API reads of a request head.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Head {
    pub method: Method,
    /// The path without its query string (not decoded: routes are plain ASCII).
    pub path: String,
    /// The query string after `?`, raw.
    pub query: String,
    /// `Content-Length`, when given.
    pub length: Option<u64>,
    /// `Content-Type`, lowercased, without parameters.
    pub content_type: Option<String>,
    /// `Authorization`, as sent.
    pub authorization: Option<String>,
    /// `Transfer-Encoding` was given (a chunked body, which this API does not read).
    pub chunked: bool,
    /// The client keeps the connection (HTTP/1.1 without `Connection: close`).
    pub keep_alive: bool,
    /// `Expect: 100-continue`: the client waits for a go-ahead before its body.
    pub expects_continue: bool,
    /// Bytes the head took, its blank line included.
    pub len: usize,
}

/// Why a head is refused (the connection is answered 400 or 431 and closed).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeadError {
    #[error("the request head is over {MAX_HEAD} bytes")]
    TooLarge,
    #[error("malformed request line")]
    RequestLine,
    #[error("HTTP version {0:?} (HTTP/1.1 or 1.0 only)")]
    Version(String),
    #[error("malformed header line")]
    Header,
    #[error("Content-Length {0:?} is not a number, or given twice differently")]
    Length(String),
}

/// The head at the front of `buf`: `Ok(None)` while its blank line has not arrived.
pub fn parse(buf: &[u8]) -> Result<Option<Head>, HeadError> {
    let Some(end) = find_blank_line(buf) else {
        return match buf.len() > MAX_HEAD {
            true => Err(HeadError::TooLarge),
            false => Ok(None),
        };
    };
    if end > MAX_HEAD {
        return Err(HeadError::TooLarge);
    }
    let text = std::str::from_utf8(&buf[..end]).map_err(|_| HeadError::Header)?;
    let mut lines = text.split("\r\n");
    let line = lines.next().ok_or(HeadError::RequestLine)?;
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(HeadError::RequestLine);
    };
    if method.is_empty() || !target.starts_with('/') {
        return Err(HeadError::RequestLine);
    }
    let http11 = match version {
        "HTTP/1.1" => true,
        "HTTP/1.0" => false,
        other => return Err(HeadError::Version(other.chars().take(32).collect())),
    };
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let mut head = Head {
        method: match method {
            "GET" => Method::Get,
            "HEAD" => Method::Head,
            "POST" => Method::Post,
            _ => Method::Other,
        },
        path: path.to_string(),
        query: query.to_string(),
        length: None,
        content_type: None,
        authorization: None,
        chunked: false,
        keep_alive: http11,
        expects_continue: false,
        len: end + 4,
    };
    for line in lines.filter(|l| !l.is_empty()) {
        let (name, value) = line.split_once(':').ok_or(HeadError::Header)?;
        if name.is_empty() || name.bytes().any(|b| b.is_ascii_whitespace()) {
            return Err(HeadError::Header);
        }
        let value = value.trim();
        match name.to_ascii_lowercase().as_str() {
            "content-length" => {
                let n: u64 = value
                    .parse()
                    .map_err(|_| HeadError::Length(value.chars().take(32).collect()))?;
                if head.length.is_some_and(|m| m != n) {
                    return Err(HeadError::Length(value.chars().take(32).collect()));
                }
                head.length = Some(n);
            }
            "content-type" => {
                let bare = value.split(';').next().unwrap_or("").trim();
                head.content_type = Some(bare.to_ascii_lowercase());
            }
            "authorization" => head.authorization = Some(value.to_string()),
            "transfer-encoding" => head.chunked = true,
            "connection" => {
                let v = value.to_ascii_lowercase();
                if v.split(',').any(|t| t.trim() == "close") {
                    head.keep_alive = false;
                } else if v.split(',').any(|t| t.trim() == "keep-alive") {
                    head.keep_alive = true;
                }
            }
            "expect" => head.expects_continue = value.eq_ignore_ascii_case("100-continue"),
            _ => {}
        }
    }
    Ok(Some(head))
}

fn find_blank_line(buf: &[u8]) -> Option<usize> {
    buf.windows(4).position(|w| w == b"\r\n\r\n")
}

/// Whether `content_type` is JSON as axum's `Json` takes it: `application/json` or
/// `application/*+json`, any parameters.
pub fn is_json(content_type: Option<&str>) -> bool {
    match content_type {
        Some("application/json") => true,
        Some(t) => t
            .strip_prefix("application/")
            .is_some_and(|sub| sub.ends_with("+json")),
        None => false,
    }
}

/// The value of `key` in a query string (`a=1&b=x`), percent- and plus-decoded; None
/// when absent; an error when the key appears twice (as serde's query reader says).
pub fn query_value(query: &str, key: &str) -> Result<Option<String>, BadQuery> {
    let mut found = None;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        if decode(k)? == key {
            if found.is_some() {
                return Err(BadQuery::Duplicate(key.to_string()));
            }
            found = Some(decode(v)?);
        }
    }
    Ok(found)
}

/// A query string serde's query reader refuses, in its words.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadQuery {
    #[error("duplicate field `{0}`")]
    Duplicate(String),
    #[error("invalid percent-encoding")]
    PercentEncoding,
    #[error("invalid UTF-8 in the query string")]
    Utf8,
}

fn decode(s: &str) -> Result<String, BadQuery> {
    let mut out = Vec::with_capacity(s.len());
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' => {
                let hex = b
                    .get(i + 1..i + 3)
                    .and_then(|h| std::str::from_utf8(h).ok())
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                    .ok_or(BadQuery::PercentEncoding)?;
                out.push(hex);
                i += 2;
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8(out).map_err(|_| BadQuery::Utf8)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_head_is_read_once_whole() {
        let req = b"POST /query?x=1 HTTP/1.1\r\nHost: a\r\nContent-Type: application/json; charset=utf-8\r\nContent-Length: 12\r\nAuthorization: Bearer t\r\n\r\n{\"a\":1}";
        assert_eq!(parse(&req[..30]), Ok(None));
        let h = parse(req).unwrap().unwrap();
        assert_eq!(h.method, Method::Post);
        assert_eq!((h.path.as_str(), h.query.as_str()), ("/query", "x=1"));
        assert_eq!(h.length, Some(12));
        assert_eq!(h.content_type.as_deref(), Some("application/json"));
        assert_eq!(h.authorization.as_deref(), Some("Bearer t"));
        assert!(h.keep_alive && !h.chunked);
        assert_eq!(&req[h.len..], b"{\"a\":1}");
        let close = parse(b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n")
            .unwrap()
            .unwrap();
        assert!(!close.keep_alive);
        let old = parse(b"GET / HTTP/1.0\r\n\r\n").unwrap().unwrap();
        assert!(!old.keep_alive);
    }

    #[test]
    fn malformed_heads_are_errors() {
        for bad in [
            &b"GET\r\n\r\n"[..],
            b"GET / HTTP/2\r\n\r\n",
            b"GET nopath HTTP/1.1\r\n\r\n",
            b"GET / HTTP/1.1\r\nno colon\r\n\r\n",
            b"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
            b"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
        ] {
            assert!(parse(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
        assert_eq!(parse(&[b'a'; MAX_HEAD + 1]), Err(HeadError::TooLarge));
    }

    #[test]
    fn json_types_and_query_strings() {
        assert!(is_json(Some("application/json")));
        assert!(is_json(Some("application/problem+json")));
        assert!(!is_json(Some("text/json")));
        assert!(!is_json(None));
        assert_eq!(
            query_value("model_name=a%2Fb+c&x=1", "model_name"),
            Ok(Some("a/b c".into()))
        );
        assert_eq!(query_value("x=1", "model_name"), Ok(None));
        assert!(query_value("m=1&m=2", "m").is_err());
        assert!(query_value("m=%zz", "m").is_err());
    }

    proptest! {
        /// Whatever the bytes, the parser answers without panicking, and a head it reads
        /// never claims more bytes than it was given.
        #[test]
        fn any_bytes_are_read_or_refused(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
            if let Ok(Some(h)) = parse(&bytes) {
                prop_assert!(h.len <= bytes.len());
            }
            let _ = query_value(&String::from_utf8_lossy(&bytes), "k");
        }

        #[test]
        fn heads_built_from_parts_read_back(
            path in "/[a-z_]{0,12}",
            length in proptest::option::of(0u64..1 << 40),
            close in any::<bool>(),
        ) {
            let mut req = format!("POST {path} HTTP/1.1\r\n");
            if let Some(n) = length {
                req += &format!("content-length: {n}\r\n");
            }
            if close {
                req += "Connection: close\r\n";
            }
            req += "\r\n";
            let h = parse(req.as_bytes()).unwrap().unwrap();
            prop_assert_eq!(h.path, path);
            prop_assert_eq!(h.length, length);
            prop_assert_eq!(h.keep_alive, !close);
            prop_assert_eq!(h.len, req.len());
        }
    }
}
