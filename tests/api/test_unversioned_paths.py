"""/chat/completions, /completions and /models without the /v1 prefix, as some editors send them."""

from __future__ import annotations

from tests.api.fake_engine import FakeEngine
from tests.api.harness import serve
from tests.api.test_disconnect_auth_metrics import _metric


def test_paths_without_v1_are_the_v1_endpoints_behind_the_same_key() -> None:
    """Editors configured with the server's root as base URL send /chat/completions and /models."""
    with serve(FakeEngine(), api_key="k", served_model_name="local") as running:
        auth = {"Authorization": "Bearer k"}
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert running.post("/chat/completions", body).status_code == 401
        assert running.get("/models").status_code == 401
        chat = running.post("/chat/completions", body, headers=auth)
        assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
        completion = running.post("/completions", {"prompt": "hi", "max_tokens": 2}, headers=auth)
        assert completion.status_code == 200 and completion.json()["object"] == "text_completion"
        assert running.get("/models", headers=auth).json() == running.get("/v1/models", headers=auth).json()
        assert running.get("/models/local", headers=auth).json()["id"] == "local"
        assert running.get("/modelsx", headers=auth).status_code == 404
        metrics = running.metrics()
        assert _metric(metrics, "mps_serve_http_requests_total",
                       '{endpoint="/v1/chat/completions",status="200"}') == 1
