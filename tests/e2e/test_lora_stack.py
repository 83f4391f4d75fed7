"""LoRA adapters through the real stack: a prefill and a decode instance both serving a PEFT adapter
(``--enable-lora --lora-modules``) behind the router; the openai client names the adapter as its model.
Its streamed greedy text through prefill -> KV transfer -> decode equals PEFT's own ``generate``; the
base model's text for the same prompt, sent after it, equals transformers' (the prefill's cached blocks
of the adapter are not the base model's); /v1/models lists the adapter under the base model. A second
adapter loaded at run time (vLLM's /v1/load_lora_adapter) into every engine's free slot serves PEFT's
text too, refuses to be loaded twice, is loaded by an engine started after it (the cluster keeps it in Redis),
and is gone from every engine once unloaded."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from common.registry import Registry, RuntimeAdapters
from tests.e2e.stack import prefill_decode_stack
from tests.engine.conftest import PROMPTS, hf_greedy, model_path, tokenizer
from tests.engine.tiny_models import peft_adapter, peft_greedy
from tests.router.router_harness import wait_until

pytestmark = pytest.mark.timeout(600)

MODEL = "SmolLM2-135M-Instruct"
PROMPT = PROMPTS[6]  # long enough to go prefill -> KV transfer -> decode
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return peft_adapter(Path(model_path()), tmp_path_factory.mktemp("lora") / "sql", r=8, lora_alpha=16, scale=2.0,
                        target_modules=["v_proj", "o_proj", "up_proj", "down_proj"])


ENGINE_ARGS: list[str] = []  # the engines' LoRA flags, set by the stack


@pytest.fixture(scope="module")
def stack(redis_url, adapter):  # type: ignore[no-untyped-def]
    module = f"sql={adapter}"
    ENGINE_ARGS[:] = ["--enable-lora", "--lora-modules", module, "--max-loras", "2"]
    with prefill_decode_stack(redis_url, model_path(), router_args=["--lora-modules", module,
                                                                    "--allow-runtime-lora-updating"],
                              decode_args=ENGINE_ARGS, prefill_args=ENGINE_ARGS) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _text(ids: list[int]) -> str:
    return tokenizer().decode(ids, skip_special_tokens=True)


def test_the_adapter_s_streamed_text_is_pefts_and_the_base_model_s_is_transformers(stack, client, adapter):  # type: ignore[no-untyped-def]
    prompt_ids = tokenizer()(PROMPT).input_ids
    expected = _text(peft_greedy(Path(model_path()), adapter, prompt_ids, MAX_TOKENS))
    base = _text(list(hf_greedy(tuple(prompt_ids), MAX_TOKENS)))
    assert expected != base  # the adapter changes the text: a request run without it would fail
    kwargs = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "extra_body": {"ignore_eos": True}}
    events = list(client.completions.create(model="sql", stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in events if c.choices) == expected
    assert {c.model for c in events} == {"sql"}
    # Again, now from the prefill instance's prefix cache (the adapter's blocks), and then the base model.
    assert client.completions.create(model="sql", **kwargs).choices[0].text == expected
    assert client.completions.create(model=MODEL, **kwargs).choices[0].text == base
    # (An engine publishes its counters between steps, twice a second: they may trail the answer.)
    assert wait_until(lambda: stack.metrics("prefill-a").get("pdserve:prefix_cache_hits_total", 0.0) > 0, 30, 0.1)


def test_models_lists_the_adapter_under_the_base_model_and_an_unknown_name_is_a_404(client, adapter):  # type: ignore[no-untyped-def]
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {MODEL, "sql"}
    assert cards["sql"].parent == MODEL and cards["sql"].root == str(adapter.resolve())
    assert client.models.retrieve("sql").parent == MODEL
    with pytest.raises(openai.NotFoundError, match="the model 'nope' does not exist"):
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)


def test_an_adapter_loaded_at_run_time_serves_pefts_text_until_unloaded(stack, client, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    chat = peft_adapter(Path(model_path()), tmp_path / "chat", seed=3, r=4, lora_alpha=8, scale=2.0,
                        target_modules=["v_proj", "down_proj"])
    prompt_ids = tokenizer()(PROMPT).input_ids
    expected = _text(peft_greedy(Path(model_path()), chat, prompt_ids, MAX_TOKENS))
    loaded = httpx.post(f"{stack.url}/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": str(chat)},
                        timeout=120)
    assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'chat' added successfully."
    assert {m.id for m in client.models.list().data} == {MODEL, "sql", "chat"}
    kwargs = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "extra_body": {"ignore_eos": True}}
    assert client.completions.create(model="chat", **kwargs).choices[0].text == expected
    # Both slots of --max-loras 2 are taken: a third is refused by every instance, named.
    full = httpx.post(f"{stack.url}/v1/load_lora_adapter", json={"lora_name": "third", "lora_path": str(chat)},
                      timeout=120)
    assert full.status_code == 400 and "no free LoRA slot" in full.json()["error"]["message"]
    assert "prefill-a" in full.json()["error"]["message"] and "decode-a" in full.json()["error"]["message"]
    again = httpx.post(f"{stack.url}/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": str(chat)},
                       timeout=120)
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    # The cluster keeps it: an engine started after the load (restarted, or added) loads it with its own.
    assert RuntimeAdapters(stack.redis_url).all() == {"chat": str(chat)}
    later = stack.start_engine("decode", "decode-b", ENGINE_ARGS)
    try:
        assert wait_until(lambda: {a for i in Registry(stack.redis_url).instances() if i.instance_id == "decode-b"
                                   for a in i.lora_names} == {"sql", "chat"}, 300, 0.3), later.log()
        unloaded = httpx.post(f"{stack.url}/v1/unload_lora_adapter", json={"lora_name": "chat"}, timeout=120)
        assert unloaded.status_code == 200, unloaded.text
        assert RuntimeAdapters(stack.redis_url).all() == {}
        # Every engine drops it (the one started later by the router's update or from the cluster's list), and
        # the router's own view of them, which it refreshes from the registry, follows.
        assert wait_until(lambda: all(i.lora_names == ["sql"] for i in Registry(stack.redis_url).instances())
                          and "chat" not in {m.id for m in client.models.list().data}, 30, 0.3), later.log()
    finally:
        later.stop()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="chat", **kwargs)
    again = httpx.post(f"{stack.url}/v1/unload_lora_adapter", json={"lora_name": "chat"}, timeout=120)
    assert again.status_code == 404
