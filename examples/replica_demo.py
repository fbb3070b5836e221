"""`make run` (for now): a replica serving two versions, driven by the official OpenAI client.

Makes the tiny model if missing (cached in .cache/), starts `burstrl serve` as a child process,
loads a LoRA version, runs a three-turn session on it and a call on the base model, and prints
what the replica captured: token ids, logprobs, cached tokens and the version of every call.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import httpx
from openai import OpenAI

from burstrl.model.lora import make_random_adapter
from burstrl.model.tiny import ensure_tiny_model
from burstrl.protocol.process import start_replica

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "demo-admin-token"


def main() -> None:
    model_dir = ensure_tiny_model(ROOT / ".cache" / "tiny-qwen3")
    work = Path(tempfile.mkdtemp(prefix="burstrl-demo-"))
    adapter = make_random_adapter(model_dir, work / "policy-v1", seed=1)
    print(f"model {model_dir}; starting a replica (log: {work / 'serve.log'})", file=sys.stderr)
    replica = start_replica(model_dir, work, "--server.admin_token", TOKEN)
    try:
        run_session(replica.url, adapter)
    finally:
        replica.stop()


def run_session(url: str, adapter: Path) -> None:
    r = httpx.post(f"{url}/v1/load_lora_adapter", headers={"Authorization": f"Bearer {TOKEN}"},
                   json={"lora_name": "policy-v1", "lora_path": str(adapter)}, timeout=60)
    r.raise_for_status()
    client = OpenAI(base_url=f"{url}/v1", api_key="unused")
    print("models:", [m.id for m in client.models.list().data])
    messages = [{"role": "user", "content": "Count to five."}]
    for turn in range(3):
        out = client.chat.completions.create(
            model="policy-v1", messages=messages, max_tokens=12, logprobs=True, seed=turn,
            extra_body={"session_id": "demo", "return_token_ids": True})
        choice = out.choices[0]
        lps = [round(t.logprob, 2) for t in choice.logprobs.content]
        print(f"turn {turn}: prompt {out.usage.prompt_tokens} tokens "
              f"({out.usage.prompt_tokens_details.cached_tokens} cached), "
              f"sampled ids {choice.model_extra['token_ids']}, logprobs {lps}")
        messages += [{"role": "assistant", "content": choice.message.content},
                     {"role": "user", "content": "Go on."}]
    base = client.chat.completions.create(model="base", messages=messages[:1], max_tokens=8)
    print("base model says:", repr(base.choices[0].message.content))
    trace = httpx.get(f"{url}/v1/traces/demo").json()
    for call in trace["calls"]:
        print(f"captured: version={call['version']} prompt={len(call['prompt_ids'])} "
              f"completion={len(call['completion_ids'])} finish={call['finish_reason']}")
    loads = httpx.get(f"{url}/v1/loads").json()
    print(f"cache hit rate {loads['cache_hit_rate']:.2f}; KV tokens used {loads['num_used_tokens']}")


if __name__ == "__main__":
    main()
