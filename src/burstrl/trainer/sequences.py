"""Rollouts to training sequences, and sequences to micro-batches under a token budget.

A multi-turn rollout whose every call extends the previous one (prompt = previous prompt +
previous completion + new tokens, which the replica's token continuity guarantees) is one
sequence: the model sees it once, and only the sampled tokens carry loss. When a call does not
extend the previous one (the harness rewrote the history) a new sequence starts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from burstrl.store.types import Rollout


@dataclass
class Sequence:
    """One training sequence: tokens, which of them were sampled, and their behaviour logprobs."""

    tokens: list[int]
    mask: list[int]  # 1 where tokens[j] was sampled (its loss uses the logits at j - 1)
    old_logprobs: list[float]  # behaviour logprob of tokens[j] where mask[j] = 1, else 0
    advantage: float
    rollout_id: str
    version: int

    @property
    def sampled(self) -> int:
        return sum(self.mask)


def rollout_sequences(rollout: Rollout, advantage: float) -> list[Sequence]:
    """Merge consecutive turns that extend each other; one sequence per unbroken chain."""
    out: list[Sequence] = []
    cur: Sequence | None = None
    for turn in rollout.turns:
        if cur is not None and turn.prompt_ids[: len(cur.tokens)] == cur.tokens:
            new = turn.prompt_ids[len(cur.tokens):]
        else:
            cur = Sequence(tokens=[], mask=[], old_logprobs=[], advantage=advantage,
                           rollout_id=rollout.id, version=rollout.version)
            out.append(cur)
            new = turn.prompt_ids
        cur.tokens += new + turn.completion_ids
        cur.mask += [0] * len(new) + [1] * len(turn.completion_ids)
        cur.old_logprobs += [0.0] * len(new) + list(turn.logprobs)
    return out


def shard(sequences: list[Sequence], rank: int, world_size: int) -> list[Sequence]:
    """This rank's share, balanced by length: longest first, dealt round-robin."""
    order = sorted(range(len(sequences)), key=lambda i: (-len(sequences[i].tokens), i))
    return [sequences[i] for i in order[rank::world_size]]


def micro_batches(sequences: list[Sequence], token_budget: int) -> list[list[Sequence]]:
    """Pack sequences (longest first) so that rows x longest row <= budget; a longer one goes alone."""
    batches: list[list[Sequence]] = []
    cur: list[Sequence] = []
    for seq in sorted(sequences, key=lambda s: -len(s.tokens)):
        width = max([len(s.tokens) for s in cur] + [len(seq.tokens)])
        if cur and width * (len(cur) + 1) > token_budget:
            batches.append(cur)
            cur = []
        cur.append(seq)
    if cur:
        batches.append(cur)
    return batches


@dataclass
class Packed:
    """A padded micro-batch; the target tensors are over positions 1..L-1 (what logits predict)."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    target_mask: torch.Tensor  # [B, L-1] bool: sampled tokens
    old_logprobs: torch.Tensor  # [B, L-1]
    advantages: torch.Tensor  # [B]


def pack(batch: list[Sequence], pad_id: int, device: torch.device) -> Packed:
    width = max(len(s.tokens) for s in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.bool)
    old = torch.zeros((len(batch), width), dtype=torch.float32)
    for i, s in enumerate(batch):
        n = len(s.tokens)
        ids[i, :n] = torch.tensor(s.tokens)
        attn[i, :n] = 1
        mask[i, :n] = torch.tensor(s.mask, dtype=torch.bool)
        old[i, :n] = torch.tensor(s.old_logprobs)
    adv = torch.tensor([s.advantage for s in batch], dtype=torch.float32)
    return Packed(input_ids=ids.to(device), attention_mask=attn.to(device), target_mask=mask[:, 1:].to(device),
                  old_logprobs=old[:, 1:].to(device), advantages=adv.to(device))
