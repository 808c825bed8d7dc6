"""file:// images: only under service.media_dirs, symlinks resolved, nothing outside."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest

from pool.config import build_settings
from pool.errors import PoolError
from pool.media import MediaLoader

from .helpers import PNG


def _loader(*dirs: Path, **service: object) -> MediaLoader:
    settings = build_settings({"service": {"media_dirs": [str(d) for d in dirs], **service}})
    return MediaLoader(settings.service)


async def _reason(loader: MediaLoader, url: str) -> str:
    with pytest.raises(PoolError) as info:
        await loader.inline([url])
    assert info.value.code == "image_refused"
    return str(info.value.details["reason"])


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    media = tmp_path / "media"
    (media / "cats").mkdir(parents=True)
    (media / "cats" / "tom cat.png").write_bytes(PNG)
    (media / "notes.txt").write_text("not an image")
    (tmp_path / "secret.png").write_bytes(PNG)
    (media / "escape.png").symlink_to(tmp_path / "secret.png")
    (media / "inside.png").symlink_to(media / "cats" / "tom cat.png")
    (media / "big.png").write_bytes(PNG + bytes(2000))
    return tmp_path


async def test_a_file_under_a_media_dir_is_inlined(tree: Path) -> None:
    loader = _loader(tree / "media")
    path = tree / "media" / "cats" / "tom cat.png"
    expected = "data:image/png;base64," + base64.b64encode(PNG).decode()
    assert await loader.inline([path.as_uri()]) == [expected]
    assert await loader.inline(["file://localhost" + path.as_uri()[7:]]) == [expected]
    # A link that stays inside the folder is fine.
    assert await loader.inline([(tree / "media" / "inside.png").as_uri()]) == [expected]


async def test_files_are_off_by_default(tree: Path) -> None:
    loader = _loader()
    url = (tree / "media" / "cats" / "tom cat.png").as_uri()
    assert await _reason(loader, url) == "file_not_allowed"


async def test_nothing_outside_the_media_dirs(tree: Path) -> None:
    loader = _loader(tree / "media")
    media = tree / "media"
    for url in (
        (tree / "secret.png").as_uri(),
        (media / "escape.png").as_uri(),  # a symlink out of the folder
        f"file://{media}/../secret.png",
        f"file://{media}/%2e%2e/secret.png",
        "file:///etc/passwd",
        "file:///etc/no-such-file",  # existence outside is never revealed
        f"file://{media}",  # the folder itself
        f"file://{tree}/media-evil/x.png",  # a sibling whose name starts alike
    ):
        assert await _reason(loader, url) == "file_not_allowed", url
    assert await _reason(loader, f"file://{media}/missing.png") == "file_unreadable"
    assert await _reason(loader, f"file://{media}/notes.txt") == "unsupported_type"
    assert await _reason(loader, f"file://other-host{media}/cats/x.png") == "invalid_url"


async def test_size_cap(tree: Path) -> None:
    loader = _loader(tree / "media", media_max_bytes=1000)
    assert await _reason(loader, (tree / "media" / "big.png").as_uri()) == "too_large"
    assert await loader.inline([(tree / "media" / "inside.png").as_uri()])


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
async def test_a_fifo_does_not_hang(tree: Path) -> None:
    fifo = tree / "media" / "pipe.png"
    os.mkfifo(fifo)
    assert await _reason(_loader(tree / "media"), fifo.as_uri()) == "file_not_allowed"
