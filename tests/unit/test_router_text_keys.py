"""Prefix keys of text and chat prompts (router/text_keys.py) and how the router places by them."""

from __future__ import annotations

import random
import time

from burstrl.protocol.blocks import BLOCK_TOKENS, cache_scope
from burstrl.router import tenancy
from burstrl.router.registry import Registry
from burstrl.router.server import prompt_blocks, prompt_keys
from burstrl.router.tenancy import RouteCaller
from burstrl.router.text_keys import CHUNK_CHARS, CHUNK_TOKENS, MAX_CHUNKS, serialize, text_prefix_keys

SYSTEM = {"role": "system", "content": "You solve puzzles. " * 40}


def chat(question: str, **extra) -> dict:
    return {"model": "base", "messages": [SYSTEM, {"role": "user", "content": question}], **extra}


def keys(body: dict, scope: str = "base") -> tuple[int, ...]:
    return text_prefix_keys(body, scope)


def test_the_same_prompt_gives_the_same_keys_and_key_order_does_not_matter() -> None:
    body = chat("What is 2 + 2?")
    assert len(keys(body)) >= 7 and keys(body) == keys(chat("What is 2 + 2?", max_tokens=9, session_id="s2"))
    reordered = {"model": "base", "messages": [{"content": m["content"], "role": m["role"]} for m in body["messages"]]}
    assert keys(reordered) == keys(body)  # canonical: the client's key order is not the prompt
    assert keys(chat("What is 2 + 3?")) != keys(body)
    assert keys({"model": "base"}) == () and keys({"messages": []}) == () and keys({"prompt": [1, 2, 3]}) == ()


def test_scope_salt_version_tenant_and_kind_separate_keys() -> None:
    body = chat("q")
    assert keys(body, cache_scope("base", None)) != keys(body, cache_scope("policy-v1", None))
    assert keys(body, cache_scope("base", "a")) != keys(body, cache_scope("base", "b"))
    assert keys(body, cache_scope("base", "a")) != keys(body, cache_scope("base", None))
    a, b = RouteCaller("run-a"), RouteCaller("run-b")
    assert prompt_keys(body, "base", a)[0] != prompt_keys(body, "base", b)[0]
    assert prompt_keys(body, "base", a)[0] != prompt_keys(body, "base", tenancy.FLEET)[0]
    text = "You solve puzzles. " * 40
    assert set(keys({"prompt": text})).isdisjoint(keys({"messages": [{"role": "user", "content": text}]}))
    assert keys({"prompt": text}) == keys({"prompt": [text]}) != keys({"prompt": text, "add_special_tokens": False})


def test_one_changed_character_changes_keys_from_its_chunk_on() -> None:
    text = "".join(random.Random(0).choice("abcdefgh ") for _ in range(20 * CHUNK_CHARS))
    base = keys({"prompt": text})
    for pos in (5, 7 * CHUNK_CHARS + 3, 19 * CHUNK_CHARS + 100):
        changed = keys({"prompt": text[:pos] + "Z" + text[pos + 1:]})
        k = (pos + len(serialize([{"add_special_tokens": True}], 10**6)) + 1) // CHUNK_CHARS  # the prompt's line
        assert changed[:k] == base[:k] and all(x != y for x, y in zip(changed[k:], base[k:], strict=True))


def test_a_longer_conversation_extends_the_keys_of_the_shorter() -> None:
    short = chat("first question " * 30)
    longer = {**short, "messages": [*short["messages"], {"role": "assistant", "content": "an answer"}]}
    a, b = keys(short), keys(longer)
    assert len(b) >= len(a) and a[:-1] == b[:len(a) - 1]  # all but the short one's partial last chunk


def test_tools_count_unless_tool_choice_none() -> None:
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    plain = chat("q")
    assert keys({**plain, "tools": [tool]}) != keys(plain)
    assert keys({**plain, "tools": [tool], "tool_choice": "none"}) == keys(plain)
    assert keys({**plain, "tools": []}) == keys(plain)


def test_caps_hold_on_a_ten_megabyte_body_quickly() -> None:
    big = "x" * (10 << 20)
    hostile = [
        {"prompt": big},
        {"messages": [{"role": "user", "content": big}]},
        {"messages": [{"role": "user", "content": "a"}] * 400_000},
        {"messages": [{"role": "user", "content": "q"}], "tools": [{str(i): i for i in range(300_000)}]},
        {"messages": [{"role": "user", "content": [[[[[[[["deep"]]]]]]]] * 100_000}]},
    ]
    for body in hostile:
        start = time.perf_counter()
        assert len(keys(body)) == MAX_CHUNKS and time.perf_counter() - start < 2.0
    nested: list = ["bottom"]
    for _ in range(5000):  # deeper than the interpreter's stack: walked only MAX_DEPTH deep
        nested = [nested]
    start = time.perf_counter()
    assert 0 < len(keys({"messages": [{"role": "user", "content": nested}]})) < 5
    assert time.perf_counter() - start < 2.0
    assert len(keys({"prompt": big}, "base")) == MAX_CHUNKS


def test_prompt_keys_prefers_token_blocks_and_can_be_switched_off() -> None:
    tokens = list(range(100, 100 + 3 * BLOCK_TOKENS))
    assert prompt_keys({"prompt": tokens}, "base") == (prompt_blocks({"prompt": tokens}, "base"), BLOCK_TOKENS)
    body = chat("q")
    assert prompt_keys(body, "base") == (keys(body), CHUNK_TOKENS)
    assert prompt_keys(body, "base", text=False) == ((), BLOCK_TOKENS)
    assert prompt_blocks(body, "base") == ()  # token blocks stay what the replicas summarise


def test_a_group_with_one_text_prompt_lands_on_one_replica_and_other_prompts_spread() -> None:
    """Through the registry as the proxy calls it: G=4 siblings follow the first (recent placements),
    while sessions with different prompts are placed by load."""
    reg = Registry(policy="kv", k=2, seed=3)
    for url in ("http://r0", "http://r1", "http://r2"):
        reg.add(url)
        reg.apply_scrape(url, {"num_used_tokens": 0, "max_total_num_tokens": 200_000, "versions": ["base"],
                               "sessions": []}, {"object": "list", "data": [{"id": "base"}]})
    homes: dict[int, set[str]] = {}
    for g in range(3):
        body = chat(f"group {g}: " + "a long puzzle statement " * 150)  # ~1100 tokens: worth 4 siblings' load
        for i in range(4):
            hashes, per = prompt_keys(body, "base")
            homes.setdefault(g, set()).add(reg.place(f"g{g}-{i}", "base", 0, "default", hashes, per).id)
    assert all(len(h) == 1 for h in homes.values())
    spread = {reg.place(f"solo{i}", "base", 0, "default", *prompt_keys(chat(f"solo {i} " * 100), "base")).id
              for i in range(12)}
    assert len(spread) >= 2
