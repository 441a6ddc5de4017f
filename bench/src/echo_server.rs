//! `echo-server`: the transport's floor for `huge-writes`, in a process of its own. It
//! speaks just enough of the kvix protocol to stand in for a server: Hello gets a
//! Welcome, an Echo its payload, an Announce a worker id, any other request an answer of
//! its kind at once (an event batch `Applied`, without reading the blocks). A thread per
//! connection, blocking sockets: what moving the same frames costs with no index behind.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};

use anyhow::Context;
use kvix_wire::{
    encode, Ack, Announced, Applied, ApplyStatus, Echo, FrameReader, MessageRef, Welcome,
};

/// Serves on `listen` until the process is killed; prints "listening on ADDR".
pub fn serve(listen: &str, max_frame: u32) -> anyhow::Result<()> {
    let listener = TcpListener::bind(listen).with_context(|| format!("binding {listen}"))?;
    println!("listening on {}", listener.local_addr()?);
    for conn in listener.incoming() {
        let conn = conn?;
        std::thread::spawn(move || {
            if let Err(e) = connection(conn, max_frame) {
                eprintln!("echo-server: a connection ended: {e:#}");
            }
        });
    }
    Ok(())
}

fn connection(mut conn: TcpStream, max_frame: u32) -> anyhow::Result<()> {
    conn.set_nodelay(true)?;
    let mut frames = FrameReader::new(max_frame);
    loop {
        while let Some(f) = frames.next()? {
            let (id, len) = (f.header.request_id, f.len);
            let wants = f.header.wants_reply();
            let reply = match f.message()? {
                MessageRef::Hello(h) => Some(encode(
                    &Welcome {
                        server: "kvix-bench echo-server".into(),
                        token_block: h.token_block.to_native(),
                        byte_chunk: 256,
                        shards: 1,
                        max_frame,
                    },
                    id,
                    0,
                )?),
                MessageRef::Echo(e) => Some(encode(
                    &Echo {
                        payload: vec![0; e.reply_len.to_native() as usize],
                        reply_len: 0,
                    },
                    id,
                    0,
                )?),
                MessageRef::Announce(_) => Some(encode(
                    &Announced {
                        worker: 1,
                        created: true,
                    },
                    id,
                    0,
                )?),
                MessageRef::EventBatch(b) => Some(encode(
                    &Applied {
                        seq: b.seq.to_native(),
                        status: ApplyStatus::Applied,
                    },
                    id,
                    0,
                )?),
                _ => Some(encode(&Ack {}, id, 0)?),
            };
            frames.consume(len);
            if let (Some(r), true) = (reply, wants) {
                conn.write_all(&r)?;
            }
        }
        let n = conn.read(frames.spare())?;
        if n == 0 {
            return Ok(());
        }
        frames.filled(n);
    }
}
