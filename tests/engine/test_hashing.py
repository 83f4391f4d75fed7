"""Block hashes: stable across processes, sensitive to every input, full blocks only, incremental."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from common.engine.request import Request
from common.kvcache.hashing import HASH_SCHEME, compute_block_hashes, extra_keys_for, hash_block_tokens
from common.sampling_params import SamplingParams

BS = 16
MODEL = "SmolLM2-135M-Instruct@abc123"
TOKENS = [(i * 7919 + 13) % 49152 for i in range(5 * BS + 3)]

_CHILD = """
import json, sys
from common.kvcache.hashing import compute_block_hashes
args = json.loads(sys.argv[1])
print(json.dumps([h.hex() for h in compute_block_hashes(*args)]))
"""


def test_same_input_gives_same_hashes_in_another_process():
    here = [h.hex() for h in compute_block_hashes(TOKENS, BS, MODEL, "tenant-1")]
    # A different PYTHONHASHSEED in the child: the hash must not depend on Python's hash().
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps([TOKENS, BS, MODEL, "tenant-1"])],
        capture_output=True, text=True, check=True, env=env, timeout=120,
    )
    assert json.loads(out.stdout) == here
    assert len(here) == 5 and all(len(bytes.fromhex(h)) == 32 for h in here)
    assert compute_block_hashes(TOKENS, BS, MODEL, "tenant-1") == compute_block_hashes(
        list(TOKENS), BS, MODEL, "tenant-1"
    )


def test_cache_salt_model_parent_and_each_token_change_the_hash():
    block = TOKENS[:BS]
    base = hash_block_tokens(None, block, extra_keys_for(MODEL, None))
    variants = {
        "salt": hash_block_tokens(None, block, extra_keys_for(MODEL, "tenant-1")),
        "other salt": hash_block_tokens(None, block, extra_keys_for(MODEL, "tenant-2")),
        "empty salt": hash_block_tokens(None, block, extra_keys_for(MODEL, "")),
        "model": hash_block_tokens(None, block, extra_keys_for(MODEL + "x", None)),
        "parent": hash_block_tokens(base, block, extra_keys_for(MODEL, None)),
        "other parent": hash_block_tokens(hash_block_tokens(None, [1] * BS), block, extra_keys_for(MODEL, None)),
        # The encoding is length-prefixed: moving a boundary between keys changes the hash.
        "split keys": hash_block_tokens(None, block, (MODEL[:5], MODEL[5:])),
    }
    for name, h in variants.items():
        assert h != base, f"{name} did not change the hash"
    assert len(set(variants.values())) == len(variants)
    for i in range(BS):
        for delta in (1, -1):
            changed = list(block)
            changed[i] = (changed[i] + delta) % 49152
            assert hash_block_tokens(None, changed, extra_keys_for(MODEL, None)) != base, f"token {i}"
    # The whole chain diverges from the first differing block on, and not before.
    a = compute_block_hashes(TOKENS, BS, MODEL)
    changed = list(TOKENS)
    changed[2 * BS + 5] += 1
    b = compute_block_hashes(changed, BS, MODEL)
    assert a[:2] == b[:2] and all(x != y for x, y in zip(a[2:], b[2:], strict=True))


def test_only_full_blocks_are_hashed():
    assert compute_block_hashes(TOKENS[: BS - 1], BS, MODEL) == []
    assert len(compute_block_hashes(TOKENS[:BS], BS, MODEL)) == 1
    two = compute_block_hashes(TOKENS[: 2 * BS], BS, MODEL)
    for n in range(2 * BS, 3 * BS):
        assert compute_block_hashes(TOKENS[:n], BS, MODEL) == two, n
    assert len(compute_block_hashes(TOKENS[: 3 * BS], BS, MODEL)) == 3


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 49151), max_size=120),
    block_size=st.sampled_from([1, 4, 8, 16]),
    salt=st.one_of(st.none(), st.text(max_size=8)),
    data=st.data(),
)
def test_incremental_hashing_equals_hashing_from_scratch(tokens, block_size, salt, data):
    full = compute_block_hashes(tokens, block_size, MODEL, salt)
    assert len(full) == len(tokens) // block_size
    start = data.draw(st.integers(0, len(full)), label="start")
    parent = full[start - 1] if start else None
    assert compute_block_hashes(tokens, block_size, MODEL, salt, start=start, parent=parent) == full[start:]


def test_the_encoding_is_pinned_by_known_digests():
    """Processes of different versions share the prefix index in Redis: a change to the bytes hashed
    must come with a new ``HASH_SCHEME``, never silently. Digests of the sha256-v1 encoding."""
    assert HASH_SCHEME == "sha256-v1"
    first = "022e5e3c55feac7364be432ec530c36fa0c2b1f925ee314a612f4fa114605024"
    second = "96af88a6985f32b83ee5640504d80375cfb7946f384fc8119b9def6f38ace83b"  # parent first, salted
    assert hash_block_tokens(None, list(range(16)), ("m",)).hex() == first
    assert hash_block_tokens(bytes.fromhex(first), [49151] * 16, ("m", "salt")).hex() == second
    assert [h.hex() for h in compute_block_hashes([*range(16), 9, 9], 16, "m")] == [first]
    chained = compute_block_hashes([*range(16), *[49151] * 16], 16, "m", "salt", start=1, parent=bytes.fromhex(first))
    assert [h.hex() for h in chained] == [second]


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**63 - 1), max_size=70),
    block_size=st.sampled_from([1, 3, 16]),
    salt=st.one_of(st.none(), st.text(max_size=8)),
    model=st.text(max_size=12),
)
def test_hashing_a_sequence_equals_hashing_its_blocks_one_by_one(tokens, block_size, salt, model):
    """``compute_block_hashes`` builds each block's bytes its own way: the same digests as the chain of
    ``hash_block_tokens``, the reference, for any ids, block size, model and salt (non-ASCII too)."""
    extra = extra_keys_for(model, salt)
    parent = None
    expected = []
    for i in range(len(tokens) // block_size):
        parent = hash_block_tokens(parent, tokens[i * block_size : (i + 1) * block_size], extra)
        expected.append(parent)
    assert compute_block_hashes(tokens, block_size, model, salt) == expected
    assert compute_block_hashes(tuple(tokens), block_size, model, salt) == expected


@settings(max_examples=25, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 49151), min_size=1, max_size=40),
    outputs=st.lists(st.integers(0, 49151), max_size=40),
    salt=st.one_of(st.none(), st.just("s")),
)
def test_request_hashes_grow_token_by_token_like_from_scratch(prompt, outputs, salt):
    req = Request("r", prompt, SamplingParams(), block_size=8, model_id=MODEL, cache_salt=salt)
    for t in outputs:
        req.append_output_token(t)
        assert req.block_hashes == compute_block_hashes(req.all_token_ids, 8, MODEL, salt)
    child = req.fork("r#1", seed_offset=1)
    child.append_output_token(7)
    assert child.block_hashes == compute_block_hashes(child.all_token_ids, 8, MODEL, salt)
    assert req.block_hashes == compute_block_hashes(req.all_token_ids, 8, MODEL, salt)


def test_an_image_changes_the_hashes_of_the_blocks_it_reaches_and_those_after() -> None:
    """The same tokens with another image (another digest, or the same one elsewhere) differ from the first
    block the image reaches on (the chain carries it); the blocks before it are text's; a salt that spells
    an image's key is not one (the image is hashed under a tag of its own)."""
    digest_a, digest_b = "a" * 64, "b" * 64
    plain = compute_block_hashes(TOKENS, BS, MODEL)
    with_a = compute_block_hashes(TOKENS, BS, MODEL, images=[(2 * BS + 3, BS, digest_a)])  # blocks 2 and 3
    with_b = compute_block_hashes(TOKENS, BS, MODEL, images=[(2 * BS + 3, BS, digest_b)])
    moved = compute_block_hashes(TOKENS, BS, MODEL, images=[(2 * BS + 4, BS, digest_a)])
    assert with_a[:2] == plain[:2] == with_b[:2] == moved[:2]
    for other in (plain, with_b, moved):
        assert not set(with_a[2:]) & set(other[2:])
    assert compute_block_hashes(TOKENS, BS, MODEL, images=[(5 * BS, 3, digest_a)]) == plain  # past the full blocks
    assert compute_block_hashes(TOKENS, BS, MODEL, f"{2 * BS + 3}:{digest_a}") != with_a
    # Incremental hashing from a block after the image equals hashing from scratch.
    images = [(BS - 2, 4, digest_a)]
    whole = compute_block_hashes(TOKENS, BS, MODEL, images=images)
    assert whole[:2] + compute_block_hashes(TOKENS, BS, MODEL, start=2, parent=whole[1], images=images) == whole
    assert whole[0] != plain[0] and whole[1] != plain[1]
