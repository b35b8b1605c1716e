"""The router tests' shared fixture: a client of the module's ``router``."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from kvloom.router.main import BackgroundRouter


@pytest.fixture
def http(router: BackgroundRouter) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=router.base_url, timeout=60) as client:
        yield client
