"""Open kvloom's dashboard in headless Chromium (Debian's chromium + chromium-driver,
through Selenium) and take a screenshot of it, or keep it open as a live viewer.

    python scripts/dashboard_screenshot.py --url http://127.0.0.1:8000/dashboard \
        --after 60 --out docs/images/dashboard.png     # a screenshot after 60 s of load
    python scripts/dashboard_screenshot.py --url ... --hold 600   # an open dashboard for 10 min
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import time

from selenium import webdriver
from selenium.webdriver.chrome.service import Service


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True)
    parser.add_argument("--out", default=None, help="PNG to write")
    parser.add_argument("--after", type=float, default=5.0, help="seconds the page runs before the screenshot")
    parser.add_argument("--hold", type=float, default=0.0, help="seconds to keep the page open afterwards")
    parser.add_argument("--size", default="1400,1000")
    args = parser.parse_args()
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "chromium"
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     f"--window-size={args.size}"):
        options.add_argument(argument)
    # A kill (SIGTERM) must close the browser too, or Chromium lives on, orphaned, still
    # drawing the page (and taking CPU from whatever runs next).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver") or "chromedriver"), options=options)
    try:
        driver.get(args.url)
        time.sleep(args.after)  # how long the page shows the live run before the picture
        if args.out:
            driver.save_screenshot(args.out)
            print(f"wrote {args.out}; the page took {driver.execute_script('return window.kvloom.state.updates')} "
                  f"updates")
        time.sleep(args.hold)
    finally:
        driver.quit()


if __name__ == "__main__":
    main()
