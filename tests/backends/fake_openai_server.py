"""A tiny OpenAI-compatible server process for the process-supervision tests.

It is a real child process (so supervision is tested for real) that answers like
llama-server: ``/health``, ``/v1/models`` and streamed ``/v1/chat/completions``.
Usage: ``python fake_openai_server.py -m MODEL --host H --port P [--mode M] [--spawn-child]``.
Modes: ``ok``; ``never-ready`` (health stays 503); ``slow`` (tokens every 0.2 s);
``paced`` (every 0.05 s). As vLLM's server it also answers ``/tokenize`` and
``/v1/completions`` with token ids, how a paused stream resumes.
``--spawn-child`` starts a sleeping grandchild, to show the whole group is stopped.
The startup line names the server's pid and the grandchild's.
"""

import argparse
import http.server
import json
import os
import re
import subprocess
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("-m", dest="model")
parser.add_argument("--host", default="127.0.0.1")
parser.add_argument("--port", type=int)
parser.add_argument("--mode", default="ok")
parser.add_argument("--spawn-child", action="store_true")
args, _unknown = parser.parse_known_args()

# The reply every generation streams (a greedy model's), and the ids a chat tokenizes to.
REPLY = ["one", " two", " three", " four", " five"] * 8
HEAD = (9000, 9001, 9002)

grandchild = ""
if args.spawn_child:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    grandchild = f" grandchild {child.pid}"


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _json(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            self._json(503 if args.mode == "never-ready" else 200, {"status": "ok"})
        elif self.path == "/v1/models":
            self._json(200, {"data": [{"id": "fake"}]})
        else:
            self._json(404, {"error": {"message": "no such route"}})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/tokenize":
            self._tokenize(body)
            return
        if self.path == "/v1/completions":
            self._complete(body)
            return
        # One line per request, traced or not (the pool's log shows it): a test finds the
        # line of its request by the request's last message, and reads its trace.
        last = json.dumps((body.get("messages") or [{}])[-1].get("content"))
        trace = self.headers.get("traceparent", "-")
        sys.stdout.write(f"request {last} with traceparent {trace}\n")
        sys.stdout.flush()
        words = REPLY[: body.get("max_tokens", 16)]
        self._stream(words, "delta")

    def _tokenize(self, body):
        """vLLM's /tokenize: a chat (``messages``) is three marker ids (HEAD); a text
        is one id per word of REPLY (its index), as the reply was streamed."""
        sys.stdout.write(f"tokenize {json.dumps(body, sort_keys=True)}\n")
        sys.stdout.flush()
        if "messages" in body:
            tokens = list(HEAD)
        else:
            pieces = re.findall(r" ?\S+", body["prompt"])
            tokens = [REPLY.index(piece, n) for n, piece in enumerate(pieces)]
        self._json(200, {"count": len(tokens), "max_model_len": 4096, "tokens": tokens})

    def _complete(self, body):
        """/v1/completions with token ids: the chat's marker ids, then the ids of the
        reply so far; continues REPLY after them (what a greedy model would do)."""
        sys.stdout.write(f"completions {json.dumps(body, sort_keys=True)}\n")
        sys.stdout.flush()
        prompt = body["prompt"]
        assert prompt[: len(HEAD)] == list(HEAD) and all(isinstance(t, int) for t in prompt)
        made = len(prompt) - len(HEAD)
        self._stream(REPLY[made : made + body.get("max_tokens", 16)], "text")

    def _stream(self, words, field):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for word in words:
            piece = {"delta": {"content": word}} if field == "delta" else {"text": word}
            chunk = {"choices": [{"index": 0, **piece, "finish_reason": None}]}
            self._chunk(f"data: {json.dumps(chunk)}\n\n")
            if args.mode == "slow":
                time.sleep(0.2)
            elif args.mode == "paced":
                time.sleep(0.05)
        end = {"delta": {}} if field == "delta" else {"text": ""}
        done = {
            "choices": [{"index": 0, **end, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": len(words)},
        }
        self._chunk(f"data: {json.dumps(done)}\n\n")
        self._chunk("data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")

    def _chunk(self, text):
        data = text.encode()
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def log_message(self, *a):
        sys.stdout.write("request " + (a[0] % a[1:]) + "\n")
        sys.stdout.flush()


# One line naming both processes, so a test can find them in an error's output tail.
print(f"fake server for {args.model} on {args.port}: pid {os.getpid()}{grandchild}", flush=True)
http.server.ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()
