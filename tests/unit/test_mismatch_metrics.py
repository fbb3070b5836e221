"""The trainer's per-step mismatch figures: the mean importance ratio between recomputed and captured
(behaviour) logprobs and the share of sampled tokens with a ratio outside [0.8, 1.25], from the
forward passes before the step's update, summed over micro-batches and ranks, into the run report."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from burstrl.config import TrainerSection
from burstrl.eval.report import render_markdown, summary
from burstrl.trainer.grpo import MISMATCH_BAND, token_loss
from burstrl.trainer.loop import LossSums, StepBatch, Trainer
from burstrl.trainer.sequences import Sequence


def test_token_loss_marks_ratios_outside_the_band() -> None:
    ratios = [0.5, 0.79, 0.81, 1.0, 1.24, 1.26, 3.0, float("nan")]
    old = torch.zeros(len(ratios))
    out = token_loss(torch.tensor([math.log(r) for r in ratios]), old, torch.ones(len(ratios)),
                     TrainerSection(tis_cap=2.0))
    assert MISMATCH_BAND == (0.8, 1.25)
    assert out.outside.tolist() == [True, True, False, False, False, True, True, True]


def test_loss_sums_add_and_reduce_the_outside_count() -> None:
    sums = LossSums()
    sums.add(LossSums(tokens=3, ratio=3.0, outside=1))
    sums.add(LossSums(tokens=2, ratio=2.5, outside=2))
    assert (sums.tokens, sums.outside) == (5, 3)

    class TwoRanks:
        def sum_(self, t: torch.Tensor) -> torch.Tensor:
            return t.mul_(2)

        def max_(self, t: torch.Tensor) -> torch.Tensor:
            return t

    sums.all_reduce(TwoRanks())
    assert (sums.tokens, sums.outside, sums.ratio) == (10, 6, 11.0)


class _OneRank:
    rank, world = 0, 1

    def sum_grads(self, params: list) -> None:
        pass

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def max_(self, t: torch.Tensor) -> torch.Tensor:
        return t


class _SmallTrainer(Trainer):
    """`Trainer.optimize` over a random tiny Qwen3 (full weights trained: no PEFT, no store)."""

    def __init__(self, cfg: TrainerSection) -> None:
        from transformers import Qwen3Config, Qwen3ForCausalLM

        torch.manual_seed(0)
        self.model = Qwen3ForCausalLM(Qwen3Config(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, max_position_embeddings=64))
        self.cfg = SimpleNamespace(trainer=cfg, temperature=1.0)
        self.loss_cfg, self.dist, self.device, self.pad_id = cfg, _OneRank(), torch.device("cpu"), 0
        self.params = list(self.model.parameters())
        self.optimizer = torch.optim.SGD(self.params, lr=10.0)  # a big update: the figures must precede it
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 1.0)
        self.recompute = SimpleNamespace(begin=lambda: None, verify=lambda: None)


def test_a_step_reports_the_mismatch_before_its_update() -> None:
    """Captured logprobs = the model's own, shifted on chosen tokens: ratio 1 on most, 0.5 and 1.5
    (outside the band) and 1.1 (inside) on others; four sequences in two micro-batches."""
    trainer = _SmallTrainer(TrainerSection(micro_batch_tokens=24, grad_clip=0.0, tis_cap=2.0))
    gen = torch.Generator().manual_seed(1)
    seqs, ratios = [], []
    for i in range(4):
        tokens = torch.randint(1, 64, (12,), generator=gen)
        with torch.no_grad():
            logp = torch.log_softmax(trainer.model(input_ids=tokens[None]).logits[0, :-1].float(), -1)
        own = logp.gather(1, tokens[1:, None])[:, 0]
        want = [1.0] * 5 + [0.5, 1.5, 1.1, 1.0, 1.0, 1.0] if i % 2 else [1.0] * 11  # per target token
        ratios += want[5:]  # the sampled tokens' (positions 6..11)
        old = [0.0] * 6 + [float(own[j - 1]) - math.log(want[j - 1]) for j in range(6, 12)]
        seqs.append(Sequence(tokens=tokens.tolist(), mask=[0] * 6 + [1] * 6, old_logprobs=old,
                             advantage=1.0 if i < 2 else -1.0, rollout_id=f"r{i}", version=0))
    batch = StepBatch(groups=[], sequences=seqs, kept_groups=1, zero_variance_groups=0, rewards=[1.0, 1.0, 0.0, 0.0])
    stats = trainer.optimize(batch, step=1)
    assert stats["tokens"] == 24
    assert stats["ratio_mean"] == pytest.approx(sum(ratios) / 24, abs=1e-4)
    assert stats["ratio_outside_frac"] == pytest.approx(4 / 24)  # 0.5 and 1.5, in two sequences
    assert stats["ratio_max"] == pytest.approx(1.5, abs=1e-4)


def test_the_run_report_shows_the_mismatch(tmp_path) -> None:
    import json

    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "time": 1000.0 + s, "reward_mean": 0.5, "step_s": 1.0, "compute_s": 0.5,
             "ratio_mean": r, "ratio_max": m, "ratio_outside_frac": f}
            for s, r, m, f in ((1, 1.0, 1.01, 0.0), (2, 1.02, 1.6, 0.1), (3, 0.98, 1.2, 0.02))]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    figures = summary(run)
    assert figures["ratio_mean"] == pytest.approx(1.0)
    assert figures["ratio_max"] == pytest.approx(1.6)
    assert figures["ratio_outside_frac"] == pytest.approx(0.04)
    assert figures["ratio_outside_frac_max"] == pytest.approx(0.1)
    md = render_markdown(figures, "dashboard.png")
    assert "outside [0.8, 1.25]" in md and "0.0400; 0.1000" in md
