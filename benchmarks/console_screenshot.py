"""Screenshot of the web console under load, in headless Debian Chromium (as in
tests/test_console_browser.py): sends a burst of mixed-length completions plus one chat
message through the page, waits, and saves a PNG.

    ./scripts/serve.sh --port 8000 &
    python benchmarks/console_screenshot.py http://127.0.0.1:8000 docs/console.png \
        [--api-key KEY] [--requests 24] [--wait 12]
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time

import httpx
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("url")
    parser.add_argument("out")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--wait", type=float, default=12.0, help="seconds of load before the shot")
    args = parser.parse_args()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    options = Options()
    options.binary_location = "/usr/bin/chromium"
    for flag in ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking", "--hide-scrollbars",
                 "--disable-component-update", "--disable-sync", "--window-size=1400,1000",
                 f"--user-data-dir={tempfile.mkdtemp()}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    try:
        driver.get(args.url + "/")
        if args.api_key:
            driver.execute_script("sessionStorage.setItem('alignedserve-key', arguments[0])",
                                  args.api_key)
            driver.refresh()
        time.sleep(2)

        def one(i: int) -> None:
            httpx.post(args.url + "/v1/completions", headers=headers, timeout=600, json={
                "prompt": "Tell me about the history of " + "the city and its people " * (1 + i % 6 * 12),
                "max_tokens": 400, "ignore_eos": True})

        for i in range(args.requests):
            threading.Thread(target=one, args=(i,), daemon=True).start()
        driver.execute_script("""
            document.getElementById('system').value = 'You are a concise assistant.';
            document.getElementById('max-tokens').value = 120;
            document.getElementById('prompt').value = 'What does a serving engine batch?';
            document.getElementById('send').click();""")
        time.sleep(args.wait)
        driver.save_screenshot(args.out)
        print("saved", args.out)
    finally:
        driver.quit()


if __name__ == "__main__":
    main()
