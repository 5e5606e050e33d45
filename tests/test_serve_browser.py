"""The cache page of `moectl serve` in a real headless browser (Debian's chromium driven by selenium):
send a message, see the streamed answer and the cache panel change.

Needs `apt-get install chromium chromium-driver` and `pip install selenium`; skips (saying which is missing)
otherwise."""

from __future__ import annotations

import shutil

import pytest

pytest.importorskip("fastapi", reason="moectl[serve] is not installed")
pytest.importorskip("selenium", reason="selenium is not installed (pip install selenium)")
from serve_helpers import greedy_chat, thread_server  # noqa: E402

BROWSER = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
DRIVER = shutil.which("chromedriver")


@pytest.fixture(scope="module")
def browser():
    if not BROWSER or not DRIVER:
        pytest.skip("no headless browser: install one with `apt-get install chromium chromium-driver`")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = BROWSER
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    yield driver
    driver.quit()


def test_page_streams_an_answer_and_the_cache_panel_moves(tiny_small, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from moectl.runtime.engine import Engine

    engine = Engine.load(str(tiny_small), cache_experts=6, progress=False)
    _ids, expected = greedy_chat(engine, "What does bisect_left do?", 24)
    with thread_server(engine) as live:
        browser.get(live.url + "/")
        wait = WebDriverWait(browser, 60, poll_frequency=0.05)
        wait.until(lambda d: d.find_element(By.ID, "model").text == "tiny")
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "tr.layer")) == 2)
        hits_before = browser.find_element(By.ID, "hits").text
        step_before = browser.find_element(By.ID, "step").text
        # Record the panel's token counter each time it changes while the answer is still streaming.
        browser.execute_script("""
            window.stepsWhileStreaming = [];
            new MutationObserver(() => {
                const a = document.getElementById('answer');
                if (a && a.dataset.done === '0' && a.textContent)
                    window.stepsWhileStreaming.push(document.getElementById('step').textContent);
            }).observe(document.getElementById('step'), {childList: true, characterData: true, subtree: true});""")
        size = browser.find_element(By.ID, "max-tokens")
        size.clear()
        size.send_keys("24")
        browser.find_element(By.ID, "prompt").send_keys("What does bisect_left do?")
        browser.find_element(By.ID, "send").click()
        wait.until(lambda d: d.find_element(By.ID, "answer").get_attribute("data-done") == "1")
        assert browser.find_element(By.ID, "answer").get_attribute("textContent") == expected
        wait.until(lambda d: d.find_element(By.ID, "hits").text != hits_before)
        assert browser.find_element(By.ID, "step").text != step_before
        layers = browser.find_elements(By.CSS_SELECTOR, "tr.layer")
        assert sum(int(r.get_attribute("data-hits")) + int(r.get_attribute("data-misses")) for r in layers) > 0
        resident = browser.find_elements(By.CSS_SELECTOR, "tr.layer .slot.fp32")
        assert 0 < len(resident) <= 6                                   # 3 slots per layer, fp32 experts
        live_steps = browser.execute_script("return window.stepsWhileStreaming")
        print("cache panel token counter while streaming:", live_steps)
        assert live_steps                                               # the panel moved before the answer ended
