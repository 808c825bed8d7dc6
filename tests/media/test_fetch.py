"""http(s) images: off by default, public addresses only, every redirect checked."""

from __future__ import annotations

import base64

import pytest
import trio

from pool.config import build_settings
from pool.errors import PoolError
from pool.media import MediaLoader

from .helpers import PNG, LoopbackInternet, Route, TinyHttpServer, resolver_of

PUBLIC = "93.184.215.14"
OTHER_PUBLIC = "151.101.1.1"
NAMES = {
    "images.example": [PUBLIC],
    "cdn.example": [OTHER_PUBLIC],
    "intranet.example": ["10.0.0.7"],
    "metadata.example": ["169.254.169.254"],
    "rebind.example": ["127.0.0.1"],
}
INLINE_PNG = "data:image/png;base64," + base64.b64encode(PNG).decode()


def _loader(
    internet: LoopbackInternet | None = None, fetch: bool = True, **service: object
) -> MediaLoader:
    settings = build_settings({"service": {"media_fetch": fetch, **service}})
    return MediaLoader(settings.service, resolver=resolver_of(NAMES), network=internet)


async def _reason(loader: MediaLoader, url: str) -> str:
    with pytest.raises(PoolError) as info:
        await loader.inline([url])
    assert (info.value.code, info.value.status) == ("image_refused", 400)
    return str(info.value.details["reason"])


async def _serve(nursery: trio.Nursery, routes: dict[str, Route]) -> TinyHttpServer:
    server: TinyHttpServer = await nursery.start(TinyHttpServer(routes).run)
    return server


async def test_loopback_urls_are_refused_by_default(nursery: trio.Nursery) -> None:
    server = await _serve(nursery, {"/cat.png": Route()})
    url = f"http://127.0.0.1:{server.port}/cat.png"
    # The default settings: the pool fetches nothing at all.
    default = MediaLoader(build_settings({}).service)
    assert await _reason(default, url) == "fetch_disabled"
    # With fetching on, loopback is still refused, by address and by name.
    fetching = MediaLoader(build_settings({"service": {"media_fetch": True}}).service)
    assert await _reason(fetching, url) == "address_not_allowed"
    assert await _reason(fetching, f"http://localhost:{server.port}/cat.png") == (
        "address_not_allowed"
    )
    assert await _reason(fetching, f"http://[::1]:{server.port}/cat.png") == "address_not_allowed"
    assert server.seen == []


async def test_names_resolving_to_private_addresses_are_refused() -> None:
    internet = LoopbackInternet({})
    loader = _loader(internet)
    for host in ("intranet.example", "metadata.example", "rebind.example"):
        assert await _reason(loader, f"http://{host}/x.png") == "address_not_allowed", host
    assert internet.dialled == []


async def test_a_public_image_is_fetched_and_inlined(nursery: trio.Nursery) -> None:
    server = await _serve(nursery, {"/cat.png": Route()})
    internet = LoopbackInternet({(PUBLIC, 80): server})
    loader = _loader(internet)
    assert await loader.inline(["http://images.example/cat.png"]) == [INLINE_PNG]
    # Dialled by the checked address, asked by name.
    assert internet.dialled == [(PUBLIC, 80)]
    assert [(s.path, s.host) for s in server.seen] == [("/cat.png", "images.example")]


async def test_redirects_are_checked_at_every_hop(nursery: trio.Nursery) -> None:
    cdn = await _serve(nursery, {"/real.png": Route()})
    origin = await _serve(
        nursery,
        {
            "/to-cdn": Route(302, b"", {"Location": "http://cdn.example/real.png"}),
            "/relative": Route(301, b"", {"Location": "/to-cdn"}),
            "/to-intranet": Route(302, b"", {"Location": "http://intranet.example/admin"}),
            "/to-loopback": Route(307, b"", {"Location": "http://127.0.0.1:8011/v1/admin"}),
            "/to-metadata": Route(308, b"", {"Location": "http://metadata.example/latest"}),
            "/to-file": Route(302, b"", {"Location": "file:///etc/passwd"}),
            "/loop": Route(302, b"", {"Location": "/loop"}),
            "/nowhere": Route(302, b""),
        },
    )
    internet = LoopbackInternet({(PUBLIC, 80): origin, (OTHER_PUBLIC, 80): cdn})
    loader = _loader(internet)
    assert await loader.inline(["http://images.example/relative"]) == [INLINE_PNG]
    assert internet.dialled == [(PUBLIC, 80), (PUBLIC, 80), (OTHER_PUBLIC, 80)]

    for path in ("/to-intranet", "/to-loopback", "/to-metadata"):
        internet.dialled.clear()
        assert await _reason(loader, f"http://images.example{path}") == "address_not_allowed"
        assert internet.dialled == [(PUBLIC, 80)], path  # the refused hop is never dialled
    assert await _reason(loader, "http://images.example/to-file") == "scheme_not_allowed"
    assert await _reason(loader, "http://images.example/loop") == "too_many_redirects"
    assert await _reason(loader, "http://images.example/nowhere") == "fetch_failed"
    no_redirects = _loader(internet, media_max_redirects=0)
    assert await _reason(no_redirects, "http://images.example/to-cdn") == "too_many_redirects"


async def test_answers_that_are_not_images(nursery: trio.Nursery) -> None:
    server = await _serve(
        nursery,
        {
            "/page": Route(200, b"<html>hello</html>", {"Content-Type": "image/png"}),
            "/big.png": Route(200, PNG + bytes(5000)),
            "/gone.png": Route(404, b"gone"),
        },
    )
    loader = _loader(LoopbackInternet({(PUBLIC, 80): server}), media_max_bytes=2000)
    assert await _reason(loader, "http://images.example/page") == "unsupported_type"
    assert await _reason(loader, "http://images.example/big.png") == "too_large"
    assert await _reason(loader, "http://images.example/gone.png") == "fetch_failed"
    assert await _reason(loader, "http://unknown.example/x.png") == "fetch_failed"
    assert await _reason(loader, "http://cdn.example/x.png") == "fetch_failed"  # no server
    for url in ("http://user:pw@images.example/x.png", "http:///x.png", "http://ü.example/x"):
        assert await _reason(loader, url) == "invalid_url", url
    for url in ("ftp://images.example/x.png", "gopher://x", "/etc/passwd", "cat.png"):
        assert await _reason(loader, url) == "scheme_not_allowed", url


async def test_the_fetch_time_is_capped(nursery: trio.Nursery, autojump_clock: object) -> None:
    server = await _serve(nursery, {"/slow.png": Route(delay_s=60)})
    loader = _loader(LoopbackInternet({(PUBLIC, 80): server}), media_fetch_timeout_s=5)
    started = trio.current_time()
    assert await _reason(loader, "http://images.example/slow.png") == "fetch_timeout"
    assert 5 <= trio.current_time() - started < 6


async def test_too_many_images() -> None:
    loader = _loader(media_max_images=2)
    assert await loader.inline([INLINE_PNG] * 2) == [INLINE_PNG] * 2
    with pytest.raises(PoolError) as info:
        await loader.inline([INLINE_PNG] * 3)
    assert info.value.details["reason"] == "too_many_images"
