"""The web console in a real headless Chromium (Debian's ``chromium`` + ``chromium-driver``,
driven by Selenium), against a real ``alignedserve serve`` process on the default model
started with ``--api-key``, as a user would run it.

``scripts/setup.sh`` installs the browser; where it could not (no root, no apt), these tests
skip and say so. Nothing here downloads a browser or a driver.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time

import httpx
import pytest

from tests.server_process import serve_default_model

pytestmark = pytest.mark.model
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
KEY = "console-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
    pytest.skip("Debian's chromium and chromium-driver are not installed (scripts/setup.sh "
                "installs them where apt-get can run)", allow_module_level=True)


@pytest.fixture(scope="module")
def server():
    """Base URL of a server on the default model, with an API key."""
    with serve_default_model("--max-model-len", "2048", "--api-key", KEY, "--no-access-log",
                             "--log-level", "warning", "--shutdown-grace", "5") as (url, _):
        yield url


@pytest.fixture(scope="module")
def browser():
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="alignedserve-chromium-")
    options = Options()
    options.binary_location = CHROMIUM
    # No sandbox (tests may run as root); no background networking (this machine's network is
    # closed, and Chromium's own connections would only fail).
    for flag in ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--window-size=1400,1000",
                 f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _wait(predicate, timeout: float = 30, period: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(period)
    raise AssertionError(f"timed out after {timeout} s")


def _text(driver, element_id: str) -> str:
    return driver.execute_script(f"return document.getElementById('{element_id}').textContent")


def _open(driver, url: str, key: str | None = KEY) -> None:
    """Load the console with ``key`` in this tab's storage (as if typed in an earlier visit)."""
    driver.get(url + "/")
    if key is None:
        driver.execute_script("sessionStorage.clear()")
    else:
        driver.execute_script("sessionStorage.setItem('alignedserve-key', arguments[0])", key)
    driver.get_log("browser")  # drop what the keyless first load logged (401s)
    driver.refresh()


def _kv_used(url: str) -> str:
    text = httpx.get(url + "/metrics", headers=AUTH, timeout=10).text
    return "\n".join(line for line in text.splitlines()
                     if line.startswith("alignedserve:kv_cache_used_bytes{"))


def _chat(driver, prompt: str, max_tokens: int, temperature: float = 0.0):
    """Type a message and send it; return the assistant's reply element."""
    driver.execute_script("""
        document.getElementById('temperature').value = arguments[0];
        document.getElementById('max-tokens').value = arguments[1];
        document.getElementById('prompt').value = arguments[2];
        document.getElementById('send').click();""", temperature, max_tokens, prompt)
    return _wait(lambda: driver.execute_script(
        "const r = document.querySelectorAll('#messages .msg.assistant');"
        "return r.length ? r[r.length - 1] : null;"))


def test_page_loads_without_console_errors(server, browser):
    _open(browser, server)
    _wait(lambda: "policy" in _text(browser, "engine-info"))
    _wait(lambda: browser.execute_script("return document.getElementById('model').options.length"))
    assert "kernels" in _text(browser, "engine-info")
    severe = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not severe, severe


def test_chat_streams_and_equals_the_api(server, browser):
    _open(browser, server)
    _wait(lambda: browser.execute_script("return document.getElementById('model').options.length"))
    browser.execute_script("document.getElementById('clear').click()")
    prompt = "Name three colors of the rainbow."
    reply = _chat(browser, prompt, max_tokens=40)
    lengths = set()
    while reply.get_attribute("data-done") != "1":
        lengths.add(len(reply.get_property("textContent")))
        time.sleep(0.02)
    text = reply.get_property("textContent")
    assert len({n for n in lengths if 0 < n < len(text)}) >= 2, lengths  # it grew while streaming
    api = httpx.post(server + "/v1/chat/completions", headers=AUTH, timeout=120, json={
        "messages": [{"role": "user", "content": prompt}], "max_tokens": 40,
        "temperature": 0}).json()
    assert text == api["choices"][0]["message"]["content"]
    assert reply.get_attribute("data-finish") == api["choices"][0]["finish_reason"]


def test_stop_aborts_and_frees_kv(server, browser):
    _open(browser, server)
    _wait(lambda: browser.execute_script("return document.getElementById('model').options.length"))
    _wait(lambda: httpx.get(server + "/engine/state", headers=AUTH).json()["running"] == 0)
    idle = _kv_used(server)
    reply = _chat(browser, "Write a very long story about a dragon and a castle.", 1800, 0.8)
    _wait(lambda: len(reply.get_property("textContent")) > 20)
    assert httpx.get(server + "/engine/state", headers=AUTH).json()["running"] == 1
    browser.execute_script("document.getElementById('stop').click()")
    _wait(lambda: reply.get_attribute("data-done") == "1")
    assert reply.get_attribute("data-finish") == "stopped"
    _wait(lambda: _kv_used(server) == idle, 30)
    assert httpx.get(server + "/engine/state", headers=AUTH).json()["running"] == 0


def test_engine_view_follows_a_burst(server, browser):
    _open(browser, server)
    _wait(lambda: "policy" in _text(browser, "engine-info"))

    def one(i: int) -> None:
        httpx.post(server + "/v1/completions", headers=AUTH, timeout=300, json={
            "prompt": "Once upon a time " * (1 + 6 * i), "max_tokens": 120, "ignore_eos": True})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    _wait(lambda: int(_text(browser, "running") or 0) >= 4, 60)
    _wait(lambda: int(browser.execute_script(
        "return document.getElementById('groups').dataset.groups || 0")) >= 1)
    assert browser.find_elements("css selector", "#groups rect.group")
    assert "dev0" in browser.execute_script(
        "return [...document.querySelectorAll('#kv .kv-tier')].map(e => e.dataset.tier).join()")
    for t in threads:
        t.join()
    _wait(lambda: _text(browser, "running") == "0" and browser.execute_script(
        "return document.getElementById('groups').dataset.groups") == "0", 30)
    assert float(_text(browser, "tok-s")) >= 0


def test_markup_is_shown_as_text(server, browser):
    _open(browser, server)
    _wait(lambda: browser.execute_script("return document.getElementById('model').options.length"))
    markup = '<img src=x onerror="window.__xss = 1"><script>window.__xss = 2</script>'
    reply = _chat(browser, "Repeat exactly: " + markup, max_tokens=30)
    _wait(lambda: reply.get_attribute("data-done") == "1", 120)
    # and straight through the renderer, as a reply containing markup would arrive
    browser.execute_script("addMessage('assistant', arguments[0])", markup)
    time.sleep(0.5)  # an injected image would have failed to load and fired onerror by now
    messages = browser.find_element("id", "messages")
    assert not messages.find_elements("css selector", "img, script")
    texts = browser.execute_script(
        "return [...document.querySelectorAll('#messages .msg')].map(e => e.textContent)")
    assert "Repeat exactly: " + markup in texts and markup in texts
    assert browser.execute_script("return window.__xss") is None


def test_api_key_is_required(server, browser):
    for path in ["/engine/state", "/engine/events", "/v1/models"]:
        assert httpx.get(server + path, timeout=10).status_code == 401
    r = httpx.post(server + "/v1/chat/completions", timeout=10,
                   json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 401
    assert httpx.get(server + "/", timeout=10).status_code == 200  # the page asks for the key
    _open(browser, server, key=None)
    _wait(lambda: "API key" in _text(browser, "status"))
    assert _text(browser, "running") == "–"
