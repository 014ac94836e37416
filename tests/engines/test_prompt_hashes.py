"""Prompt hashes computed once per process per prompt object (prompt_hashes.py)."""

from __future__ import annotations

import pytest

from pddgw.engines import prompt_hashes as ph
from pddgw.engines.block_manager import chain_hashes


@pytest.fixture(autouse=True)
def fresh():
    ph.MEMO.clear()
    yield
    ph.MEMO.clear()


def test_the_hashes_are_chain_hashes_and_one_object_is_hashed_once():
    prompt = tuple(range(1000, 1100))
    first = ph.prompt_hashes(prompt, 16)
    assert first == tuple(chain_hashes(prompt, 16)) and len(first) == 6
    assert ph.prompt_hashes(prompt, 16) is first                     # reused by identity
    assert ph.prompt_hashes(prompt, 32) == tuple(chain_hashes(prompt, 32))   # per block size


def test_an_equal_prompt_of_another_object_is_hashed_afresh():
    prompt = tuple(range(100))
    first = ph.prompt_hashes(prompt, 16)
    again = ph.prompt_hashes(tuple(list(prompt)), 16)        # e.g. decoded from the wire
    assert again == first and again is not first
    assert ph.prompt_hashes([1] * 32, 16) == tuple(chain_hashes([1] * 32, 16))   # not a tuple: not kept


def test_the_cache_is_bounded_by_prompts_and_tokens(monkeypatch):
    monkeypatch.setattr(ph.MEMO, "keep", 3)
    monkeypatch.setattr(ph.MEMO, "keep_items", 250)
    prompts = [tuple(range(i, i + 100)) for i in range(4)]
    got = [ph.prompt_hashes(p, 16) for p in prompts]
    assert len(ph.MEMO) == 2 and ph.MEMO.items == 200            # the token bound: the two newest
    assert ph.MEMO.holds(prompts[2], 16) and ph.MEMO.holds(prompts[3], 16)
    assert ph.prompt_hashes(prompts[3], 16) is got[3]
    assert ph.prompt_hashes(prompts[0], 16) is not got[0]       # evicted: computed again
