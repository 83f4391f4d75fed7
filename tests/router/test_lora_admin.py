"""vLLM's runtime LoRA updating at the router, without engines: a load that no instance could take leaves nothing in
the cluster's runtime adapters for engines that start later (the real stack's tests: ``tests/e2e/test_lora_stack.py``)."""

from __future__ import annotations

import uuid

from fastapi.testclient import TestClient

from common.registry import RuntimeAdapters
from router.app import create_app
from router.tokenization import PromptProcessor
from tests.router.router_harness import make_state


def test_a_load_no_instance_takes_is_a_503_and_leaves_no_adapter_for_later_engines(
    redis_url: str, prompts: PromptProcessor
) -> None:
    namespace = f"lora-{uuid.uuid4().hex[:8]}"
    state = make_state(prompts, redis_url=redis_url, namespace=namespace, allow_runtime_lora_updating=True)
    with TestClient(create_app(state)) as client:
        response = client.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": "/adapters/chat"})
    assert response.status_code == 503, response.text
    assert RuntimeAdapters(redis_url, namespace).all() == {}
