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
from pool.http._route import HTML, Route, serves

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


# -- the documented routes (pool/http/_route.py) ----------------------------------------
UI_ROOT = Route(
    "get",
    "/ui",
    "operations",
    "Dashboard (redirect)",
    "308 to `ui/`, so the page's relative URLs resolve under `/ui/`.",
    status=308,
    text=HTML,
)
UI_PAGE = Route(
    "get",
    "/ui/",
    "operations",
    "Dashboard",
    "An HTML page that shows and steers the pool through the admin API with the"
    ' operator\'s token (docs/operations.md, "The dashboard"); the page itself holds no'
    " data and needs no token.",
    text=HTML,
)
UI_SCRIPT = Route(
    "get",
    "/ui/app.js",
    "operations",
    "Dashboard script",
    "The page's script.",
    text=("text/javascript", {"type": "string"}),
)
UI_STYLE = Route(
    "get",
    "/ui/app.css",
    "operations",
    "Dashboard style",
    "The page's stylesheet.",
    text=("text/css", {"type": "string"}),
)
ROUTES = (UI_ROOT, UI_PAGE, UI_SCRIPT, UI_STYLE)


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

    @serves(blueprint, UI_ROOT)
    async def ui_root() -> Response:
        # The page's relative URLs resolve against /ui/, not against /.
        return redirect("ui/", 308)  # type: ignore[return-value]

    @serves(blueprint, UI_PAGE)
    async def ui_page() -> Response:
        """The dashboard page."""
        return serve("index.html")

    @serves(blueprint, UI_SCRIPT)
    async def ui_script() -> Response:
        return serve("app.js")

    @serves(blueprint, UI_STYLE)
    async def ui_style() -> Response:
        return serve("app.css")

    app.register_blueprint(blueprint)
