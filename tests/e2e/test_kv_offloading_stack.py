"""The prefix cache's host tier through the real stack: the prefill instance runs with ``--kv-offloading-size`` on a
small pool. A conversation's prompt, pushed out of its KV cache by other users' prompts, comes back from host memory
the next time: the prefill counts it as a prefix hit and a load, and the openai client's text is what it was."""

from __future__ import annotations

import openai
import pytest

from tests.e2e.stack import prefill_decode_stack
from tests.engine.conftest import PROMPTS, model_path
from tests.router.router_harness import wait_until

pytestmark = pytest.mark.timeout(600)

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def stack(redis_url):  # type: ignore[no-untyped-def]
    prefill = ["--num-blocks", "24", "--kv-offloading-size", "0.05"]
    with prefill_decode_stack(redis_url, model_path(), prefill_args=prefill) as s:
        yield s


def test_a_prompt_pushed_out_of_the_prefill_s_cache_comes_back_from_host_memory(stack):  # type: ignore[no-untyped-def]
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def complete(prompt: str) -> str:
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                        extra_body={"ignore_eos": True})
        return got.choices[0].text

    mine = PROMPTS[12]  # some 150 tokens: 9 full blocks of the prefill's 24
    first = complete(mine)
    for k in range(6):  # others' prompts, sharing no block with it or each other
        complete(f"{k}: {PROMPTS[6] * 2}")
    before = stack.metrics("prefill-a")
    assert before.get("pdserve:kv_offload_saved_blocks_total", 0.0) >= 9, before
    assert complete(mine) == first

    def grew(name: str) -> float:
        return stack.metrics("prefill-a").get(name, 0.0) - before.get(name, 0.0)

    # An engine publishes its counters between steps, twice a second: they may trail the answer.
    assert wait_until(lambda: grew("pdserve:kv_offload_loaded_blocks_total") >= 9, 30, 0.1), stack.metrics("prefill-a")
    assert grew("pdserve:prefix_cache_hits_total") >= 9 * 16
