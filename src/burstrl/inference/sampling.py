"""Sampling for a batch of rows that each have their own parameters and (optionally) seed.

Logprobs are those of the distribution the token was actually drawn from: logits after logit_bias,
penalties and the min_tokens mask, divided by temperature, restricted to top-k, top-p and min-p,
renormalised. That is the behaviour policy an RL trainer must correct against (vLLM calls this
"processed_logprobs") and what capture records; with temperature 1 and no other processing it is
the model's own log-softmax. Greedy rows (temperature 0) report the log-softmax of the adjusted
logits. With `raw` (vLLM's default `logprobs_mode`) the logprobs shown to the client are the
model's raw log-softmax instead; capture keeps the processed ones either way.

A request with a seed owns a torch.Generator, so its samples do not depend on which other requests
share the batch. A row that cannot be sampled (a non-finite distribution) fails alone: `sample`
reports its error and samples every other row.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

GREEDY_EPS = 1e-5  # a temperature below this is greedy (vLLM's _SAMPLING_EPS): 1e-50 would overflow
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts
MAX_LOGIT_BIAS = 1024


@dataclass
class SamplingParams:
    """Per-request sampling settings (OpenAI and vLLM names)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    top_logprobs: int = 0
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError with a user-facing message on out-of-range values; normalise the rest.

        Normalising: a temperature below GREEDY_EPS is greedy, a top_k at or above the vocabulary
        is off, so no value reaching the sampler can overflow or divide by zero.
        """
        _check(self.max_tokens >= 1, "max_tokens must be at least 1")
        _check(_finite(self.temperature) and 0 <= self.temperature <= 100, "temperature must be in [0, 100]")
        _check(_finite(self.top_p) and 0 < self.top_p <= 1, "top_p must be in (0, 1]")
        _check(_finite(self.min_p) and 0 <= self.min_p <= 1, "min_p must be in [0, 1]")
        _check(self.top_k >= -1, "top_k must be -1, 0 (off) or positive")
        _check(self.seed is None or SEED_RANGE[0] <= self.seed <= SEED_RANGE[1],
               f"seed must be an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}]")
        _check(0 <= self.top_logprobs <= 20, "top_logprobs must be in [0, 20]")
        _check(len(self.stop) <= 8 and all(self.stop), "stop takes at most 8 non-empty strings")
        _check(0 <= self.min_tokens <= self.max_tokens, "min_tokens must be in [0, max_tokens]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_finite(value) and -2 <= value <= 2, f"{name} must be in [-2, 2]")
        _check(_finite(self.repetition_penalty) and 0.01 <= self.repetition_penalty <= 10,
               "repetition_penalty must be in [0.01, 10]")  # 1e-50 would overflow the logits to inf
        _check(len(self.logit_bias) <= MAX_LOGIT_BIAS, f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens")
        _check(all(_finite(b) and -100 <= b <= 100 for b in self.logit_bias.values()),
               "logit_bias values must be in [-100, 100]")
        _check(len(self.stop_token_ids) <= 64, "stop_token_ids takes at most 64 ids")
        if vocab_size is not None:
            ids = [*self.logit_bias, *self.stop_token_ids]
            _check(all(0 <= t < vocab_size for t in ids),
                   f"token ids in logit_bias and stop_token_ids must be in [0, {vocab_size})")
            if self.top_k >= vocab_size:
                self.top_k = 0
        if self.temperature < GREEDY_EPS:
            self.temperature = 0.0

    @property
    def adjusts(self) -> bool:
        """Does this row change the logits before temperature (bias, penalties, min_tokens)?"""
        return bool(self.logit_bias or self.min_tokens or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    def generator(self, device: torch.device) -> torch.Generator | None:
        if self.seed is None:
            return None
        g = torch.Generator(device=device)
        g.manual_seed(self.seed)
        return g


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


@dataclass
class History:
    """What a row has seen so far: penalties and min_tokens depend on it."""

    prompt: Sequence[int]
    output: Sequence[int]


@dataclass
class Sampled:
    """One step's result for a batch: token, its logprob, optional top alternatives, and errors.

    `logprobs`/`top` are the processed ones (capture); `shown`/`shown_top` what the client sees
    (the same lists unless raw logprobs were asked for). A row with an error has token -1.
    """

    tokens: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]] | None
    shown: list[float]
    shown_top: list[list[tuple[int, float]]] | None
    errors: dict[int, str] = field(default_factory=dict)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           default: torch.Generator, histories: list[History] | None = None,
           eos_ids: Sequence[int] = (), raw: bool = False) -> Sampled:
    """logits: [B, V] float32 -> one token per row; a row that cannot be sampled fails alone."""
    logp = process(logits, params, histories, eos_ids)
    tokens, errors = _draw(logp, params, generators, default)
    safe = torch.tensor([t if t >= 0 else 0 for t in tokens], device=logits.device)
    chosen = logp.gather(1, safe[:, None])[:, 0].tolist()
    top = _top(logp, params)
    shown, shown_top = chosen, top
    if raw:
        raw_logp = torch.log_softmax(logits.float(), dim=-1)
        shown, shown_top = raw_logp.gather(1, safe[:, None])[:, 0].tolist(), _top(raw_logp, params)
    return Sampled(tokens=tokens, logprobs=chosen, top=top, shown=shown, shown_top=shown_top, errors=errors)


def _draw(logp: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
          default: torch.Generator) -> tuple[list[int], dict[int, str]]:
    """Tokens per row (greedy argmax or a draw); rows whose distribution is not finite get -1."""
    # one pass over [B, V] each (a 262k vocabulary makes every pass count): max is NaN if any
    # entry is, -inf if all are, finite otherwise
    best, argmax = logp.max(dim=-1)
    tokens = argmax.tolist()
    errors = {i: "the sampling distribution is not finite (NaN logits)"
              for i, ok in enumerate(torch.isfinite(best).tolist()) if not ok}
    shared = [i for i, p in enumerate(params) if generators[i] is None and p.temperature > 0 and i not in errors]
    if shared:  # exp only of the rows that draw: greedy rows need none
        drawn = torch.multinomial(logp[shared].exp(), 1, generator=default)[:, 0].tolist()
        for i, t in zip(shared, drawn, strict=False):
            tokens[i] = t
    for i, g in enumerate(generators):
        if g is not None and params[i].temperature > 0 and i not in errors:
            tokens[i] = int(torch.multinomial(logp[i].exp(), 1, generator=g)[0])
    for i in errors:
        tokens[i] = -1
    return tokens, errors


def process(logits: torch.Tensor, params: list[SamplingParams], histories: list[History] | None = None,
            eos_ids: Sequence[int] = ()) -> torch.Tensor:
    """Log-probabilities of each row's sampling distribution: [B, V]."""
    if any(p.adjusts for p in params):
        logits = _adjust(logits.clone(), params, histories, eos_ids)
    temps = [p.temperature if p.temperature > 0 else 1.0 for p in params]
    scaled = logits / torch.tensor(temps, device=logits.device)[:, None] if any(t != 1.0 for t in temps) else logits
    top_k = [p.top_k if p.temperature > 0 and p.top_k > 0 else 0 for p in params]
    top_p = [p.top_p if p.temperature > 0 else 1.0 for p in params]
    min_p = [p.min_p if p.temperature > 0 else 0.0 for p in params]
    if any(top_k) or any(p < 1.0 for p in top_p) or any(min_p):
        scaled = _truncate(scaled, top_k, top_p, min_p)
    return torch.log_softmax(scaled, dim=-1)


def _adjust(logits: torch.Tensor, params: list[SamplingParams], histories: list[History] | None,
            eos_ids: Sequence[int]) -> torch.Tensor:
    """logit_bias, then repetition/frequency/presence penalties, then the min_tokens mask (vLLM's order)."""
    vocab = logits.shape[-1]
    for i, p in enumerate(params):
        if not p.adjusts:
            continue
        row = logits[i]
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=row.device)
            row.index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), device=row.device, dtype=row.dtype))
        if histories is None:
            continue
        h = histories[i]
        if p.repetition_penalty != 1.0 and (h.prompt or h.output):
            seen = torch.tensor([*h.prompt, *h.output], device=row.device).unique()
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and h.output:
            counts = torch.bincount(torch.tensor(list(h.output), device=row.device), minlength=vocab)[:vocab]
            row -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty * (counts > 0).to(row.dtype)
        if len(h.output) < p.min_tokens:
            banned = [t for t in (*(() if p.ignore_eos else eos_ids), *p.stop_token_ids) if 0 <= t < vocab]
            if banned:
                row[torch.tensor(banned, device=row.device)] = float("-inf")
    return logits


def _truncate(scaled: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]) -> torch.Tensor:
    """Mask tokens outside each row's top-k, top-p nucleus and min-p floor with -inf (the best token stays)."""
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    vocab = scaled.shape[-1]
    ranks = torch.arange(vocab, device=scaled.device)[None, :]
    k = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_k], device=scaled.device)[:, None]
    remove = ranks >= k
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    p = torch.tensor(top_p, device=scaled.device)[:, None]
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
    remove = remove | ((before >= p) & (p < 1.0))  # rows at top_p=1 keep their whole tail
    floor = torch.tensor(min_p, device=scaled.device)[:, None] * probs[:, :1]
    remove = remove | (probs < floor)
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
        out.append(list(zip(ids[row, :k].tolist(), values[row, :k].tolist(), strict=False)))
    return out
