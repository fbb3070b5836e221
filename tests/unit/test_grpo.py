"""GRPO math on hand-computed cases, turn merging, masks and micro-batching."""

from __future__ import annotations

import math

import pytest
import torch

from burstrl.config import TrainerSection
from burstrl.store.types import Rollout, Turn
from burstrl.trainer.grpo import aggregate, group_advantages, token_loss
from burstrl.trainer.sequences import micro_batches, pack, rollout_sequences, shard

CFG = TrainerSection(clip_low=0.2, clip_high=0.28, tis_cap=2.0)


def test_group_advantages() -> None:
    assert group_advantages([1, 0, 0, 1], std_norm=True) == pytest.approx([1, -1, -1, 1], abs=1e-5)
    assert group_advantages([1, 0, 0, 1], std_norm=False) == pytest.approx([0.5, -0.5, -0.5, 0.5])
    assert group_advantages([0.3, 0.3, 0.3], std_norm=True) is None
    assert group_advantages([1.0], std_norm=False) is None
    adv = group_advantages([0.0, 1.0, 2.0], std_norm=True)
    assert adv == pytest.approx([-1.2247, 0.0, 1.2247], abs=1e-4)  # std = sqrt(2/3)


def _one(ratio: float, adv: float, cfg: TrainerSection = CFG) -> tuple[float, float, bool, bool]:
    """(loss, d loss / d logp, clipped, truncated) for one token with old logprob -1."""
    old = torch.tensor([-1.0])
    logp = (old + math.log(ratio)).clone().requires_grad_(True)
    out = token_loss(logp, old, torch.tensor([adv]), cfg)
    out.loss.sum().backward()
    return float(out.loss.detach()), float(logp.grad), bool(out.clipped), bool(out.truncated)


@pytest.mark.parametrize("ratio,adv,loss,grad,clipped,truncated", [
    (1.0, 1.0, -1.0, -1.0, False, False),     # on-policy: plain policy gradient
    (1.5, 1.0, -1.28, 0.0, True, False),      # above 1 + clip_high with A > 0: clipped, no gradient
    (1.5, -1.0, 1.5, 1.5, False, False),      # A < 0: the unclipped branch is the min, gradient -A * rho
    (3.0, -1.0, 2.0, 0.0, False, True),       # rho > C = 2: truncated at C, no gradient
    (0.5, -1.0, 0.8, 0.0, True, False),       # below 1 - clip_low with A < 0: clipped
    (0.5, 1.0, -0.5, -0.5, False, False),     # A > 0, small ratio: gradient -A * rho
])
def test_token_loss_branches(ratio, adv, loss, grad, clipped, truncated) -> None:
    got = _one(ratio, adv)
    assert got[0] == pytest.approx(loss, abs=1e-5)
    assert got[1] == pytest.approx(grad, abs=1e-5)
    assert got[2:] == (clipped, truncated)


def test_tis_off_leaves_the_ratio_uncapped() -> None:
    loss, grad, _, truncated = _one(3.0, -1.0, TrainerSection(clip_low=0.2, clip_high=0.28, tis_cap=0.0))
    assert loss == pytest.approx(3.0, abs=1e-5) and grad == pytest.approx(3.0, abs=1e-5) and not truncated


def test_kl_penalty_is_k3() -> None:
    cfg = TrainerSection(clip_low=0.2, clip_high=0.28, tis_cap=2.0, kl_coef=0.5)
    logp = torch.tensor([-1.0, -2.0])
    out = token_loss(logp, logp.clone(), torch.zeros(2), cfg, ref_logp=torch.tensor([-1.0, -1.9]))
    want = [0.0, math.exp(0.1) - 0.1 - 1]
    assert out.kl.tolist() == pytest.approx(want, abs=1e-6)
    assert out.loss.tolist() == pytest.approx([0.5 * w for w in want], abs=1e-6)


def test_aggregation_modes() -> None:
    loss = torch.tensor([1.0, 3.0, 5.0])  # sequence 0 has two tokens, sequence 1 one
    index, per_seq = torch.tensor([0, 0, 1]), torch.tensor([2.0, 1.0])
    assert float(aggregate(loss, index, per_seq, "token-mean", 3, 2)) == pytest.approx(3.0)
    assert float(aggregate(loss, index, per_seq, "sequence-mean", 3, 2)) == pytest.approx((2.0 + 5.0) / 2)
    # a micro-batch's share uses the whole batch's totals: shares add up to the batch loss
    half = aggregate(loss[:2], index[:2], per_seq, "token-mean", 3, 2) + aggregate(loss[2:], index[2:], per_seq,
                                                                                      "token-mean", 3, 2)
    assert float(half) == pytest.approx(3.0)
    with pytest.raises(ValueError):
        aggregate(loss, index, per_seq, "bogus", 3, 2)


def _rollout(turns: list[tuple[list[int], list[int]]], rid: str = "r") -> Rollout:
    return Rollout(id=rid, reward=1.0, turns=[Turn(prompt_ids=p, completion_ids=c, logprobs=[-0.5] * len(c),
                                                   version=2) for p, c in turns])


def test_turns_that_extend_each_other_merge_into_one_sequence() -> None:
    r = _rollout([([1, 2], [3, 4]), ([1, 2, 3, 4, 5], [6]), ([9, 9], [7])])
    seqs = rollout_sequences(r, advantage=0.5)
    assert len(seqs) == 2
    assert seqs[0].tokens == [1, 2, 3, 4, 5, 6]
    assert seqs[0].mask == [0, 0, 1, 1, 0, 1]
    assert seqs[0].old_logprobs == [0, 0, -0.5, -0.5, 0, -0.5]
    assert seqs[1].tokens == [9, 9, 7] and seqs[1].mask == [0, 0, 1]
    assert all(s.advantage == 0.5 and s.rollout_id == "r" and s.version == 2 for s in seqs)


def test_pack_aligns_targets_with_logits() -> None:
    seq = rollout_sequences(_rollout([([1, 2], [3, 4])]), advantage=1.0)[0]
    short = rollout_sequences(_rollout([([5], [6])]), advantage=-1.0)[0]
    p = pack([seq, short], pad_id=0, device=torch.device("cpu"))
    assert p.input_ids.tolist() == [[1, 2, 3, 4], [5, 6, 0, 0]]
    assert p.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    # logits at j predict token j + 1: targets are tokens 1.. and the mask is shifted with them
    assert p.target_mask.tolist() == [[False, True, True], [True, False, False]]
    assert p.old_logprobs.tolist() == [[0.0, -0.5, -0.5], [-0.5, 0.0, 0.0]]
    assert p.advantages.tolist() == [1.0, -1.0]


def test_micro_batches_respect_the_token_budget_and_shards_cover_everything() -> None:
    seqs = [rollout_sequences(_rollout([(list(range(n)), [1])], rid=f"r{n}"), 1.0)[0] for n in (3, 9, 5, 30, 2)]
    batches = micro_batches(seqs, token_budget=20)
    assert sorted(s.rollout_id for b in batches for s in b) == sorted(s.rollout_id for s in seqs)
    for b in batches:
        width = max(len(s.tokens) for s in b)
        assert width * len(b) <= 20 or len(b) == 1
    parts = [shard(seqs, r, 2) for r in range(2)]
    assert sorted(s.rollout_id for p in parts for s in p) == sorted(s.rollout_id for s in seqs)
    assert abs(len(parts[0]) - len(parts[1])) <= 1
