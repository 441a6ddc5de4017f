"""Tokenizes chat requests as an engine's OpenAI server does, for the kvix-scorer tests:
transformers' apply_chat_template with a real chat template (the word-level tokenizer of
examples/python_router: "w<id>" is token id <id>+4, role markers their own ids).

    chat_tokenizer.py           reads one JSON list of messages per line, prints their
                                token ids (generation prompt included) as a JSON list
    chat_tokenizer.py --http    serves vLLM's POST /tokenize on a free loopback port, as
                                a tokenizer sidecar: {"messages": [...]} answered with
                                {"count": N, "tokens": [...]}

Prints "ready" first ("ready PORT" with --http).
"""
import json
import os
import sys
import tempfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "..", "examples", "python_router"))

from run import make_tokenizer  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

directory = tempfile.mkdtemp(prefix="kvix-chat-tokenizer-")
make_tokenizer(directory)
tok = AutoTokenizer.from_pretrained(directory)


def token_ids(messages, add_generation_prompt=True):
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


class Tokenize(BaseHTTPRequestHandler):
    def do_POST(self):
        if self.path != "/tokenize":
            self.send_error(404)
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ids = token_ids(body["messages"], body.get("add_generation_prompt", True))
        out = json.dumps({"count": len(ids), "max_model_len": 1 << 20, "tokens": ids}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


if "--http" in sys.argv:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Tokenize)
    print("ready", server.server_address[1], flush=True)
    server.serve_forever()
else:
    print("ready", flush=True)
    for line in sys.stdin:
        print(json.dumps(token_ids(json.loads(line))), flush=True)
