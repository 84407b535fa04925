"""The dashboard in a real browser: Debian's headless Chromium driven by Playwright, against a
real ``adaptrain server`` running real jobs.

The jobs table shows every job with the status the API reports, and a click opens the job
(why it is pending, why it failed); a training job's page charts the hints it posted and lists
its events, and a rescale caused by a second job's arrival shows up without a reload; on a
server with a token, a missing or wrong token gets the login form and its error, not data.

With ``ADAPTRAIN_SCREENSHOTS=DIR`` the rescale test writes the README's screenshots of the
jobs page and the job page to ``DIR``.
"""

from __future__ import annotations

import base64
import io
import os
import re
import sys
import tarfile
from pathlib import Path

import pytest
from _e2e_jobs import SCRIPT
from _service_jobs import http, wait_for, wait_job

pytest.importorskip("playwright")

CHROMIUM = "/usr/bin/chromium"
TOKEN = "dashboard-token-0123456789"

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"no {CHROMIUM}")


class Browser:
    """One headless Chromium page, with the page's uncaught errors collected."""

    def __init__(self, page) -> None:
        self.page = page
        self.errors: list[str] = []
        page.on("pageerror", lambda exc: self.errors.append(str(exc)))

    def rows(self) -> dict[str, str]:
        """job name -> the status shown in the jobs table."""
        return self.page.eval_on_selector_all(
            "#jobs tbody tr",
            "rows => Object.fromEntries(rows.map(r => "
            "[r.dataset.job, r.querySelector('td.status').textContent]))",
        )


@pytest.fixture
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            context = chromium.new_context(viewport={"width": 1280, "height": 900})
            page = context.new_page()
            page.set_default_timeout(30_000)
            yield Browser(page)
        finally:
            chromium.close()


def _workdir(files: dict[str, str]) -> str:
    """``files`` as a job's working folder: a gzip'd tar, base64 (what ``adaptrain submit``
    sends)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return base64.b64encode(buf.getvalue()).decode()


def _submit(client, name: str, code: str, **spec) -> None:
    resp = client.post("/jobs", json={"name": name, "command": [sys.executable, "-c", code],
                                      **spec})  # fmt: skip
    assert resp.status_code == 201, resp.text


@pytest.mark.timeout(120)
def test_the_jobs_table_lists_every_job_with_the_status_the_api_reports(server, browser):
    srv = server("--slots", "2", "--interval", "1", "--grace", "5")
    sleep = "import time; time.sleep(120)"
    with http(srv) as c:
        # one job in each status: Running (pinned to its slot), Succeeded, Failed, Cancelled,
        # and Pending (it needs both slots; the pinned job holds one)
        _submit(c, "hold", sleep, preemptible=False)
        wait_job(srv, "hold", ("Running",))
        _submit(c, "done", "pass")
        wait_job(srv, "done", ("Succeeded",))
        _submit(c, "crash", "raise SystemExit(3)", max_restarts=0)
        wait_job(srv, "crash", ("Failed",))
        _submit(c, "gone", sleep)
        wait_job(srv, "gone", ("Running",))
        assert c.delete("/jobs/gone").status_code == 200
        wait_job(srv, "gone", ("Cancelled",))
        _submit(c, "waits", sleep, min_replicas=2, max_replicas=2)
        page = browser.page
        page.goto(srv.url + "/")
        page.wait_for_selector("#jobs tbody tr")

        def same() -> dict | None:
            api = {j["name"]: j["status"] for j in c.get("/jobs").json()}
            return api if browser.rows() == api else None

        api = wait_for(same, 20, "the table to show the API's statuses", step=0.3)
        assert api == {"hold": "Running", "done": "Succeeded", "crash": "Failed",
                       "gone": "Cancelled", "waits": "Pending"}  # fmt: skip
        replicas = page.eval_on_selector_all(
            "#jobs tbody tr",
            "rows => Object.fromEntries(rows.map(r => "
            "[r.dataset.job, r.querySelector('td.replicas').textContent]))",
        )
        assert replicas == {j["name"]: str(j["replicas"]) for j in c.get("/jobs").json()}
        assert page.locator(".slot[data-job=hold]").count() == 1  # the cluster's slots

        # a click opens the job: why it waits, and why the other failed
        page.click("#jobs tbody tr[data-job=waits]")
        page.wait_for_url(re.compile(r"#/jobs/waits$"))
        reason = c.get("/jobs/waits").json()["pending_reason"]
        assert reason
        page.wait_for_function(
            "r => document.querySelector('#job-reason').textContent.includes(r)", arg=reason
        )
        page.go_back()
        page.click("#jobs tbody tr[data-job=crash]")
        page.wait_for_selector("#events tr.failure")
        failures = page.locator("#events tr.failure").all_inner_texts()
        assert any("replica 0 exited 3" in f for f in failures), failures
    assert browser.errors == []


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_job_page_charts_its_hints_and_shows_a_rescale_without_a_reload(server, browser):
    srv = server("--slots", "2", "--interval", "2", "--restart-delay", "2",
                 "--checkpoint-interval", "2", "--hints-interval", "1", "--grace", "30")  # fmt: skip
    job = {
        "command": ["python", "train.py", "charlm", "--epochs", "100000", "--step-sleep", "0.05"],
        "max_replicas": 2,
        "env": {"OMP_NUM_THREADS": "1"},
        "workdir": _workdir({"train.py": SCRIPT}),
    }
    page = browser.page
    with http(srv) as c:
        assert c.post("/jobs", json={"name": "first", **job}).status_code == 201
        wait_for(lambda: c.get("/jobs/first").json()["replicas"] == 2, 90, "first on both slots")
        page.goto(f"{srv.url}/#/jobs/first")
        # charts of the hints it posted, and its events
        for chart in ("replicas", "batch_size", "gain", "goodput", "throughput"):
            page.wait_for_selector(f"figure[data-chart={chart}]:not([data-points='0'])",
                                   timeout=90_000)  # fmt: skip
        page.wait_for_function(
            "() => document.querySelector('figure[data-chart=batch_size]').dataset.points >= 3",
            timeout=60_000,
        )
        assert page.locator("figure[data-chart=goodput] path.line").count() == 1
        assert page.locator("#events tr[data-kind=Started]").count() == 1
        assert page.locator("#events tr[data-kind=Submitted]").count() == 1
        page.wait_for_function(
            "() => document.querySelector('#job-stats [data-stat=replicas]')"
            ".textContent.startsWith('2')"
        )

        # a second job arrives: the policy gives it a slot of the first's, and the open page
        # shows the rescale, the event and the new allocation, without being reloaded
        page.evaluate("window.notReloaded = true")
        assert c.post("/jobs", json={"name": "second", **job}).status_code == 201
        page.wait_for_selector("#events tr.rescale", timeout=60_000)
        goodput_points = int(page.get_attribute("figure[data-chart=goodput]", "data-points"))
        rescale = page.locator("#events tr.rescale").first.inner_text()
        assert "rescale: 2 -> 1 replicas" in rescale, rescale
        page.wait_for_function(
            "() => document.querySelector('#job-stats [data-stat=replicas]')"
            ".textContent.startsWith('1')",
            timeout=90_000,
        )
        assert page.evaluate("window.notReloaded") is True
        assert page.evaluate("performance.getEntriesByType('navigation').length") == 1
        api = c.get("/jobs/first").json()
        assert api["replicas"] == 1 and api["restarts"] >= 1
        events = [e["message"] for e in api["events"]]
        assert any(m.startswith("rescale: 2 -> 1") for m in events), events
        page.wait_for_function(  # the allocation chart's newest sample: 1 replica
            "() => document.querySelector('figure[data-chart=replicas] .now')"
            ".textContent === 'now 1'",
            timeout=60_000,
        )
        wait_job(srv, "second", ("Running",), timeout=90)
        shots = os.environ.get("ADAPTRAIN_SCREENSHOTS")
        if shots:  # a picture with the history on both sizes: hints from after the restart
            page.wait_for_function(
                "n => document.querySelector('figure[data-chart=goodput]').dataset.points >= n",
                arg=goodput_points + 8,
                timeout=120_000,
            )
            Path(shots).mkdir(parents=True, exist_ok=True)
            page.screenshot(path=os.path.join(shots, "dashboard-job.png"), full_page=True)

        # the jobs page (a hash change, no reload): both running, a slot each
        page.click("nav a")
        page.wait_for_selector(".slot[data-job=second]", timeout=60_000)
        assert page.locator(".slot[data-job=first]").count() == 1
        assert page.locator(".slot[data-job=second]").count() == 1
        assert browser.rows() == {"first": "Running", "second": "Running"}
        assert page.evaluate("window.notReloaded") is True
        page.wait_for_function(
            "() => document.querySelector('figure[data-chart=utilisation]').dataset.points >= 2"
        )
        if shots:
            page.screenshot(path=os.path.join(shots, "dashboard-jobs.png"), full_page=True)
    assert browser.errors == []


@pytest.mark.timeout(90)
def test_a_missing_or_wrong_token_shows_the_login_error_not_data(server, browser, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    srv = server("--slots", "1", "--interval", "5", "--grace", "5", "--token-file",
                 str(token_file))  # fmt: skip
    with http(srv, TOKEN) as c:
        _submit(c, "secret-job", "import time; time.sleep(120)")
    page = browser.page
    page.goto(srv.url + "/")
    # no token: the login form, its message, and nothing of the server's
    page.wait_for_selector("#login:not([hidden])")
    assert "needs a token" in page.inner_text("#login-error")
    assert page.locator("#view").is_hidden()
    assert "secret-job" not in page.content()
    # a wrong token: refused, still no data
    page.fill("#token", "wrong-token-0123456789")
    page.click("#login-form button[type=submit]")
    page.wait_for_function(
        "() => document.querySelector('#login-error').textContent.includes('refused')"
    )
    assert "401" in page.inner_text("#login-error")
    assert page.locator("#view").is_hidden() and "secret-job" not in page.content()
    assert page.locator("#jobs").count() == 0
    # the right one: the jobs, and the token kept for this tab only (a reload keeps it)
    page.fill("#token", TOKEN)
    page.click("#login-form button[type=submit]")
    page.wait_for_selector("#jobs tbody tr[data-job=secret-job]")
    assert page.locator("#login").is_hidden()
    assert page.evaluate("sessionStorage.getItem('adaptrain-token')") == TOKEN
    page.reload()
    page.wait_for_selector("#jobs tbody tr[data-job=secret-job]")
    # a stale token kept by the tab: back to the login form and its error
    page.evaluate("sessionStorage.setItem('adaptrain-token', 'stale-token-0123456789')")
    page.reload()
    page.wait_for_selector("#login:not([hidden])")
    assert "refused" in page.inner_text("#login-error") and "secret-job" not in page.content()
    assert browser.errors == []
