"""KV never crosses adapter versions: prefix sharing is keyed by (version, tokens).

The repro of issue 14: a 100-id prompt on `policy-v1`, then the same prompt on `base` in another
session, used to report 99 cached tokens and return ids/logprobs computed on policy-v1's keys and
values (up to 0.78 nats off). Every answer here must equal a solo run and an HF/PEFT forward.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest
import torch

from tests.http_client import HTTP

from .conftest import Server

VERSIONS = ("base", "policy-v1", "policy-v2")


@pytest.fixture(scope="module")
def loaded(server: Server, adapters: dict[str, Path]) -> Server:
    for name, path in adapters.items():
        r = HTTP.post(server.url + "/v1/load_lora_adapter", headers=server.admin(),
                      json={"lora_name": name, "lora_path": str(path)}, timeout=60)
        assert r.status_code == 200, r.text
    return server


@pytest.fixture(scope="module")
def references(tiny_model_dir: Path, adapters: dict[str, Path]):
    """version -> HF model (PEFT-wrapped for adapters): the independent forward pass."""
    from peft import PeftModel

    from burstrl.model.hf import load_model

    models = {"base": load_model(tiny_model_dir, "float32", "cpu")}
    for name, path in adapters.items():
        models[name] = PeftModel.from_pretrained(load_model(tiny_model_dir, "float32", "cpu"), str(path))
    return models


def complete(server: Server, session: str, model: str, prompt: list[int], n: int = 8) -> dict:
    body = {"model": model, "prompt": prompt, "session_id": session, "temperature": 0, "max_tokens": n,
            "ignore_eos": True, "logprobs": 0, "return_token_ids": True}
    r = HTTP.post(server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def reference(models: dict, version: str, prompt: list[int], completion: list[int]) -> torch.Tensor:
    ids = prompt + completion
    with torch.no_grad():
        logits = models[version](torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return logp[len(prompt) - 1:-1].gather(1, torch.tensor(completion)[:, None])[:, 0]


def assert_exact(models: dict, version: str, prompt: list[int], answer: dict) -> None:
    choice = answer["choices"][0]
    ids, got = choice["token_ids"], torch.tensor(choice["logprobs"]["token_logprobs"])
    ref = reference(models, version, prompt, ids)
    assert (got - ref).abs().max().item() < 1e-4, (version, (got - ref).abs().max().item())
    greedy = reference_greedy(models[version], prompt, len(ids))
    assert ids == greedy, version


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_a_prefix_cached_under_one_version_is_not_reused_by_another(loaded: Server, references) -> None:
    prompt = [random.Random(0).randrange(5, 200) for _ in range(100)]
    first = complete(loaded, "mv-a", "policy-v1", prompt)
    assert_exact(references, "policy-v1", prompt, first)
    other = complete(loaded, "mv-b", "base", prompt)
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert_exact(references, "base", prompt, other)
    same = complete(loaded, "mv-c", "policy-v1", prompt)  # same version: sharing still works
    assert same["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) - 1
    assert same["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]


def test_mixed_version_groups_with_a_shared_prompt_are_exact(loaded: Server, references) -> None:
    """3 requests on each of 3 versions with one long prompt, all at once: each equals its solo run."""
    prompt = [random.Random(1).randrange(5, 200) for _ in range(140)]
    solo = {v: complete(loaded, f"solo-{v}", v, prompt) for v in VERSIONS}
    for v in VERSIONS:
        assert_exact(references, v, prompt, solo[v])
    answers: dict[tuple[str, int], dict] = {}
    start = threading.Barrier(9)

    def run(version: str, i: int) -> None:
        start.wait()
        answers[(version, i)] = complete(loaded, f"grp-{version}-{i}", version, prompt)

    threads = [threading.Thread(target=run, args=(v, i)) for v in VERSIONS for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    shared = 0
    for (version, _), answer in answers.items():
        choice, want = answer["choices"][0], solo[version]["choices"][0]
        assert choice["token_ids"] == want["token_ids"], version
        got, ref = choice["logprobs"]["token_logprobs"], want["logprobs"]["token_logprobs"]
        assert max(abs(a - b) for a, b in zip(got, ref, strict=False)) < 1e-4, version
        shared += answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert shared >= 6  # within each version the group still shares its prompt (on by default)
