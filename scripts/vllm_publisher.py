#!/usr/bin/env python3
"""A KV event publisher that writes exactly vLLM's ZMQ frames, for tests.

    python3 scripts/vllm_publisher.py SCENARIO.json

Binds a PUB socket and a ROUTER replay socket on 127.0.0.1 (ports from the scenario,
0 = any), prints `ports PUB REPLAY`, then plays the scenario's phases. Each message is
vLLM's three frames `[topic, seq as 8-byte big-endian, msgpack payload]`, the payload an
EventBatch `[ts, events, data_parallel_rank]` whose events are msgspec tagged structs:
in the "array" encoding tagged arrays with trailing defaults omitted, in the "map"
encoding maps with a "type" key (defaults omitted too), at both levels. Replay requests
are answered as vLLM's publisher does: every buffered (seq, payload) from the asked seq
on, then seq -1 with an empty payload.

Scenario: {"encoding": "array"|"map", "phases": [{"restart": bool, "messages": [
  {"dp_rank": int|null, "skip_pub": bool, "events": [EVENT, ...]}, ...]}]}
EVENT: {"type": "BlockStored"|"BlockRemoved"|"AllBlocksCleared", field: value, ...}
with hashes as ints or {"hex": "..."} (raw bytes), or {"type": ..., "malformed": true}
for an event that is not a valid struct. After each phase it prints `phase-done N` and
waits for a line on stdin (serving replays meanwhile); a restart closes both sockets
and binds new ones on the same ports with seq back to 0, like a restarted engine.
"""

import collections
import json
import select
import sys
import time

import msgpack
import zmq
from zmq.utils.monitor import recv_monitor_message

END_SEQ = (-1).to_bytes(8, "big", signed=True)

# Field order of vLLM's structs; the first `required` have no default.
STRUCTS = {
    "BlockStored": (
        [
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "lora_name",
            "extra_keys",
            "group_idx",
            "kv_cache_spec_kind",
            "kv_cache_spec_sliding_window",
        ],
        6,
    ),
    "BlockRemoved": (["block_hashes", "medium", "group_idx"], 1),
    "AllBlocksCleared": ([], 0),
}
DEFAULTS = {"group_idx": 0, "medium": None}


def value(v):
    if isinstance(v, dict) and "hex" in v:
        return bytes.fromhex(v["hex"])
    if isinstance(v, list):
        return [value(x) for x in v]
    return v


def encode_event(ev, mode):
    tag = ev["type"]
    if ev.get("malformed"):
        return [tag, "not-a-list"] if mode == "array" else {"type": tag, "block_hashes": "not-a-list"}
    fields, required = STRUCTS[tag]
    values = [value(ev.get(f, DEFAULTS.get(f))) for f in fields]
    if mode == "array":
        n = len(values)
        while n > required and values[n - 1] == DEFAULTS.get(fields[n - 1]):
            n -= 1
        return [tag] + values[:n]
    out = {"type": tag}
    for i, f in enumerate(fields):
        if i < required or values[i] != DEFAULTS.get(f):
            out[f] = values[i]
    return out


def encode_batch(msg, mode):
    events = [encode_event(e, mode) for e in msg["events"]]
    rank = msg.get("dp_rank")
    ts = time.time()
    if mode == "array":
        batch = [ts, events] + ([rank] if rank is not None else [])
    else:
        batch = {"ts": ts, "events": events}
        if rank is not None:
            batch["data_parallel_rank"] = rank
    return msgpack.packb(batch, use_bin_type=True)


class Publisher:
    def __init__(self, ctx, pub_port, replay_port):
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.monitor = self.pub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.replay = ctx.socket(zmq.ROUTER)
        self.replay.setsockopt(zmq.LINGER, 0)
        self.pub_port = self.bind(self.pub, pub_port)
        self.replay_port = self.bind(self.replay, replay_port)
        self.buffer = collections.deque(maxlen=10_000)
        self.seq = 0

    @staticmethod
    def bind(sock, port):
        if port:
            for _ in range(100):
                try:
                    sock.bind(f"tcp://127.0.0.1:{port}")
                    return port
                except zmq.ZMQError:
                    time.sleep(0.05)
            raise SystemExit(f"cannot rebind port {port}")
        return sock.bind_to_random_port("tcp://127.0.0.1")

    def wait_subscriber(self, timeout_s=60):
        """Until a SUB finished its handshake, then a moment for its subscription."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            self.serve_replay()
            if self.monitor.poll(50):
                recv_monitor_message(self.monitor)
                time.sleep(0.3)
                return
        raise SystemExit("no subscriber connected")

    def publish(self, payload, skip_pub=False):
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        if not skip_pub:
            self.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])

    def serve_replay(self):
        while self.replay.poll(0):
            frame = self.replay.recv_multipart()
            if len(frame) != 3:
                continue
            client, _, start = frame
            start = int.from_bytes(start, "big")
            for seq, buf in self.buffer:
                if seq >= start:
                    self.replay.send_multipart([client, b"", seq.to_bytes(8, "big"), buf])
            self.replay.send_multipart([client, b"", END_SEQ, b""])

    def close(self):
        self.pub.disable_monitor()
        self.monitor.close(0)
        self.pub.close(0)
        self.replay.close(0)


def wait_line(publisher):
    while True:
        publisher.serve_replay()
        ready, _, _ = select.select([sys.stdin], [], [], 0.02)
        if ready:
            return sys.stdin.readline()


def main():
    with open(sys.argv[1]) as f:
        scenario = json.load(f)
    mode = scenario.get("encoding", "array")
    ctx = zmq.Context()
    pub = Publisher(ctx, scenario.get("pub_port", 0), scenario.get("replay_port", 0))
    print(f"ports {pub.pub_port} {pub.replay_port}", flush=True)
    for n, phase in enumerate(scenario["phases"], 1):
        if phase.get("restart"):
            ports = (pub.pub_port, pub.replay_port)
            pub.close()
            pub = Publisher(ctx, *ports)
        if n == 1 or phase.get("restart"):
            pub.wait_subscriber()
        for msg in phase["messages"]:
            pub.publish(encode_batch(msg, mode), msg.get("skip_pub", False))
            for _ in range(2):
                pub.serve_replay()
                time.sleep(0.01)
        print(f"phase-done {n}", flush=True)
        if not wait_line(pub):
            break
    pub.close()
    ctx.term()


if __name__ == "__main__":
    main()
