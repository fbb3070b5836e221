"""Sampling for a batch of rows that each have their own parameters and (optionally) seed.

Logprobs are those of the distribution the token was actually drawn from: logits / temperature,
restricted to top-k and top-p, renormalised. That is the behaviour policy an RL trainer must
correct against (vLLM calls this "processed_logprobs"); with temperature 1 and no truncation it is
the model's own log-softmax. Greedy rows (temperature 0) report the model's raw log-softmax.

A request with a seed owns a torch.Generator, so its samples do not depend on which other requests
share the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    """Per-request sampling settings (OpenAI names)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    top_logprobs: int = 0
    ignore_eos: bool = False

    def validate(self) -> None:
        """Raise ValueError with a user-facing message on out-of-range values."""
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if not 0 <= self.temperature <= 100:
            raise ValueError("temperature must be in [0, 100]")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < -1:
            raise ValueError("top_k must be -1, 0 (off) or positive")
        if not 0 <= self.top_logprobs <= 20:
            raise ValueError("top_logprobs must be in [0, 20]")
        if len(self.stop) > 8 or any(not s for s in self.stop):
            raise ValueError("stop takes at most 8 non-empty strings")

    def generator(self, device: torch.device) -> torch.Generator | None:
        if self.seed is None:
            return None
        g = torch.Generator(device=device)
        g.manual_seed(self.seed)
        return g


@dataclass
class Sampled:
    """One step's result for a batch: token, its logprob, and optional top alternatives."""

    tokens: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]] | None


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None], default: torch.Generator) -> Sampled:
    """logits: [B, V] float32 -> one token per row."""
    logp = process(logits, params)
    greedy = torch.tensor([p.temperature == 0 for p in params], device=logits.device)
    probs = logp.exp()
    tokens = torch.empty(len(params), dtype=torch.long, device=logits.device)
    shared = [i for i, g in enumerate(generators) if g is None and params[i].temperature > 0]
    if shared:
        tokens[shared] = torch.multinomial(probs[shared], 1, generator=default)[:, 0]
    for i, g in enumerate(generators):
        if g is not None and params[i].temperature > 0:
            tokens[i] = torch.multinomial(probs[i], 1, generator=g)[0]
    if bool(greedy.any()):
        tokens = torch.where(greedy, logp.argmax(dim=-1), tokens)
    chosen = logp.gather(1, tokens[:, None])[:, 0]
    top = _top(logp, params)
    return Sampled(tokens=tokens.tolist(), logprobs=chosen.tolist(), top=top)


def process(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Log-probabilities of each row's sampling distribution: [B, V]."""
    temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params],
                         device=logits.device)[:, None]
    scaled = logits / temps
    top_k = [p.top_k if p.temperature > 0 and p.top_k > 0 else 0 for p in params]
    top_p = [p.top_p if p.temperature > 0 else 1.0 for p in params]
    if any(top_k) or any(p < 1.0 for p in top_p):
        scaled = _truncate(scaled, top_k, top_p)
    return torch.log_softmax(scaled, dim=-1)


def _truncate(scaled: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask tokens outside each row's top-k and top-p nucleus with -inf (the best token stays)."""
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    vocab = scaled.shape[-1]
    ranks = torch.arange(vocab, device=scaled.device)[None, :]
    k = torch.tensor([k if k > 0 else vocab for k in top_k], device=scaled.device)[:, None]
    remove = ranks >= k
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    p = torch.tensor(top_p, device=scaled.device)[:, None]
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
    remove = remove | ((before >= p) & (p < 1.0))  # rows at top_p=1 keep their whole tail
    remove[:, 0] = False
    masked = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(1, order, masked)


def _top(logp: torch.Tensor, params: list[SamplingParams]) -> list[list[tuple[int, float]]] | None:
    n = max(p.top_logprobs for p in params)
    if n == 0:
        return None
    values, ids = logp.topk(n, dim=-1)
    out = []
    for row, p in enumerate(params):
        k = p.top_logprobs
        out.append(list(zip(ids[row, :k].tolist(), values[row, :k].tolist())))
    return out
