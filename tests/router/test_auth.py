"""API keys: bearer check, and one stable cache salt per key so tenants never share blocks."""

from __future__ import annotations

import pytest

from common.kvcache.hashing import compute_block_hashes
from router.auth import ApiKeys, cache_salt_for, keys_from_env
from router.errors import APIError


def test_without_keys_everyone_passes_with_no_salt() -> None:
    assert ApiKeys([]).check(None) is None


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer ", "Basic key-a", "Bearer key-c", "key-a"])
def test_missing_or_wrong_key_is_401(header: str | None) -> None:
    with pytest.raises(APIError) as info:
        ApiKeys(["key-a", "key-b"]).check(header)
    assert info.value.status == 401 and info.value.code == "invalid_api_key"


def test_each_key_gets_its_own_stable_salt() -> None:
    keys = ApiKeys(["key-a", "key-b"])
    salt_a, salt_b = keys.check("Bearer key-a"), keys.check("bearer key-b")
    assert salt_a == cache_salt_for("key-a") == keys.check("Bearer key-a")
    assert salt_a != salt_b and salt_a is not None and len(salt_a) == 32
    assert "key-a" not in salt_a


def test_tenants_prompts_hash_to_different_blocks() -> None:
    tokens = list(range(64))
    a = compute_block_hashes(tokens, 16, "m", cache_salt_for("key-a"))
    b = compute_block_hashes(tokens, 16, "m", cache_salt_for("key-b"))
    assert not set(a) & set(b)


def test_keys_from_env_split_on_commas() -> None:
    assert keys_from_env({"PDSERVE_API_KEYS": " k1, ,k2 "}) == ["k1", "k2"]
    assert keys_from_env({}) == []
