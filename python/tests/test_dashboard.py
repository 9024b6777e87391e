"""The live dashboard (``syncopate local --dashboard``) in a real headless Chromium, driven by
Playwright: the page goes live, shows every worker and shard training and its charts, drills
into a worker, refuses a swap with a wrong token, and swaps a policy with the operator token,
which the whole page then shows and ``policy status`` confirms; a screenshot stays in the run
folder. The cluster is real (the `syncopate` binary on loopback)."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import ConsoleMessage, Page, expect, sync_playwright

from conftest import Procs, finish, run_syncopate, start_local


def chromium() -> str:
    """The Chromium to drive: $SYNCOPATE_CHROMIUM, or Debian's (scripts/setup-python.sh
    installs it)."""
    exe = os.environ.get("SYNCOPATE_CHROMIUM")
    exe = exe or shutil.which("chromium") or shutil.which("chromium-browser")
    if not exe:
        pytest.fail("no Chromium found: run scripts/setup-python.sh (or set SYNCOPATE_CHROMIUM)")
    return exe


# Headless, and quiet: no background connections (the loopback guard watches the browser too).
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-extensions",
]


def view(addr: str) -> dict[str, Any]:
    """The dashboard's current view, as its page reads it."""
    with urllib.request.urlopen(f"http://{addr}/api/view", timeout=30) as r:
        return json.load(r)


def swap(page: Page, policy: str, config: str, token: str) -> None:
    """Asks for a swap from the page's form."""
    page.select_option("#swap-builtin", policy)
    page.fill("#swap-config", config)
    page.fill("#swap-token", token)
    page.click("#swap-go")


def test_the_dashboard_shows_a_training_cluster_live_and_swaps_its_policy(
    procs: Procs, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    args = ["--workers", "3", "--servers", "2", "--time-limit-s", "300", "--dashboard"]
    p = start_local(procs, run, *args)
    cluster = json.loads((run / "cluster.json").read_text())
    addr, token = cluster["dashboard"], cluster["token"]
    assert addr.startswith("127.0.0.1:"), addr
    errors: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium(), args=FLAGS, timeout=60_000)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1800})
            # Generous limits: a busy machine starts a cluster slowly; a hang still fails.
            page.set_default_timeout(60_000)
            expect.set_options(timeout=60_000)
            page.on("pageerror", lambda e: errors.append(f"page error: {e}"))

            # The browser logs the refused swap's answer (401) as an error: the one expected.
            def console(m: ConsoleMessage) -> None:
                if m.type == "error" and "401" not in m.text:
                    errors.append(f"console: {m.text}")

            page.on("console", console)
            # The token in the fragment, as `local` prints the address: it fills the form and
            # leaves the address bar.
            page.goto(f"http://{addr}/#token={token}")
            expect(page.locator("#conn")).to_have_text("live")
            assert "token" not in page.url
            expect(page.locator("#swap-token")).to_have_value(token)
            expect(page.locator("#policy")).to_have_text("builtin:bsp")

            # Three workers training on two servers; the figures move.
            expect(page.locator("#workers-table tbody tr")).to_have_count(3)
            expect(page.locator("#servers tbody tr")).to_have_count(2)
            expect(page.locator("#shards tbody tr")).to_have_count(2)
            first = int(page.inner_text("#iterations"))
            expect(page.locator("#iterations")).not_to_have_text(str(first))
            assert int(page.inner_text("#iterations")) > first
            for chart in ["progress", "waits", "loss", "staleness", "traffic"]:
                expect(page.locator(f"#chart-{chart} canvas")).to_have_count(1)
            # The workers report their training loss: a number in every row.
            loss = page.locator("#workers-table tbody tr td:nth-child(6)")
            expect(loss.first).to_have_text(re.compile(r"^\d"))

            # The launcher scores the model and reports it: the test accuracy reaches the page.
            deadline = time.monotonic() + 60
            while view(addr)["point"]["accuracy"] is None:
                assert time.monotonic() < deadline, "no accuracy on the dashboard within 60 s"
                time.sleep(0.5)
            assert 0.0 < view(addr)["point"]["accuracy"] <= 1.0

            # One worker in detail, from its row.
            page.locator("#workers-table tbody tr").nth(1).click()
            expect(page.locator("#worker-detail")).to_be_visible()
            expect(page.locator("#worker-detail-title")).to_contain_text("Worker 1: clock")
            expect(page.locator("#worker-shards tbody tr")).to_have_count(2)

            # A wrong token swaps nothing and says why.
            swap(page, "ssp", "s=2", "not-the-token")
            expect(page.locator("#swap-result.err")).to_contain_text("not the operator token")
            expect(page.locator("#swaps")).to_have_text("0")

            # The operator token: SSP on every shard, in the header, the history, the shards
            # and the events.
            swap(page, "ssp", "s=2", token)
            done = "swap 1: builtin:ssp now runs on all 2 shards"
            expect(page.locator("#swap-result.ok")).to_have_text(done)
            expect(page.locator("#policy")).to_have_text("builtin:ssp:s=2")
            expect(page.locator("#swaps")).to_have_text("1")
            expect(page.locator("#swap-history li")).to_have_count(2)
            expect(page.locator("#shards tbody")).not_to_contain_text("bsp")
            expect(page.locator("#events")).to_contain_text("swap 1: builtin:ssp now runs")
            # The run folder keeps what the page looked like.
            page.screenshot(path=str(run / "dashboard.png"), full_page=True)
        finally:
            browser.close()
    # The cluster says so too.
    status = run_syncopate(
        "policy", "status", "--json", "--cluster", str(run / "cluster.json"), timeout=60
    )
    assert status.returncode == 0, status.stdout
    cluster_status = json.loads(status.stdout)
    assert (cluster_status["policy"], cluster_status["swaps"]) == ("builtin:ssp", 1)
    shards = [sh for sv in cluster_status["servers"] for sh in sv["shards"]]
    assert len(shards) == 2 and all(sh["policy"].startswith("ssp ") for sh in shards), shards
    assert (run / "dashboard.png").stat().st_size > 10_000
    done = run_syncopate("stop", "--cluster", str(run / "cluster.json"), timeout=60)
    assert done.returncode == 0, done.stdout
    out = finish(p, timeout=180)
    assert "swaps: 1" in out, out
    assert errors == [], errors
