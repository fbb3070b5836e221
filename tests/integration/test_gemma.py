"""The real model: Gemma 3 270M (pretrained, imported from its GGUF package) served by one replica.

One replica serves the module (its start, with the probe, is most of the cost). What it shows: the
engine proves its fast runner on a real checkpoint (Gemma 3's four norms, per-layer-type rope and
sliding windows), greedy text is the pretrained model's, and captured logprobs equal an fp32 HF forward
over a session that runs past the 512-token sliding window (the second call prefills only its
suffix from the session cache), and the trainer takes a LoRA step on Gemma from rollouts the
replica captured, recomputing their logprobs exactly (importance ratio 1 at step 1).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from burstrl.store import Rollout, RolloutStore, Turn
from tests.http_client import HTTP

from .conftest import Server, sampled_logprobs, start_server, stop_server
from .test_train import metrics, run_train

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(gemma_model: Path, tmp_path_factory: pytest.TempPathFactory):
    srv = start_server(gemma_model, tmp_path_factory.mktemp("gemma-replica"),
                       "--engine.max_total_num_tokens", "4096")
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def reference(gemma_model: Path, tmp_path_factory: pytest.TempPathFactory):
    return make_reference(gemma_model, tmp_path_factory.mktemp("gemma-lora"))


def make_reference(gemma_model: Path, out: Path):
    """One fp32 load of the model with two random LoRA versions (PEFT), saved for the replica:
    (model, {version: adapter dir}). `model.disable_adapter()` gives the base model."""
    from peft import get_peft_model

    from burstrl.model.hf import load_model
    from burstrl.model.lora import lora_config

    torch.manual_seed(1)
    model = get_peft_model(load_model(gemma_model, "float32", "cpu"), lora_config(8, init_random=True),
                           adapter_name="policy-v1")
    model.add_adapter("policy-v2", lora_config(8, init_random=True))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.02)
    dirs = {}
    for version in ("policy-v1", "policy-v2"):
        model.save_pretrained(str(out / version), selected_adapters=[version])
        dirs[version] = out / version / version  # PEFT writes a non-default adapter in its own folder
    model.eval()
    return model, dirs


def load_versions(server: Server, dirs: dict[str, Path]) -> None:
    """Load each version (`make_reference`'s directories) on the replica through its admin API."""
    for version, path in dirs.items():
        r = HTTP.post(server.url + "/v1/load_lora_adapter", headers=server.admin(), timeout=600,
                      json={"lora_name": version, "lora_path": str(path)})
        assert r.status_code == 200, r.text


def captured_vs_reference(model, calls: list[dict]) -> float:
    """Max |captured - fp32 HF forward| logprob over `calls` (the adapter active in `model`)."""
    worst = 0.0
    for call in calls:
        want = sampled_logprobs(model, call["prompt_ids"] + call["completion_ids"], len(call["prompt_ids"]))
        worst = max(worst, (torch.tensor(call["logprobs"]) - want).abs().max().item())
    return worst


def complete(server: Server, prompt: str, session: str | None = None, **kw) -> dict:
    body = {"model": "base", "prompt": prompt, "logprobs": 1, "return_token_ids": True, **kw}
    if session:
        body["session_id"] = session
    r = HTTP.post(server.url + "/v1/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def test_gemma_runs_on_a_proven_path_and_writes_what_the_pretrained_model_writes(server: Server) -> None:
    assert HTTP.get(server.url + "/v1/models", timeout=30).json()["engine_path"] == "fast"
    answer = complete(server, "Question: What is 12 + 7?\nAnswer:", max_tokens=12, temperature=0)
    assert "19" in answer["choices"][0]["text"], answer["choices"][0]["text"]


def test_gemma_captured_logprobs_equal_an_fp32_forward_past_the_window(server: Server, reference) -> None:
    """Past the 512-token window and its 128-token margin the sliding layers' blocks before the
    window are let go (window-only KV): the session resumes from its cache twice (sampled, then
    greedy), the captured logprobs stay exact, and the replica holds less KV than the session's tokens in every layer."""
    story = " ".join(f"Line {i}: the robot counted {i * 7 % 13} bolts." for i in range(80))  # ~800 tokens
    first = complete(server, story, session="gemma-window", max_tokens=12, temperature=1.0, seed=1)
    second_prompt = story + first["choices"][0]["text"] + " Then the robot said:"
    second = complete(server, second_prompt, session="gemma-window", max_tokens=12, temperature=1.0, seed=2)
    third_prompt = second_prompt + second["choices"][0]["text"] + " Next:"
    complete(server, third_prompt, session="gemma-window", max_tokens=8, temperature=0)  # greedy: raw logprobs
    calls = server.get("/v1/traces/gemma-window?full=true")["calls"]
    assert len(calls[0]["prompt_ids"]) > 512 + 128 and min(c["cached_tokens"] for c in calls[1:]) > 512 + 128
    loads = server.get("/v1/loads")
    session = next(s for s in loads["sessions"] if s["session_id"] == "gemma-window")
    assert loads["prefix_cache_window_misses"] == 0
    assert loads["num_used_tokens"] < session["context_tokens"] * 0.9  # 3 of 18 layers keep every token
    model, _ = reference
    with model.disable_adapter():
        assert captured_vs_reference(model, calls) < 1e-4


def test_two_lora_versions_at_once_with_prefix_sharing_capture_exact_logprobs(server: Server, reference) -> None:
    """Both versions decode in one batch from the same prompt; a second session of v1 starts from
    v1's shared prefix blocks, v2 never from v1's (sharing is keyed by version). Every call's
    captured logprobs equal the fp32 forward of its own version."""
    import concurrent.futures

    model, dirs = reference
    load_versions(server, dirs)
    prompt = "def fibonacci(n):\n    " + "".join(f"# step {i}: add the two previous numbers\n    " for i in range(6))
    runs = [("v1-a", "policy-v1", prompt), ("v2-a", "policy-v2", prompt)]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda r: complete(server, r[2], session=r[0], model=r[1], max_tokens=16,
                                         temperature=1.0, seed=3), runs))
    complete(server, prompt + "return", session="v1-b", model="policy-v1", max_tokens=8, temperature=1.0, seed=4)
    traces = {sid: server.get(f"/v1/traces/{sid}?full=true")["calls"] for sid in ("v1-a", "v2-a", "v1-b")}
    assert traces["v1-b"][0]["cached_tokens"] >= 16  # shared whole blocks of v1-a's prompt
    assert traces["v2-a"][0]["cached_tokens"] == 0 and traces["v1-a"][0]["cached_tokens"] == 0
    worst = {}
    for version, sids in (("policy-v1", ("v1-a", "v1-b")), ("policy-v2", ("v2-a",))):
        model.set_adapter(version)
        worst[version] = captured_vs_reference(model, [c for sid in sids for c in traces[sid]])
    assert max(worst.values()) < 1e-4, worst
    model.set_adapter("policy-v1")  # a wrong version's numbers are far off: the check can fail
    assert captured_vs_reference(model, traces["v2-a"]) > 1e-3


def test_a_lora_step_on_gemma_recomputes_the_captured_logprobs(server: Server, gemma_model: Path,
                                                               tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    rollouts = []
    for i in range(2):  # one group of two attempts with different rewards: a nonzero advantage
        sid = f"gemma-train-{i}"
        complete(server, "def add(a, b):\n    return", session=sid, max_tokens=6, temperature=1.0, seed=i)
        calls = server.get(f"/v1/traces/{sid}?full=true")["calls"]
        turns = [Turn(prompt_ids=c["prompt_ids"], completion_ids=c["completion_ids"], logprobs=c["logprobs"],
                      version=0, replica=server.url) for c in calls]
        rollouts.append(Rollout(id=sid, turns=turns, reward=float(i)))
    with RolloutStore(run_dir / "store.sqlite") as store:
        store.put_group("g0", rollouts)
    r = run_train(run_dir, gemma_model, "--trainer.steps", "1", "--trainer.batch_groups", "1", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    step = metrics(run_dir)[0]
    # the trainer's PEFT model (Gemma's module names) starts as the base: new / old logprob ratio 1
    assert step["ratio_max"] == pytest.approx(1.0, abs=1e-3) and step["clip_frac"] == 0
    assert step["ratio_outside_frac"] == 0 and step["ratio_mean"] == pytest.approx(1.0, abs=1e-3)
    assert step["grad_norm"] > 0 and (run_dir / "checkpoints" / "step-1" / "adapter").is_dir()
