"""Tokenizes chat requests as an engine's OpenAI server does, for the kvix-scorer tests:
transformers' apply_chat_template with a real chat template (the word-level tokenizer of
examples/python_router: "w<id>" is token id <id>+4, role markers their own ids).

Reads one JSON list of messages per line and prints their token ids, generation prompt
included, as one JSON list per line. Prints "ready" first.
"""
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "..", "examples", "python_router"))

from run import make_tokenizer  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

directory = tempfile.mkdtemp(prefix="kvix-chat-tokenizer-")
make_tokenizer(directory)
tok = AutoTokenizer.from_pretrained(directory)
print("ready", flush=True)
for line in sys.stdin:
    ids = tok.apply_chat_template(json.loads(line), tokenize=True, add_generation_prompt=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    print(json.dumps([int(i) for i in ids]), flush=True)
