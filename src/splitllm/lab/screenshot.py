"""The README's web chat screenshot, from a realistic run: `python -m splitllm.lab.screenshot OUT.png`.

The default model split as two machines would run it (the server on half the cores, the client on the
other half) behind an emulated 80 ms link, `client-api` in this process, and the distribution's
headless Chromium (`make browser`) asking a question and a follow-up; the panel shows the first answer.
"""

from __future__ import annotations

import sys
import time

from splitllm.api.openai import create_app
from splitllm.client.client import SplitClient
from splitllm.testing.launch import ServerProcess, on_cores, serve_http, sides
from splitllm.testing.netem import LinkProfile, ProxyThread
from splitllm.threads import ComputeThread, set_compute_threads

QUESTIONS = ("Write a Python function that checks whether a string is a palindrome.",
             "Now make it ignore spaces and case.")


def take(out: str, rtt_ms: float = 80.0) -> None:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    cores = sides("halves")
    set_compute_threads(cores.threads)
    with ServerProcess("--threads", str(cores.threads), cores=cores.server) as server, on_cores(cores.client):
        with ProxyThread("127.0.0.1", server.port, LinkProfile(rtt_ms=rtt_ms)) as proxy:
            compute = ComputeThread()
            client = compute.run(lambda: SplitClient(None, f"ws://127.0.0.1:{proxy.port}"))
            with serve_http(create_app(client, "smollm2-135m-instruct", compute=compute)) as url:
                options = webdriver.ChromeOptions()
                options.binary_location = "/usr/bin/chromium"
                for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,860"):
                    options.add_argument(flag)
                browser = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
                try:
                    browser.get(url)
                    for i, question in enumerate(QUESTIONS):
                        browser.find_element(By.ID, "prompt").send_keys(question)
                        browser.find_element(By.ID, "send").click()
                        WebDriverWait(browser, 300).until(
                            lambda b,
                            i=i: len(b.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-done='true']")) == i + 1
                        )
                    browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")[0].click()
                    time.sleep(0.5)  # the panel redraws its chart
                    browser.save_screenshot(out)
                finally:
                    browser.quit()


if __name__ == "__main__":
    take(sys.argv[1] if len(sys.argv) > 1 else "docs/web_chat.png")
