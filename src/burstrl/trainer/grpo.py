"""The GRPO objective: group-normalised advantages and a clipped, truncated policy-gradient loss.

Advantages (GRPO, Shao et al. 2024, "DeepSeekMath"): for a group of G attempts at one task with
rewards r_1..r_G,

    A_i = (r_i - mean(r)) / (std(r) + eps)        (std_norm = true)
    A_i =  r_i - mean(r)                          (std_norm = false; "Dr. GRPO", Liu et al. 2025)

and every sampled token of attempt i gets A_i. A group whose rewards are all equal carries no
signal and is dropped (and counted).

Loss per sampled token t, with pi the policy being trained and mu the behaviour policy whose
logprobs the replica captured when it sampled the token (an older version, in async RL):

    rho_t = exp(log pi(y_t) - log mu(y_t))                       importance ratio vs behaviour
    w_t   = min(rho_t, C)                (C = tis_cap; C = 0: w_t = rho_t)
    l_t   = -min(w_t * A, clip(rho_t, 1 - eps_low, 1 + eps_high) * A)  +  beta * k3_t

- clipping as in PPO (Schulman et al. 2017) with DAPO's asymmetric "clip-higher" bounds
  (Yu et al. 2025);
- truncating the unclipped ratio at C bounds the loss of negative-advantage tokens whose ratio
  exploded, as dual-clip PPO does (Ye et al. 2020), and caps the off-policy correction between
  inference and training numerics as truncated importance sampling does (Yao et al. 2025); a token
  truncated there contributes no gradient;
- k3_t = exp(q_t) - q_t - 1 with q_t = log pi_base(y_t) - log pi(y_t): Schulman's low-variance KL
  estimator to the base model (the adapter disabled), only when beta = kl_coef > 0.

Mismatch: every token's rho_t is computed before the step's one optimizer update (all
micro-batches run first), so at step 1 of an on-policy run it measures only how far the trainer's
forward is from the replica's (rounding: bf16 serving vs an fp32 trainer). A step reports the mean
of rho_t over sampled tokens and the share of tokens with rho_t outside MISMATCH_BAND = [0.8, 1.25]
(the band the off-policy literature flags, e.g. Yao et al. 2025).

Aggregation: "token-mean" divides the sum over every sampled token of the batch by their count
(DAPO); "sequence-mean" averages each sequence's token-mean, then averages sequences (GRPO). The
divisor is the whole batch's (all micro-batches, all ranks), so gradients summed across micro-batches
and ranks equal the single-process gradient of the full batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from burstrl.config import TrainerSection


def group_advantages(rewards: list[float], std_norm: bool, eps: float = 1e-6) -> list[float] | None:
    """Advantages of one group, or None when all rewards are equal (no signal)."""
    n = len(rewards)
    mean = sum(rewards) / n
    var = sum((r - mean) ** 2 for r in rewards) / n
    if n < 2 or var <= 1e-12:
        return None
    scale = math.sqrt(var) + eps if std_norm else 1.0
    return [(r - mean) / scale for r in rewards]


MISMATCH_BAND = (0.8, 1.25)  # rho_t outside it counts as a mismatched token


@dataclass
class TokenLoss:
    """Per-token loss and the statistics a step reports (all [N] over sampled tokens)."""

    loss: torch.Tensor
    ratio: torch.Tensor
    clipped: torch.Tensor  # bool: the clipped branch was taken
    truncated: torch.Tensor  # bool: rho_t > C
    kl: torch.Tensor | None
    outside: torch.Tensor | None = None  # bool: rho_t outside MISMATCH_BAND (NaN counts as outside)


def token_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, cfg: TrainerSection,
               ref_logp: torch.Tensor | None = None) -> TokenLoss:
    """logp, old_logp, adv (, ref_logp): [N] over sampled tokens -> per-token loss l_t.

    `cfg` is the trainer's config (clip_low, clip_high, tis_cap, kl_coef are read): their
    defaults live there only."""
    ratio = torch.exp(logp - old_logp)
    weight = torch.clamp(ratio, max=cfg.tis_cap) if cfg.tis_cap > 0 else ratio
    unclipped = weight * adv
    clipped = torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    kl = None
    if cfg.kl_coef > 0 and ref_logp is not None:
        q = ref_logp - logp
        kl = torch.exp(q) - q - 1.0
        loss = loss + cfg.kl_coef * kl
    truncated = ratio > cfg.tis_cap if cfg.tis_cap > 0 else torch.zeros_like(ratio, dtype=torch.bool)
    r = ratio.detach()
    low, high = MISMATCH_BAND
    return TokenLoss(loss=loss, ratio=r, clipped=(clipped < unclipped).detach(),
                     truncated=truncated.detach(), kl=None if kl is None else kl.detach(),
                     outside=~((r >= low) & (r <= high)))


def aggregate(loss: torch.Tensor, seq_index: torch.Tensor, seq_tokens: torch.Tensor, mode: str,
              total_tokens: int, total_sequences: int) -> torch.Tensor:
    """Sum this micro-batch's share of the batch loss.

    loss: [N] per-token; seq_index: [N] which sequence each token belongs to; seq_tokens: [S]
    sampled-token count of each sequence. totals are over the whole batch (every rank).
    """
    if mode == "token-mean":
        return loss.sum() / total_tokens
    if mode == "sequence-mean":
        return (loss / seq_tokens[seq_index]).sum() / total_sequences
    raise ValueError(f"unknown loss aggregation {mode!r}")
