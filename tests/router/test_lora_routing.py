"""A request naming a LoRA adapter (its model one of the router's ``--lora-modules``) goes only to
instances that say they serve it, prefill and decode, and carries the adapter's name; the base model's
requests go anywhere; with no decode instance serving the adapter, a 503 naming it. Over real ZMQ and
Redis, fake engines publishing their adapters."""

from __future__ import annotations

import uuid

import httpx

from common.lora_modules import LoRAModule
from router.tokenization import PromptProcessor
from tests.router.fake_engine import FakeCluster
from tests.router.router_harness import SERVED_MODEL, RouterServer, make_state

REPLY = [5, 6, 7]
PROMPT = list(range(10, 80))  # longer than a block: through a prefill instance


def test_adapter_requests_go_only_to_instances_serving_the_adapter(redis_url: str, prompts: PromptProcessor) -> None:
    namespace = f"fake-{uuid.uuid4().hex[:8]}"
    state = make_state(prompts, redis_url=redis_url, namespace=namespace, routing_policy="round-robin",
                       lora_modules=[LoRAModule("sql", "/adapters/sql"), LoRAModule("chat", "/adapters/chat")])
    cluster = FakeCluster(redis_url, namespace, REPLY, num_prefill=2, num_decode=2, token_delay_s=0.001)
    cluster.engine("prefill-1").lora_names = ["sql"]
    cluster.engine("decode-1").lora_names = ["sql"]
    with cluster, RouterServer(state) as server:
        server.wait_ready(prefill=2, decode=2)
        for model in ("sql", SERVED_MODEL, "sql", SERVED_MODEL, "sql", SERVED_MODEL):
            response = httpx.post(f"{server.url}/v1/completions", timeout=30,
                                  json={"model": model, "prompt": PROMPT, "max_tokens": 3})
            assert response.status_code == 200, response.text
            assert response.json()["model"] == model
        taken = {i: [r.lora_name for r in cluster.engine(i).requests]
                 for i in ("prefill-0", "prefill-1", "decode-0", "decode-1")}
        assert taken["prefill-0"] == [None] * len(taken["prefill-0"])
        assert taken["prefill-1"].count("sql") == 3 and "sql" not in taken["prefill-0"]
        assert taken["decode-0"] == [] and taken["decode-1"] == []  # each decode got its KV from a prefill
        targets = {r.decode_target.instance_id for i in ("prefill-0", "prefill-1") for r in cluster.engine(i).requests
                   if r.lora_name == "sql" and r.decode_target is not None}
        assert targets == {"decode-1"}
        # Chat completions and the Responses API name it the same way.
        before = len(cluster.engine("prefill-1").requests)
        chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
            "model": "sql", "messages": [{"role": "user", "content": "x " * 40}], "max_tokens": 3})
        assert chat.status_code == 200 and chat.json()["model"] == "sql", chat.text
        responses = httpx.post(f"{server.url}/v1/responses", timeout=30,
                               json={"model": "sql", "input": "y " * 40, "max_output_tokens": 3, "store": False})
        assert responses.status_code == 200 and responses.json()["model"] == "sql", responses.text
        assert [r.lora_name for r in cluster.engine("prefill-1").requests[before:]] == ["sql", "sql"]
        # Not served by any decode instance: refused by name, nothing sent.
        response = httpx.post(f"{server.url}/v1/completions", timeout=30,
                              json={"model": "chat", "prompt": PROMPT, "max_tokens": 3})
        assert response.status_code == 503
        assert "no decode instance serving LoRA adapter 'chat'" in response.json()["error"]["message"]
        assert sum(len(cluster.engine(i).requests) for i in taken) == 8
