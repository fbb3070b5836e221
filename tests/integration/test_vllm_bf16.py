"""Gemma 3 270M served in bf16 by vLLM under burstrl's server, and every hostile request against it.

One bf16 vLLM replica serves the module (its start is most of the cost). What it shows:
- bf16 on vLLM (issue 50, "bf16 on both engines"): the start probe passes with its 16-bit bound, and
  captured logprobs stay within 0.25 on average of an fp32 HF forward, for the base model past the
  512-token window and for a LoRA version (measured: mean 0.05 and 0.0015, one unlikely token of
  16 at 0.79), while a wrong version is far off (the check can fail);
- hostile requests: the replica fuzz suite and the named regressions of tests/fuzz run here
  unchanged against the vLLM engine (the same invariant: a 2xx or an OpenAI 4xx, never a 5xx, and
  the replica still serves others), with the same cluster token and a `policy-v1` version loaded.

Needs vLLM's environment (`make vllm`; `.ci/run` makes it): without it the module skips, saying so.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings

from burstrl.protocol.process import start_replica
from tests.fuzz import test_replica_fuzz as fuzz
from tests.fuzz.test_replica_fuzz import test_adapter_admin as fuzz_adapter_admin
from tests.fuzz.test_replica_regressions import (  # noqa: F401 - collected here, against this module's `server`
    CLUSTER_TOKEN,
    test_deeply_nested_json_is_a_400,
    test_explicit_nulls_are_defaults,
    test_huge_top_k_is_off_not_an_overflow,
    test_lone_surrogates_are_a_400,
    test_masked_alternatives_are_finite_in_json,
    test_models_name_their_parent_and_root,
    test_out_of_range_seed_is_a_400_and_the_session_is_not_wedged,
    test_single_prompt_in_a_list_and_supported_options_work,
    test_stop_reason_names_the_stop_string_or_token,
    test_streaming_prompt_token_ids_where_vllm_puts_them,
    test_tiny_temperature_is_greedy_not_an_engine_crash,
    test_traces_and_session_lists_need_a_token,
    test_unknown_routes_and_bad_parameters_are_openai_errors,
    test_unsupported_or_bad_options_are_a_400_never_ignored,
    test_zero_completion_tokens_is_a_400_and_null_max_tokens_is_the_default,
)
from tests.http_client import HTTP
from tests.vllm_env import require_vllm, vllm_slot

from .conftest import ADMIN_TOKEN, Server, stop_server
from .test_gemma import complete, load_versions, make_reference

pytestmark = pytest.mark.slow


def fewer(test, examples: int):
    """A replica fuzz test of tests/fuzz, collected here against this module's `server`, with its own
    strategies, body and invariant but fewer drawn examples than the own engine's 30: each costs about
    2 s on vLLM (its check's request), and the drawn 30 run against the own engine in
    tests/fuzz/test_replica_fuzz.py."""
    return settings(fuzz.FUZZ, max_examples=min(examples, fuzz.EXAMPLES))(
        given(**test.hypothesis._given_kwargs)(test.hypothesis.inner_test))


# what reaches the engine (sampling options, prompts, chat turns, versions) keeps more examples than
# what the server refuses before any engine sees it (raw bytes, adapter uploads); the suite's own
# guard runs after them (both served and refused bodies occurred, no 5xx)
test_chat_bodies = fewer(fuzz.test_chat_bodies, 15)
test_completion_bodies = fewer(fuzz.test_completion_bodies, 15)
test_raw_bytes = fewer(fuzz.test_raw_bytes, 10)
test_uploads = fewer(fuzz.test_uploads, 10)
test_the_fuzzer_saw_every_kind_of_answer = fuzz.test_the_fuzzer_saw_every_kind_of_answer

BF16_TOL = 0.25  # mean |captured - fp32 HF| logprob in bf16 (the start probe's bound, issue 50's figure)


@pytest.fixture(scope="module")
def reference(gemma_model: Path, tmp_path_factory: pytest.TempPathFactory):
    """test_gemma's: an fp32 HF load with two random rank-8 LoRA versions saved as PEFT."""
    return make_reference(gemma_model, tmp_path_factory.mktemp("vllm-bf16-lora"))


# Gemma's turn format (the instruction-tuned model's), so the chat routes run too: the base model
# ships no template, and the suites' chat cases would otherwise all be "no chat template" 400s
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>"
                 "{{ 'model' if m['role'] == 'assistant' else 'user' }}\n{{ m['content'] }}<end_of_turn>\n"
                 "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def with_chat_template(model: Path, out: Path) -> Path:
    """`model`'s files (linked, not copied) plus a chat template."""
    out.mkdir()
    for f in model.iterdir():
        (out / f.name).symlink_to(f)
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return out


@pytest.fixture(scope="module")
def server(gemma_model: Path, reference, tmp_path_factory: pytest.TempPathFactory):
    require_vllm()
    work = tmp_path_factory.mktemp("vllm-bf16")
    model = with_chat_template(gemma_model, work / "gemma-chat")
    with vllm_slot():
        rep = start_replica(model, work, "--server.admin_token", ADMIN_TOKEN, "--server.state_dir",
                            str(work / "state"), "--server.cluster_token", CLUSTER_TOKEN, "--engine.backend", "vllm",
                            "--model.dtype", "bfloat16", "--engine.max_model_len", "2048",
                            "--engine.vllm.kv_cache_gib", "1", timeout=900)
        srv = Server(url=rep.url, replica=rep)
        load_versions(srv, {"policy-v1": reference[1]["policy-v1"]})  # the fuzz suite's `policy-v1`
        yield srv
        stop_server(srv)


def test_bf16_on_vllm_captures_within_the_bound_of_an_fp32_forward(server: Server, reference) -> None:
    model, dirs = reference
    assert "vLLM proven on a 24-token probe (bfloat16" in Path(server.replica.log).read_text()
    answer = complete(server, "Question: What is 12 + 7?\nAnswer:", max_tokens=12, temperature=0)
    assert "19" in answer["choices"][0]["text"], answer["choices"][0]["text"]
    story = " ".join(f"Line {i}: the robot counted {i * 7 % 13} bolts." for i in range(80))  # ~800 tokens
    complete(server, story, session="bf16-window", max_tokens=16, temperature=1.0, seed=1)
    prompt = "def fibonacci(n):\n    " + "".join(f"# step {i}: add the two previous numbers\n    " for i in range(12))
    complete(server, prompt, session="bf16-v1", model="policy-v1", max_tokens=24, temperature=1.0, seed=2)
    base = server.get("/v1/traces/bf16-window?full=true")["calls"]
    lora = server.get("/v1/traces/bf16-v1?full=true")["calls"]
    assert len(base[0]["prompt_ids"]) > 512 + 128
    with model.disable_adapter():
        base_err = _errors(model, base)
    model.set_adapter("policy-v1")
    lora_err = _errors(model, lora)
    print("bf16 vs fp32: base max", base_err.max().item(), "mean", base_err.mean().item(),
          "| policy-v1 max", lora_err.max().item(), "mean", lora_err.mean().item())
    # bf16 rounding: near 0 on most tokens, heavy-tailed on a few unlikely ones sampled at T = 1
    # (one token of 16 measured 0.79 here), so the bound is on the mean, as the start probe's is;
    # a token past 1 nat is another model, not rounding
    assert base_err.mean() < BF16_TOL and lora_err.mean() < BF16_TOL
    assert base_err.max() < 1.0 and lora_err.max() < 1.0
    model.set_adapter("policy-v2")  # another version's numbers are far off: the check can fail
    wrong = _errors(model, lora)
    print("policy-v1's capture vs policy-v2's forward: max", wrong.max().item(), "mean", wrong.mean().item())
    assert wrong.mean() > 3 * lora_err.mean() and wrong.max() > 3 * lora_err.max()
    assert set(dirs) == {"policy-v1", "policy-v2"}


def _errors(model, calls: list[dict]) -> torch.Tensor:
    """|captured - fp32 HF forward| of every sampled token of `calls` (the adapter active in `model`)."""
    from .conftest import sampled_logprobs

    out = [(torch.tensor(c["logprobs"]) - sampled_logprobs(model, c["prompt_ids"] + c["completion_ids"],
                                                           len(c["prompt_ids"]))).abs() for c in calls]
    return torch.cat(out)


def test_the_bf16_replica_still_serves_after_the_hostile_suites(server: Server) -> None:
    """Last: whatever the suites above sent, the engine is alive and answers a plain request."""
    assert HTTP.get(server.url + "/health", timeout=30).status_code == 200
    assert complete(server, "Still serving?", max_tokens=2)["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(("name", "path", "token"), [
    ("policy-v1", "/etc", True), ("..", "/proc/self", True), ("policy-v9", "/dev/zero", True),
    ("x" * 80, "/", True), ("base", "", True), ("policy-v2", "/etc", False)])
def test_adapter_admin_hostile_cases(server: Server, name: str, path: str, token: bool) -> None:
    """The adapter-admin fuzz body on fixed hostile cases, not 30 drawn ones: on vLLM each load
    attempt costs seconds (234 s for the drawn 30 in CI, the module's costliest test), and the
    drawn cases run against the own engine in tests/fuzz/test_replica_fuzz.py."""
    fuzz_adapter_admin.hypothesis.inner_test(server, name, path, token)
