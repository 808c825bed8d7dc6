"""Sources: what a pull fetches, as a list of files with the digests they must match.

A source (``ModelDefinition.source``, or the ``source`` argument of a pull) is one of:

* a local file or folder: ``/abs/path``, ``./rel``, ``../rel``, ``~/path`` or
  ``pkg://package/file`` (relative paths start at the settings file's folder);
* an ``http://`` or ``https://`` URL naming one file;
* a Hugging Face repo id, ``owner/name[@revision][:path/in/repo]``. Without a file, a
  repo with one ``.gguf`` pulls that file and a repo without any pulls every file
  (dotfiles aside); several ``.gguf`` files must be told apart with ``:file``. The
  endpoint is ``service.hf_endpoint``, else ``$HF_ENDPOINT``, else the public hub; the
  files then travel through the same HTTP path as URLs (same progress, resume and
  checks), with the hub's own headers (its token, if one is configured:
  :func:`hub_token`).

Resolving a source lists and stats files (and asks the hub): callers run
:meth:`Sources.files` in a worker thread.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pool.config import resolve_model_path
from pool.errors import PoolError
from pool.pulls._store import ModelStore, safe_name, safe_relative

HUGGINGFACE_API_KEY_ENV = "HUGGINGFACE_API_KEY"

SourceKind = Literal["path", "url", "hf"]

HUB_ENDPOINT = "https://huggingface.co"
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_HF_SOURCE = re.compile(
    r"(?P<repo>[A-Za-z0-9][\w.\-]{0,95}/[A-Za-z0-9][\w.\-]{0,95})"
    r"(?:@(?P<revision>[\w.\-/]{1,128}))?"
    r"(?::(?P<file>[\w.\-/]{1,512}))?",
    re.ASCII,
)


def classify_source(source: str) -> SourceKind:
    """What kind of source ``source`` is, after checking its shape.

    An HTTP route that accepts sources from clients should refuse ``"path"`` ones
    unless its operator allows clients to copy local files into the store.

    Raises:
        PoolError: ``invalid_request`` for anything that is not a local path, an
            http(s) URL naming a file, or a Hugging Face repo id.
    """
    if not isinstance(source, str) or not source or "\x00" in source:
        raise PoolError("invalid_request", f"source {source!r} is empty or holds a NUL byte")
    if source.lower().startswith(("http://", "https://")):
        url_file_name(source)
        return "url"
    if source.startswith(("pkg://", "/", "./", "../", "~")):
        return "path"
    match = _HF_SOURCE.fullmatch(source)
    if match is not None and ".." not in (match["repo"] + (match["revision"] or "")):
        if match["file"]:
            safe_relative(match["file"], "file in the repository")
        return "hf"
    raise PoolError(
        "invalid_request",
        f"source {source!r}: use an http(s) URL, a local path (/abs, ./rel, ~/..., pkg://)"
        " or a Hugging Face repo id (owner/name[@revision][:file])",
    )


def url_file_name(url: str) -> str:
    """The file name an http(s) URL names (its last path segment, decoded and checked).

    Raises:
        PoolError: ``invalid_request`` for a malformed URL or an unsafe name.
    """
    if "\\" in url or any(ord(c) <= 0x20 or ord(c) == 0x7F for c in url):
        raise PoolError("invalid_request", f"URL {url!r} holds a backslash or a control character")
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises for a malformed port
    except ValueError as exc:
        raise PoolError("invalid_request", f"URL {url!r} is malformed: {exc}") from None
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise PoolError("invalid_request", f"URL {url!r} must be http(s) with a host")
    name = urllib.parse.unquote(parts.path.rsplit("/", 1)[-1])
    if not name:
        raise PoolError("invalid_request", f"URL {url!r} does not end in a file name")
    return safe_name(name, "file name")


def shown_url(url: str) -> str:
    """``url`` as messages and logs may show it."""
    # Query strings may carry signatures or tokens: keep them out of messages and logs.
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))


def hub_endpoint(configured: str | None) -> str:
    """The Hugging Face endpoint: ``configured``, else ``$HF_ENDPOINT``, else the hub."""
    return (configured or os.environ.get("HF_ENDPOINT") or HUB_ENDPOINT).rstrip("/")


def normal_sha256(value: str) -> str:
    """A caller's SHA-256 (hex, optionally ``sha256:``-prefixed) as lower-case hex.

    Raises:
        PoolError: ``invalid_request`` when it is not 64 hex digits.
    """
    digest = value.strip().lower().removeprefix("sha256:")
    if not SHA256_HEX.fullmatch(digest):
        raise PoolError("invalid_request", f"sha256 {value!r} is not 64 hex digits")
    return digest


def sidecar_digest(text: str) -> str | None:
    """The SHA-256 a ``.sha256`` file states: its first word (``sha256sum`` output)."""
    words = text.split()
    digest = words[0].lower() if words else ""
    return digest if SHA256_HEX.fullmatch(digest) else None


@dataclass
class PullFile:
    """One file of a pull: where it comes from and what it must hash to.

    The download fills in ``size`` (where the source did not state it), ``digest``
    (what the bytes hashed to) and ``validator`` (what ``If-Range`` quotes on resume).
    """

    name: str
    size: int | None = None
    url: str | None = None
    local: Path | None = None
    headers: dict[str, str] = field(default_factory=dict)
    expected: str | None = None
    expected_from: str | None = None
    sidecar: bool = False
    digest: str | None = None
    validator: str | None = None

    def expect(self, digest: str | None, origin: str) -> None:
        """Take ``digest`` as the one to match, unless an earlier origin stated one."""
        if self.expected is None and digest is not None:
            self.expected, self.expected_from = digest, origin


class Sources:
    """Turns a source into the files a pull fetches.

    Args:
        store: the model store; a local source inside it is refused.
        base_dir: the settings file's folder, where relative local paths start.
        endpoint: the Hugging Face endpoint for repo ids.
    """

    def __init__(self, store: ModelStore, *, base_dir: str | None, endpoint: str) -> None:
        self._store = store
        self._base_dir = base_dir
        self.endpoint = endpoint

    def files(self, source: str, sha256: str | None = None) -> list[PullFile]:
        """The files of ``source``; blocking (run it in a worker thread).

        Args:
            source: any source :func:`classify_source` accepts.
            sha256: the caller's expected digest (normalised hex) of a single-file
                source; it takes precedence over what the source states.

        Raises:
            PoolError: ``invalid_request`` for a source that cannot be listed, holds
                nothing to pull, or has several files when ``sha256`` is given.
        """
        kind = classify_source(source)
        if kind == "url":
            files = [PullFile(url_file_name(source), url=source, sidecar=True)]
        elif kind == "path":
            files = self._local_files(source)
        else:
            files = self._hub_files(source)
        if sha256 is not None:
            if len(files) != 1:
                raise PoolError(
                    "invalid_request", f"sha256 fits a single file; {source!r} has {len(files)}"
                )
            files[0].expected, files[0].expected_from = sha256, "the caller"
        return files

    def _local_files(self, source: str) -> list[PullFile]:
        try:
            root = resolve_model_path(source, self._base_dir).resolve(strict=True)
        except (OSError, RuntimeError) as exc:
            raise PoolError("invalid_request", f"source {source!r} does not exist: {exc}") from None
        if self._store.contains(root):
            raise PoolError("invalid_request", f"source {source!r} is inside the model store")
        if root.is_file():
            file = PullFile(safe_name(root.name, "file name"), root.stat().st_size, local=root)
            sidecar = root.with_name(root.name + ".sha256")
            if sidecar.is_file():
                file.expect(sidecar_digest(sidecar.read_text(errors="replace")), sidecar.name)
            return [file]
        if not root.is_dir():
            raise PoolError("invalid_request", f"source {source!r} is not a file or a folder")
        files = []
        for path in sorted(root.rglob("*")):
            relative = path.relative_to(root).as_posix()
            if path.is_file() and not _dotfile(relative):
                files.append(PullFile(safe_relative(relative), path.stat().st_size, local=path))
        if not files:
            raise PoolError("invalid_request", f"source {source!r} holds no files")
        return files

    def _hub_files(self, source: str) -> list[PullFile]:
        try:
            from huggingface_hub import HfApi, hf_hub_url
            from huggingface_hub.hf_api import RepoFile
        except ImportError:
            raise PoolError(
                "invalid_request",
                "Hugging Face sources need huggingface_hub: pip install 'llm-pool[pull]'",
            ) from None
        match = _HF_SOURCE.fullmatch(source)
        assert match is not None  # classify_source said "hf"
        repo, revision, wanted = match["repo"], match["revision"], match["file"]
        try:
            token = hub_token()
            tree = HfApi(endpoint=self.endpoint, token=token).list_repo_tree(
                repo, recursive=True, revision=revision
            )
            entries = [e for e in tree if isinstance(e, RepoFile)]
            headers = {"Authorization": f"Bearer {token}"} if token else {}
        except Exception as exc:  # noqa: BLE001 - the hub client raises many kinds
            raise PoolError(
                "invalid_request", f"cannot list {repo} on {self.endpoint}: {exc}"
            ) from None
        if wanted:
            entries = [e for e in entries if e.path == wanted]
            if not entries:
                raise PoolError("invalid_request", f"{repo} has no file {wanted!r}")
        else:
            entries = [e for e in entries if not _dotfile(e.path)]
            ggufs = [e for e in entries if e.path.endswith(".gguf")]
            if len(ggufs) > 1:
                names = ", ".join(e.path for e in ggufs[:8])
                raise PoolError(
                    "invalid_request",
                    f"{repo} holds several GGUF files ({names}); pull one as {repo}:<file>",
                )
            entries = ggufs or entries
        if not entries:
            raise PoolError("invalid_request", f"{repo} holds no files to pull")
        return [
            PullFile(
                safe_relative(e.path, "file name from the hub"),
                e.size,
                url=hf_hub_url(repo, e.path, revision=revision, endpoint=self.endpoint),
                headers=headers,
                expected=e.lfs.sha256.lower() if e.lfs is not None else None,
                expected_from="the hub's LFS record" if e.lfs is not None else None,
            )
            for e in entries
        ]


def hub_token() -> str | None:
    """The Hugging Face token: huggingface_hub's (``$HF_TOKEN``,
    ``$HUGGING_FACE_HUB_TOKEN``, then a saved login), else ``$HUGGINGFACE_API_KEY``,
    the embedded-engine spec's other name for it."""
    from huggingface_hub import get_token

    return get_token() or os.environ.get(HUGGINGFACE_API_KEY_ENV, "").strip() or None


def _dotfile(relative: str) -> bool:
    """Repository metadata (``.gitattributes``, ``.cache/``); ``..`` is no dotfile."""
    return any(p.startswith(".") and p not in (".", "..") for p in relative.split("/"))
