"""The local web chat in a real headless Chromium (the distribution's package, driven by Selenium):
the page streams an answer over a live split (behind an emulated WAN link) that equals the API's
answer, its chart follows the steps, and the decoding mode menu switches modes. The screenshot lands
in results/web_chat.png."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from splitllm.testing.launch import serve_http
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

from splitllm.api.openai import create_app
from splitllm.client.client import SplitClient
from splitllm.testing.netem import LinkProfile, ProxyThread

pytestmark = pytest.mark.slow
QUESTION = "Name three colors."
SCREENSHOT = Path(__file__).resolve().parents[1] / "results" / "web_chat.png"


def _chromium() -> tuple[str, str]:
    """The distribution's Chromium and its driver (`make test` installs them when missing)."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not browser or not driver:
        raise RuntimeError("Chromium and chromedriver are needed: apt-get install -y chromium chromium-driver")
    return browser, driver


@pytest.fixture(scope="module")
def chat_url(server) -> Iterator[str]:  # type: ignore[no-untyped-def]
    """The endpoint with its client behind an emulated 40 ms link to a real server."""
    target = server(None, 2, 2)
    with ProxyThread("127.0.0.1", target.port, LinkProfile(rtt_ms=40)) as proxy:
        client = SplitClient(None, f"ws://127.0.0.1:{proxy.port}", first=2, last=2)
        with serve_http(create_app(client, "splitllm-test")) as url:
            yield url


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    binary, driver = _chromium()
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,860"):
        options.add_argument(flag)
    chrome = webdriver.Chrome(service=Service(driver), options=options)
    yield chrome
    chrome.quit()


def test_page_streams_the_apis_answer_and_charts_its_steps(chat_url: str, browser: webdriver.Chrome) -> None:
    body = {"messages": [{"role": "user", "content": QUESTION}], "temperature": 0, "max_tokens": 256, "decode": "auto"}
    expected = httpx.post(f"{chat_url}/v1/chat/completions", json=body,
                          timeout=120).json()["choices"][0]["message"]["content"]

    browser.get(chat_url)
    wait = WebDriverWait(browser, 120)
    wait.until(lambda b: len(Select(b.find_element(By.ID, "decode")).options) >= 2)
    modes = [o.text for o in Select(browser.find_element(By.ID, "decode")).options]
    assert "sequential" in modes and Select(browser.find_element(By.ID, "decode")).first_selected_option.text == "auto"
    browser.find_element(By.ID, "prompt").send_keys(QUESTION)
    browser.find_element(By.ID, "send").click()

    # While streaming, the answer grows and the chart gains steps.
    seen_partial = wait.until(lambda b: b.execute_script(
        "const a = document.querySelector('.msg.assistant');"
        "return a && (a.dataset.done || Number(document.getElementById('chart').dataset.steps) > 0);"))
    assert seen_partial
    answer = wait.until(lambda b: b.find_element(By.CSS_SELECTOR, ".msg.assistant[data-done='true']"))
    text = browser.execute_script("return document.querySelector('.msg.assistant .text').textContent")
    assert text == expected

    steps = int(browser.find_element(By.ID, "chart").get_attribute("data-steps"))
    assert steps >= 1
    painted = browser.execute_script(
        "const c = document.getElementById('chart'); "
        "const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
        "let n = 0; for (let i = 0; i < d.length; i += 4) "
        "if (d[i + 3] && !(d[i] > 240 && d[i + 1] > 240 && d[i + 2] > 240)) n++;"
        "return n;")
    assert painted > 500  # bars, axes and labels, not a blank canvas
    assert float(browser.find_element(By.ID, "tps").text) > 0
    assert float(browser.find_element(By.ID, "tpr").text) >= 1
    assert "tok/s" in answer.text

    # A second turn in another mode: the page sends the whole conversation, as an API client would.
    follow = "And three animals?"
    history = [*body["messages"], {"role": "assistant", "content": expected}, {"role": "user", "content": follow}]
    second = httpx.post(
        f"{chat_url}/v1/chat/completions", json={**body, "messages": history, "decode": "sequential"}, timeout=120
    ).json()["choices"][0]["message"]["content"]
    Select(browser.find_element(By.ID, "decode")).select_by_visible_text("sequential")
    browser.find_element(By.ID, "prompt").send_keys(follow)
    browser.find_element(By.ID, "send").click()
    wait.until(lambda b: len(b.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-done='true']")) == 2)
    texts = browser.execute_script(
        "return [...document.querySelectorAll('.msg.assistant .text')].map(e => e.textContent)"
    )
    assert texts == [expected, second]
    assert "sequential" in browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .meta")[1].text
    assert float(browser.find_element(By.ID, "tpr").text) == 1.0  # one token per round trip, as sequential must

    SCREENSHOT.parent.mkdir(exist_ok=True)
    browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")[0].click()  # the panel shows the auto answer again
    browser.save_screenshot(str(SCREENSHOT))
