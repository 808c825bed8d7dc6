"""A small OpenAI-style server for backend ``server``'s tests, run as a real subprocess:
``python image_server.py --port N [--model-file PATH] [--spawn-child]``.

- ``GET /health``: 200.
- ``POST /v1/images/generations``: one image per ``n`` (its bytes: the prompt, base64),
  the ``model`` it was sent as ``revised_prompt`` of the first, a ``usage``; with
  ``"stream": true``, Server-Sent Events (chunked): a partial image per ``n``, then the
  completed event with ``usage``. A prompt ``refuse`` answers 400 with OpenAI's error;
  a streamed prompt ``break`` ends the connection after its first event.
- ``POST /v1/rerank``: documents scored by the words they share with the query.
- ``POST /v1/audio/transcriptions``: a multipart form; answers the form's content type
  boundary check and the size of its ``file`` part as ``text``.
- ``GET /whoami``: the process ids and what it was started with (``--model-file``, the
  ``SERVER_TAG`` environment variable, the bearer token it last saw).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

STATE: dict[str, Any] = {"authorization": None}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        sys.stdout.write("image-server: " + format % args + "\n")
        sys.stdout.flush()

    def _json(self, status: int, payload: Any) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def do_GET(self) -> None:
        if self.path == "/health":
            self._json(200, {"status": "ok"})
        elif self.path == "/whoami":
            self._json(
                200,
                {
                    "pid": os.getpid(),
                    "children": STATE.get("children", []),
                    "model_file": STATE.get("model_file"),
                    "tag": os.environ.get("SERVER_TAG"),
                    "authorization": STATE["authorization"],
                },
            )
        else:
            self._json(404, {"error": {"message": f"no route {self.path}"}})

    def do_POST(self) -> None:
        STATE["authorization"] = self.headers.get("Authorization")
        raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        if self.path == "/v1/images/generations":
            self._images(json.loads(raw))
        elif self.path == "/v1/rerank":
            self._rerank(json.loads(raw))
        elif self.path == "/v1/audio/transcriptions":
            kind = self.headers.get("Content-Type", "")
            boundary = kind.partition("boundary=")[2].encode()
            parts = [p for p in raw.split(b"--" + boundary) if b'name="file"' in p]
            size = len(parts[0].split(b"\r\n\r\n", 1)[1].removesuffix(b"\r\n")) if parts else -1
            self._json(200, {"text": f"{kind.split(';')[0]} file of {size} bytes"})
        else:
            self._json(404, {"error": {"message": f"no route {self.path}"}})

    def _rerank(self, body: dict[str, Any]) -> None:
        # Scored by the words a document shares with the query (a toy, but a real reply).
        query = set(str(body["query"]).lower().split())
        scored = [
            {"index": i, "relevance_score": len(query & set(str(d).lower().split())) / len(query)}
            for i, d in enumerate(body["documents"])
        ]
        scored.sort(key=lambda item: -item["relevance_score"])
        words = sum(len(str(d).split()) for d in body["documents"]) + len(query)
        self._json(
            200, {"model": body.get("model"), "results": scored, "usage": {"total_tokens": words}}
        )

    def _images(self, body: dict[str, Any]) -> None:
        prompt = str(body.get("prompt", ""))
        if prompt == "refuse":
            self._json(400, {"error": {"message": "this prompt is refused", "type": "bad"}})
            return
        count = int(body.get("n") or 1)
        images = [
            {"b64_json": base64.b64encode(f"{prompt} #{i}".encode()).decode()} for i in range(count)
        ]
        images[0]["revised_prompt"] = f"{body.get('model')}: {prompt}"
        usage = {"input_tokens": len(prompt.split()), "output_tokens": 100 * count}
        if not body.get("stream"):
            self._json(200, {"created": int(time.time()), "data": images, "usage": usage})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for i, image in enumerate(images):
            event = {"type": "image_generation.partial_image", "partial_image_index": i, **image}
            self._chunk(b"data: " + json.dumps(event).encode() + b"\n\n")
            time.sleep(0.05)
            if prompt == "break":
                # Dies mid-stream: the connection closes without the stream's end.
                self.close_connection = True
                return
        done = {"type": "image_generation.completed", "usage": usage}
        self._chunk(b"data: " + json.dumps(done).encode() + b"\n\n")
        self._chunk(b"")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model-file")
    parser.add_argument("--spawn-child", action="store_true")
    args = parser.parse_args()
    STATE["model_file"] = args.model_file
    if args.spawn_child:
        # A grandchild in the server's process group: it must go with the server.
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
        STATE["children"] = [child.pid]
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    print(f"image-server: listening on {args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
