"""Review of 56e3ba7 (``GET /v1/models`` asks every decode server at once).

Finding: ``_first_answer`` returns the first *response*, whatever its
status. A decode server that answers fast with an error (a 500 from a
broken server, a 404 from a wrong service on that port, a 503 from one
that is draining) now wins over a healthy one that answers a little
later, on every request. Asked one after another (before 56e3ba7) the
healthy one answered every other turn of the round-robin; now never.
Real servers on real sockets (uvicorn), nothing mocked.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")

from fastapi import FastAPI  # noqa: E402
from fastapi.responses import JSONResponse  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent / "tools"))
from test_proxy import Served  # noqa: E402

from ucm_db.tools.proxy import ProxyLimits, build_app  # noqa: E402

#: How much later the healthy decode server answers than the broken one (well under the 5 s probe timeout).
HEALTHY_DELAY_S = 0.3


def _models_server(status: int, delay_s: float) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> Any:
        await asyncio.sleep(delay_s)
        if status != 200:
            return JSONResponse({"error": {"message": "broken"}}, status_code=status)
        return {"object": "list", "data": [{"id": "served-model", "object": "model"}]}

    return app


@pytest.fixture()
def servers() -> Iterator[dict[str, str]]:
    broken, healthy = Served(_models_server(500, 0.0)), Served(_models_server(200, HEALTHY_DELAY_S))
    proxy = Served(build_app([healthy.url], [broken.url, healthy.url], limits=ProxyLimits(timeout_s=30)))
    yield {"proxy": proxy.url, "broken": broken.url, "healthy": healthy.url}
    for served in (proxy, broken, healthy):
        served.stop()


def test_models_prefers_a_healthy_decode_server_over_a_fast_error(servers: dict[str, str]) -> None:
    with httpx.Client(trust_env=False, timeout=10) as client:
        answers = [client.get(servers["proxy"] + "/v1/models") for _ in range(4)]  # both turns of the order, twice
    assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
    assert all(a.json()["data"][0]["id"] == "served-model" for a in answers)
