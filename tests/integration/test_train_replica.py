"""Trainer and replica together: rollouts sampled from a replica train an adapter that the trainer
pushes back, and the replica then samples with exactly the trainer's model."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from burstrl.store import Rollout, RolloutStore, Turn
from tests.http_client import HTTP

from .conftest import ADMIN_TOKEN, Server
from .test_train import metrics, run_train

PROMPTS = ["Name a color.", "Say a number.", "Write a word.", "Pick a letter."]


def sample_group(server: Server, model: str, prompt: str, tag: str, size: int, seed: int) -> list[Rollout]:
    """`size` sessions answering one prompt; turns come from the replica's own capture."""
    rng = random.Random(seed)
    rollouts = []
    for i in range(size):
        sid = f"{tag}-{i}"
        r = HTTP.post(server.url + "/v1/chat/completions", timeout=60, json={
            "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 6,
            "temperature": 1.0, "seed": rng.randrange(10**6), "session_id": sid})
        assert r.status_code == 200, r.text
        calls = HTTP.get(f"{server.url}/v1/traces/{sid}?full=true", headers=server.admin()).json()["calls"]
        version = 0 if model == "base" else int(model.removeprefix("policy-v"))
        turns = [Turn(prompt_ids=c["prompt_ids"], completion_ids=c["completion_ids"], logprobs=c["logprobs"],
                      version=version, replica=server.url) for c in calls]
        rollouts.append(Rollout(id=sid, turns=turns, reward=float(len(r.json()["choices"][0]["message"]["content"]) % 3)))
        HTTP.delete(f"{server.url}/v1/traces/{sid}", headers=server.admin())
    return rollouts


@pytest.mark.slow
def test_trained_versions_are_pushed_and_served_exactly(server: Server, tiny_model_dir: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with RolloutStore(run_dir / "store.sqlite") as store:
        for g, prompt in enumerate(PROMPTS):
            store.put_group(f"t{g}", sample_group(server, "base", prompt, f"g{g}", size=4, seed=g))
    r = run_train(run_dir, tiny_model_dir, "--trainer.steps", "2", "--trainer.max_staleness", "2",
                  "--weights.replicas", json.dumps([server.url]), env={"BURSTRL_ADMIN_TOKEN": ADMIN_TOKEN})
    assert r.returncode == 0, r.stderr[-3000:]
    # one rank pushes in the background: a step's line reports the push that finished before it
    # (step 1's, in step 2's line), and the trainer exits only after the last push landed
    lines = metrics(run_dir)
    assert "push_ok" not in lines[0] and (lines[1]["push_version"], lines[1]["push_ok"]) == (1, 1)
    served = [m["id"] for m in server.get("/v1/models")["data"]]
    assert {"policy-v1", "policy-v2"} <= set(served)

    # sample with the pushed version and score the same tokens with the trainer's own checkpoint
    rollout = sample_group(server, "policy-v2", PROMPTS[0], "check", size=1, seed=99)[0]
    turn = rollout.turns[0]
    from peft import PeftModel

    from burstrl.model.hf import load_model

    model = PeftModel.from_pretrained(load_model(tiny_model_dir, "float32", "cpu"),
                                      str(run_dir / "checkpoints" / "step-2" / "adapter"))
    ids = turn.prompt_ids + turn.completion_ids
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    start = len(turn.prompt_ids)
    want = logp[start - 1:-1].gather(1, torch.tensor(turn.completion_ids)[:, None])[:, 0]
    assert (torch.tensor(turn.logprobs) - want).abs().max().item() < 1e-4
    base = PeftModel.from_pretrained(load_model(tiny_model_dir, "float32", "cpu"),
                                     str(run_dir / "checkpoints" / "step-2" / "adapter"))
    with torch.no_grad(), base.disable_adapter():
        base_logp = torch.log_softmax(base(torch.tensor([ids])).logits[0].float(), dim=-1)
    assert (base_logp[start - 1:-1].gather(1, torch.tensor(turn.completion_ids)[:, None])[:, 0] - want).abs().max() > 1e-3
