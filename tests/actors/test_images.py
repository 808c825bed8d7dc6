"""Pool.admit applies the media policy once, after the capability checks, before queueing."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
import trio

from pool import InferenceRequest, PoolError, open_pool
from pool.backends import ImagePart, TextPart, Turn
from pool.config import Settings, build_settings
from pool.media import MediaLoader
from tests.media.helpers import PNG, PNG_URL, LoopbackInternet, Route, TinyHttpServer, resolver_of


def _settings(**service: object) -> Settings:
    return build_settings(
        {
            "service": service,
            "engine": {
                "models": {
                    "vision": {"backend": "stub", "enabled": True, "modalities": ["text", "image"]},
                    "text": {"backend": "stub", "enabled": True},
                }
            },
        }
    )


def _with_images(model: str, *urls: str) -> InferenceRequest:
    parts = (TextPart("what is it?"), *(ImagePart(u, "low") for u in urls))
    return InferenceRequest(model, (Turn("user", parts),))


async def test_data_urls_pass_unchanged() -> None:
    async with open_pool(_settings()) as pool:
        request = _with_images("vision", PNG_URL)
        async with pool.admit(request) as admission:
            assert admission.ticket.request.turns == request.turns
            assert (await admission.collect()).text == "what is it?"


async def test_files_reach_the_backend_inline(tmp_path: Path) -> None:
    (tmp_path / "cat.png").write_bytes(PNG)
    settings = _settings(media_dirs=[str(tmp_path)])
    async with open_pool(settings) as pool:
        request = _with_images("vision", (tmp_path / "cat.png").as_uri(), PNG_URL)
        async with pool.admit(request) as admission:
            parts = admission.ticket.request.turns[0].parts
            assert parts[0] == TextPart("what is it?")
            assert parts[1] == ImagePart(
                "data:image/png;base64," + base64.b64encode(PNG).decode(), "low"
            )
            assert parts[2] == ImagePart(PNG_URL, "low")
            await admission.collect()


async def test_a_refused_image_is_never_queued(nursery: trio.Nursery) -> None:
    server: TinyHttpServer = await nursery.start(TinyHttpServer({"/x.png": Route()}).run)
    async with open_pool(_settings(media_fetch=True)) as pool:
        for url, reason in [
            (f"http://127.0.0.1:{server.port}/x.png", "address_not_allowed"),
            ("file:///etc/passwd", "file_not_allowed"),
            ("data:image/png;base64,!!", "invalid_data_url"),
        ]:
            with pytest.raises(PoolError) as info:
                await pool.respond(_with_images("vision", url))
            assert info.value.code == "image_refused"
            assert info.value.details["reason"] == reason
        assert pool.model("vision").scheduler.queue_depth == 0
        assert (
            pool.snapshot("vision").requests_total == 0
            if hasattr(pool.snapshot("vision"), "requests_total")
            else True
        )
        # The capability check comes first: a text model never fetches anything.
        with pytest.raises(PoolError) as info:
            await pool.respond(_with_images("text", f"http://127.0.0.1:{server.port}/x.png"))
        assert info.value.code == "modality_unsupported"
        assert server.seen == []
        # The pool keeps serving.
        assert (await pool.respond(_with_images("vision", PNG_URL))).text == "what is it?"


async def test_embedded_use_gets_an_injected_loader(nursery: trio.Nursery) -> None:
    server: TinyHttpServer = await nursery.start(TinyHttpServer({"/cat.png": Route()}).run)
    settings = _settings(media_fetch=True)
    internet = LoopbackInternet({("93.184.215.14", 80): server})
    media = MediaLoader(
        settings.service,
        resolver=resolver_of({"images.example": ["93.184.215.14"]}),
        network=internet,
    )
    async with open_pool(settings, media=media) as pool:
        request = _with_images("vision", "http://images.example/cat.png")
        async with pool.admit(request) as admission:
            image = admission.ticket.request.turns[0].parts[1]
            assert isinstance(image, ImagePart) and image.url.startswith("data:image/png;base64,")
            await admission.collect()
        assert internet.dialled == [("93.184.215.14", 80)]
