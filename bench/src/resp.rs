//! A minimal RESP2 client for Redis (enough for HSET / HKEYS / DEL / FLUSHDB / PING),
//! pipelined: write many commands, then read as many replies.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{bail, Context};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

/// A RESP reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    Simple(String),
    Error(String),
    Int(i64),
    Bulk(Option<Vec<u8>>),
    Array(Option<Vec<Reply>>),
}

/// Appends one command in RESP array form.
pub fn command(out: &mut Vec<u8>, args: &[&[u8]]) {
    out.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
    for a in args {
        out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        out.extend_from_slice(a);
        out.extend_from_slice(b"\r\n");
    }
}

/// One Redis connection.
pub struct Redis {
    r: BufReader<OwnedReadHalf>,
    w: OwnedWriteHalf,
    line: Vec<u8>,
}

impl Redis {
    pub async fn connect(addr: SocketAddr) -> anyhow::Result<Redis> {
        let s = tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(addr))
            .await
            .context("redis connect timed out")?
            .with_context(|| format!("connecting to redis at {addr} (scripts/redis.sh start)"))?;
        s.set_nodelay(true)?;
        let (r, w) = s.into_split();
        Ok(Redis {
            r: BufReader::with_capacity(1 << 16, r),
            w,
            line: Vec::new(),
        })
    }

    /// Writes pre-encoded commands and reads `n` replies into `out`.
    pub async fn pipeline(
        &mut self,
        cmds: &[u8],
        n: usize,
        out: &mut Vec<Reply>,
    ) -> anyhow::Result<()> {
        self.w.write_all(cmds).await?;
        out.clear();
        for _ in 0..n {
            let r = self.read().await?;
            out.push(r);
        }
        Ok(())
    }

    async fn read_line(&mut self) -> anyhow::Result<()> {
        self.line.clear();
        let n = self.r.read_until(b'\n', &mut self.line).await?;
        if n < 2 || !self.line.ends_with(b"\r\n") {
            bail!("redis: connection closed or malformed line");
        }
        self.line.truncate(self.line.len() - 2);
        Ok(())
    }

    fn read(
        &mut self,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = anyhow::Result<Reply>> + Send + '_>>
    {
        Box::pin(async move {
            self.read_line().await?;
            let tag = *self.line.first().context("redis: empty line")?;
            let rest = String::from_utf8_lossy(&self.line[1..]).into_owned();
            Ok(match tag {
                b'+' => Reply::Simple(rest),
                b'-' => Reply::Error(rest),
                b':' => Reply::Int(rest.parse()?),
                b'$' => {
                    let n: i64 = rest.parse()?;
                    if n < 0 {
                        Reply::Bulk(None)
                    } else {
                        let mut b = vec![0u8; n as usize + 2];
                        self.r.read_exact(&mut b).await?;
                        b.truncate(n as usize);
                        Reply::Bulk(Some(b))
                    }
                }
                b'*' => {
                    let n: i64 = rest.parse()?;
                    if n < 0 {
                        Reply::Array(None)
                    } else {
                        let mut v = Vec::with_capacity(n as usize);
                        for _ in 0..n {
                            v.push(self.read().await?);
                        }
                        Reply::Array(Some(v))
                    }
                }
                other => bail!("redis: unknown reply tag {:?}", other as char),
            })
        })
    }
}

/// llm-d style scoring over pipelined HKEYS replies (one per block, in chain order):
/// each worker's longest run of blocks from block 0. Returns (worker name, blocks), best
/// first, ties by name.
pub fn longest_prefixes(replies: &[Reply]) -> Vec<(Vec<u8>, u32)> {
    let mut alive: Vec<Vec<u8>> = Vec::new();
    let mut out: Vec<(Vec<u8>, u32)> = Vec::new();
    for (i, r) in replies.iter().enumerate() {
        let keys: Vec<&Vec<u8>> = match r {
            Reply::Array(Some(v)) => v
                .iter()
                .filter_map(|x| match x {
                    Reply::Bulk(Some(b)) => Some(b),
                    _ => None,
                })
                .collect(),
            _ => Vec::new(),
        };
        if i == 0 {
            alive = keys.into_iter().cloned().collect();
        } else {
            let (keep, gone): (Vec<Vec<u8>>, Vec<Vec<u8>>) =
                alive.drain(..).partition(|w| keys.contains(&w));
            out.extend(gone.into_iter().map(|w| (w, i as u32)));
            alive = keep;
        }
        if alive.is_empty() {
            break;
        }
    }
    let n = replies.len() as u32;
    out.extend(alive.into_iter().map(|w| (w, n)));
    out.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(names: &[&str]) -> Reply {
        Reply::Array(Some(
            names
                .iter()
                .map(|n| Reply::Bulk(Some(n.as_bytes().to_vec())))
                .collect(),
        ))
    }

    #[test]
    fn longest_prefix_per_worker_from_block_zero() {
        let r = vec![
            keys(&["a", "b", "c"]),
            keys(&["a", "b"]),
            keys(&["a", "c"]),
            keys(&["a"]),
        ];
        let s = longest_prefixes(&r);
        assert_eq!(
            s,
            vec![(b"a".to_vec(), 4), (b"b".to_vec(), 2), (b"c".to_vec(), 1)]
        );
        // c reappearing at block 2 after missing block 1 does not extend its run.
        let r = vec![keys(&["c"]), keys(&[]), keys(&["c"])];
        assert_eq!(longest_prefixes(&r), vec![(b"c".to_vec(), 1)]);
        assert!(longest_prefixes(&[keys(&[])]).is_empty());
    }

    #[test]
    fn commands_are_resp_arrays() {
        let mut b = Vec::new();
        command(&mut b, &[b"HKEYS", b"kvix:1"]);
        assert_eq!(b, b"*2\r\n$5\r\nHKEYS\r\n$6\r\nkvix:1\r\n");
    }
}
