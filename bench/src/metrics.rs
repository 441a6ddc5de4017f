//! Reading a kvix-server's Prometheus page (`--metrics`).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// The server's metrics page, as text.
pub fn page(addr: SocketAddr) -> anyhow::Result<String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: kvix\r\n\r\n")?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    Ok(text)
}

/// The value of one sample line, named with its labels (`name{a="b"}`) or without.
pub fn value(text: &str, name: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

/// The values of unlabelled metrics, in the order named.
pub fn scrape(addr: SocketAddr, names: &[&str]) -> anyhow::Result<Vec<u64>> {
    let text = page(addr)?;
    names
        .iter()
        .map(|n| {
            value(&text, n).ok_or_else(|| anyhow::anyhow!("{n} missing from the metrics at {addr}"))
        })
        .collect()
}

/// Queries answered so far by each executor (`kvix_executor_queries_total`).
pub fn executor_queries(addr: SocketAddr) -> anyhow::Result<Vec<u64>> {
    let text = page(addr)?;
    let executors = value(&text, "kvix_executors")
        .ok_or_else(|| anyhow::anyhow!("kvix_executors missing from the metrics at {addr}"))?;
    (0..executors)
        .map(|e| {
            let name = format!("kvix_executor_queries_total{{executor=\"{e}\"}}");
            value(&text, &name)
                .ok_or_else(|| anyhow::anyhow!("{name} missing from the metrics at {addr}"))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn values_are_read_with_or_without_labels() {
        let text = "# HELP x\nkvix_executors 2\nkvix_executor_queries_total{executor=\"0\"} 7\n\
                    kvix_executor_queries_total{executor=\"1\"} 9\n";
        assert_eq!(super::value(text, "kvix_executors"), Some(2));
        assert_eq!(
            super::value(text, "kvix_executor_queries_total{executor=\"1\"}"),
            Some(9)
        );
        assert_eq!(super::value(text, "kvix_executor"), None);
    }
}
