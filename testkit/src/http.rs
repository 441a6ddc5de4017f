//! A plain HTTP/1.1 client for the HTTP API's tests: one kept-alive connection,
//! requests written as given (so malformed ones can be sent), replies read by their
//! Content-Length.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use serde_json::Value;

pub struct Http {
    stream: TcpStream,
    buf: Vec<u8>,
}

/// One reply.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> Value {
        assert_eq!(
            self.header("content-type"),
            Some("application/json"),
            "{self:?}"
        );
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("{e}: {self:?}"))
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The `error` of a handler's JSON error body.
    pub fn error(&self) -> String {
        self.json()["error"].as_str().expect("an error").to_string()
    }
}

impl Http {
    pub fn open(addr: SocketAddr) -> Http {
        let stream = TcpStream::connect(addr).expect("connects");
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        stream.set_nodelay(true).unwrap();
        Http {
            stream,
            buf: Vec::new(),
        }
    }

    /// POSTs `body` as JSON.
    pub fn post(&mut self, path: &str, body: &Value) -> Reply {
        self.request(
            "POST",
            path,
            &[("Content-Type", "application/json")],
            body.to_string().as_bytes(),
        )
        .expect("a reply")
    }

    pub fn get(&mut self, path: &str) -> Reply {
        self.request("GET", path, &[], b"").expect("a reply")
    }

    /// Sends a request with these headers (and a Content-Length for a body) and reads its
    /// reply; None when the server closed instead.
    pub fn request(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Option<Reply> {
        let mut head = format!("{method} {path} HTTP/1.1\r\nHost: kvix\r\n");
        for (k, v) in headers {
            head += &format!("{k}: {v}\r\n");
        }
        if !body.is_empty() {
            head += &format!("Content-Length: {}\r\n", body.len());
        }
        head += "\r\n";
        self.send_raw(head.as_bytes());
        self.send_raw(body);
        self.read_reply(method == "HEAD")
    }

    pub fn send_raw(&mut self, bytes: &[u8]) {
        // The server may close on a refusal before it read everything: not an error here.
        let _ = self.stream.write_all(bytes);
    }

    /// The next reply; None when the server closed first.
    pub fn read_reply(&mut self, head_only: bool) -> Option<Reply> {
        let end = loop {
            if let Some(i) = self.buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i;
            }
            if !self.fill() {
                return None;
            }
        };
        let head = String::from_utf8(self.buf[..end].to_vec()).expect("a text head");
        self.buf.drain(..end + 4);
        let mut lines = head.split("\r\n");
        let status: u16 = lines.next()?.split(' ').nth(1)?.parse().ok()?;
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
            .collect();
        let length: usize = headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
            .map_or(0, |(_, v)| v.parse().unwrap());
        let length = if head_only { 0 } else { length };
        while self.buf.len() < length {
            if !self.fill() {
                return None;
            }
        }
        let body = self.buf.drain(..length).collect();
        Some(Reply {
            status,
            headers,
            body,
        })
    }

    /// Whether the server closed the connection (nothing more to read).
    pub fn closed(&mut self) -> bool {
        self.buf.is_empty() && !self.fill()
    }

    fn fill(&mut self) -> bool {
        let mut chunk = [0u8; 64 * 1024];
        match self.stream.read(&mut chunk) {
            Ok(0) | Err(_) => false,
            Ok(n) => {
                self.buf.extend_from_slice(&chunk[..n]);
                true
            }
        }
    }
}
