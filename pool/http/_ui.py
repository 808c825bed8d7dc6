"""The dashboard at ``/ui/``: one HTML page, one script, one stylesheet.

They ship in the package (``pool/http/ui/``, package data) and are served as they are:
no build step, no CDN, nothing fetched from elsewhere. The page itself carries no data
and needs no token; everything it shows comes from the admin API, called by the script
with the operator's token (``Authorization``), and so is guarded as the API is. The
script uses relative URLs, so the page also works behind a proxy that adds a path prefix.
"""

from __future__ import annotations

from importlib import resources

from quart import Blueprint, Quart, Response, redirect

from pool.http._common import AppContext

_TYPES = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "app.css": "text/css; charset=utf-8",
}
# Only the page's own script, style and API calls; no inline code, no framing.
_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self';"
    " img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def _asset(name: str) -> bytes:
    return resources.files("pool.http").joinpath("ui", name).read_bytes()


def register(app: Quart, ctx: AppContext) -> None:
    assets = {name: _asset(name) for name in _TYPES}
    blueprint = Blueprint("ui", __name__)

    def serve(name: str) -> Response:
        response = Response(assets[name], content_type=_TYPES[name])
        response.headers["Content-Security-Policy"] = _POLICY
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Referrer-Policy"] = "no-referrer"
        # Always revalidated, so an upgraded pool serves its own script at once.
        response.headers["Cache-Control"] = "no-cache"
        return response

    @blueprint.get("/ui")
    async def ui_root() -> Response:
        # The page's relative URLs resolve against /ui/, not against /.
        return redirect("ui/", 308)  # type: ignore[return-value]

    @blueprint.get("/ui/")
    async def ui_page() -> Response:
        """The dashboard page."""
        return serve("index.html")

    @blueprint.get("/ui/app.js")
    async def ui_script() -> Response:
        return serve("app.js")

    @blueprint.get("/ui/app.css")
    async def ui_style() -> Response:
        return serve("app.css")

    app.register_blueprint(blueprint)
