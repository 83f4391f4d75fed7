"""Schema-driven fuzzing of the live router (real prefill and decode engines) with schemathesis.

Requests generated from the router's own ``/openapi.json``, valid and invalid, go to the main
operations; every answer must be a non-5xx status the document declares, with the declared content
type and a body matching the declared schema. The engines run with a small context
(``--max-model-len``) and the router caps output tokens per request, so any generated request ends
in seconds on a CPU. A count of cases per operation and of each status is printed at the end.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import (  # noqa: E402
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from tests.conftest import RedisServer  # noqa: E402
from tests.e2e.stack import Stack  # noqa: E402
from tests.engine.conftest import model_path  # noqa: E402

pytestmark = pytest.mark.timeout(600)

MAX_EXAMPLES = 10  # per operation and mode: CI-sized; raise it by hand for a longer run
OPERATIONS = (
    "POST /v1/completions", "POST /v1/chat/completions", "POST /v1/responses", "GET /v1/models", "GET /health",
    "GET /v1/responses/{response_id}", "DELETE /v1/responses/{response_id}",
    "GET /v1/responses/{response_id}/input_items", "POST /v1/responses/{response_id}/cancel",
)
STATUSES: Counter[str] = Counter()


@pytest.fixture(scope="module")
def live_router() -> Iterator[Stack]:
    redis = RedisServer()
    s = Stack(redis_url=redis.url, model=model_path())
    small = ["--max-model-len", "96"]
    s.start_engine("prefill", "prefill-s", small)
    s.start_engine("decode", "decode-s", small)
    s.start_router(["--max-total-tokens-per-request", "128", "--request-timeout", "60"])
    try:
        s.wait_ready(1, 1)
        yield s
    finally:
        print(f"\nschemathesis cases by operation and status: {dict(sorted(STATUSES.items()))}")
        for proc in s.procs.values():
            assert proc.popen.poll() is None, f"{proc.name} died:\n{proc.log()}"
        s.stop()
        redis.stop()


@pytest.fixture(scope="module")
def operations(live_router: Stack) -> dict[str, Any]:
    loaded = schemathesis.openapi.from_url(live_router.url + "/openapi.json")
    found = {result.ok().label: result.ok() for result in loaded.get_all_operations()}
    assert set(OPERATIONS) <= set(found), sorted(found)
    return {label: found[label] for label in OPERATIONS}


# The operations are driven by hand (schemathesis' pytest plugin does not load under this pytest).
# Negative (schema-violating) cases only where there is a request to violate: the POST bodies (a cancel
# has none, only an id in its path, which any string is).
@pytest.mark.parametrize(
    ("label", "mode"),
    [*((label, GenerationMode.POSITIVE) for label in OPERATIONS),
     *((label, GenerationMode.NEGATIVE) for label in OPERATIONS if label.startswith("POST") and "{" not in label)],
    ids=lambda value: getattr(value, "value", value),
)
def test_the_router_answers_generated_requests_as_its_schema_says(operations, live_router, label, mode) -> None:  # type: ignore[no-untyped-def]
    operation = operations[label]

    @settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(case=operation.as_strategy(generation_mode=mode))
    def one(case: Any) -> None:
        response = case.call_and_validate(
            base_url=live_router.url, timeout=120,
            checks=[not_a_server_error, status_code_conformance, content_type_conformance,
                    response_schema_conformance],
        )
        STATUSES[f"{label} ({mode.value}) {response.status_code}"] += 1

    one()


@pytest.mark.parametrize(("label", "body"), [
    ("POST /v1/completions", {"prompt": "Once upon", "max_tokens": 4, "stream": True}),
    ("POST /v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}),
])
def test_a_stream_conforms_event_by_event(operations, live_router, label, body) -> None:  # type: ignore[no-untyped-def]
    """Generated cases stream only now and then: a streaming request of each endpoint, every time. Each
    server-sent event is checked against what the document says an event is."""
    response = operations[label].Case(body=body, media_type="application/json").call_and_validate(
        base_url=live_router.url, timeout=120,
        checks=[not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance],
    )
    assert response.status_code == 200 and response.text.rstrip().endswith("data: [DONE]")
