"""`burstrl train`: the GRPO loop on a LoRA adapter, one process per data-parallel rank.

Each step: wait for a batch of groups from the store (rank 0 takes, everyone receives) -> turn
them into sequences with advantages -> forward/backward this rank's micro-batches -> sum gradients
across ranks, clip, AdamW -> checkpoint, commit the step in the store (the commit point) ->
publish `policy-vN` to the volume and push it to the replicas -> write the step's metrics.
See checkpoint.py for why the commit comes before the publish, and grpo.py for the objective.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from burstrl.atomic import write_text
from burstrl.config import TrainConfig, dump_toml
from burstrl.store import Group, RolloutStore
from burstrl.trainer import checkpoint, recompute
from burstrl.trainer.dist import Dist
from burstrl.trainer.faults import maybe_crash
from burstrl.trainer.grpo import aggregate, group_advantages, token_loss
from burstrl.trainer.publish import Publisher, publish_version
from burstrl.trainer.sequences import Sequence, micro_batches, pack, rollout_sequences, shard

log = logging.getLogger("burstrl.train")


class TrainError(RuntimeError):
    """The run cannot proceed (bad resume state, no data in time); the message says what to do."""


@dataclass
class StepBatch:
    groups: list[Group]
    sequences: list[Sequence]
    kept_groups: int
    zero_variance_groups: int
    invalid_rollouts: int = 0
    rewards: list[float] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)


@dataclass
class LossSums:
    """What a step adds up over its micro-batches and then across ranks: the loss, the sampled
    tokens, and per-token sums of the importance ratio, of clipped and truncated (TIS) tokens, of
    tokens whose ratio is outside grpo.MISMATCH_BAND and of the KL term; `ratio_max` is a maximum,
    not a sum.

    Why named fields: the metrics read them by name, where `sums[3]` said nothing. The all-reduce
    still packs the sums into one float64 tensor (one collective) and the maximum into another."""

    loss: float = 0.0
    tokens: float = 0.0
    ratio: float = 0.0
    clipped: float = 0.0
    truncated: float = 0.0
    kl: float = 0.0
    ratio_max: float = 0.0
    outside: float = 0.0

    def add(self, part: LossSums) -> None:
        """Add one micro-batch's figures (a NaN ratio maximum stays NaN, as torch.maximum keeps it)."""
        self.loss += part.loss
        self.tokens += part.tokens
        self.ratio += part.ratio
        self.clipped += part.clipped
        self.truncated += part.truncated
        self.kl += part.kl
        self.outside += part.outside
        if math.isnan(part.ratio_max) or part.ratio_max > self.ratio_max:
            self.ratio_max = part.ratio_max

    def all_reduce(self, dist: Dist) -> None:
        """Sum the sums and take the maximum across ranks, in place."""
        sums = torch.tensor([self.loss, self.tokens, self.ratio, self.clipped, self.truncated, self.kl,
                             self.outside], dtype=torch.float64)
        ratio_max = torch.tensor([self.ratio_max], dtype=torch.float64)
        dist.sum_(sums)
        dist.max_(ratio_max)
        self.loss, self.tokens, self.ratio, self.clipped, self.truncated, self.kl, self.outside = (
            float(x) for x in sums)
        self.ratio_max = float(ratio_max[0])


class Trainer:
    """One rank's model, optimizer and loop state."""

    def __init__(self, cfg: TrainConfig, dist: Dist) -> None:
        from peft import LoraConfig, get_peft_model

        from burstrl.model.hf import load_model, load_tokenizer

        self.cfg, self.dist = cfg, dist
        self.run_dir = Path(cfg.run_dir)
        self.device = dist.device
        cores = max(1, len(os.sched_getaffinity(0)) // dist.world) if hasattr(os, "sched_getaffinity") else 1
        torch.set_num_threads(cfg.trainer.num_threads or cores)
        torch.manual_seed(cfg.trainer.seed)
        random.seed(cfg.trainer.seed)
        base = load_model(cfg.model.path, cfg.model.dtype, str(self.device), cfg.trainer.attention)
        lora = LoraConfig(r=cfg.lora.rank, lora_alpha=cfg.lora.alpha, target_modules=cfg.lora.target_modules,
                          lora_dropout=0.0, task_type="CAUSAL_LM")
        self.model = get_peft_model(base, lora)
        self.model.train()
        self.recompute = recompute.apply(self.model, cfg.trainer.activation_checkpointing)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        for p in self.params:  # bf16 base, fp32 adapter and optimizer state (PEFT casts inputs)
            p.data = p.data.float()
        self.tokenizer = load_tokenizer(cfg.model.path)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else 0
        t = cfg.trainer
        self.optimizer = torch.optim.AdamW(self.params, lr=t.lr, weight_decay=t.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / t.warmup_steps) if t.warmup_steps else 1.0)
        self.loss_cfg = t  # clip_low, clip_high, tis_cap, kl_coef
        self.store = RolloutStore(cfg.store or self.run_dir / "store.sqlite") if dist.is_main else None
        self.step = 0
        self.publisher = Publisher(cfg, dist)
        self.tensorboard: Any = None  # SummaryWriter, made on first use (rank 0)

    # ---- start / resume ----
    def start(self, resume: bool) -> None:
        last = self.dist.broadcast(self.store.last_step() if self.store else 0)
        if last and not resume:
            raise TrainError(f"{self.run_dir} already has {last} committed steps: pass --resume to "
                             "continue, or use a new run_dir")
        if self.dist.is_main:
            checkpoint.prune(self.run_dir, last)
            self.repair_metrics(last)
        self.dist.barrier()
        if last:
            self._load(checkpoint.step_dir(self.run_dir, last))
            # a crash may have come between the commit and the publish: publishing is idempotent
            publish_version(self.cfg, last, checkpoint.step_dir(self.run_dir, last) / "adapter", self.dist)
        self.step = last

    def _load(self, path: Path) -> None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        state = checkpoint.load_state(path)
        set_peft_model_state_dict(self.model, load_file(str(path / "adapter" / "adapter_model.safetensors")))
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        checkpoint.restore_rng(state)
        log.info("resumed from %s (step %d)", path, state["step"])

    # ---- the loop ----
    def run(self) -> None:
        while self.step < self.cfg.trainer.steps:
            self.train_step(self.step + 1)

    def train_step(self, step: int) -> dict[str, Any]:
        times: dict[str, float] = {}
        t0 = time.monotonic()
        maybe_crash("wait", step)
        batch = self.next_batch(step)
        times["wait_s"] = time.monotonic() - t0
        t1 = time.monotonic()
        stats = self.optimize(batch, step)
        times["compute_s"] = time.monotonic() - t1
        t2 = time.monotonic()
        ckpt = self.commit(step, batch, {"step": step, **stats, **times})
        times["checkpoint_s"] = time.monotonic() - t2
        t3 = time.monotonic()
        push = self.publisher.publish(step, ckpt / "adapter")
        maybe_crash("published", step)
        times["publish_s"] = time.monotonic() - t3
        self.step = step
        metrics = {"step": step, "time": time.time(), **stats, **times, "step_s": time.monotonic() - t0, **push}
        if self.dist.is_main:
            self.write_metrics(metrics)
        return metrics

    def next_batch(self, step: int) -> StepBatch:
        """Rank 0 waits for enough groups and takes them; every rank gets the same batch."""
        groups = None
        if self.store is not None:
            t = self.cfg.trainer
            deadline = time.monotonic() + t.wait_timeout_s if t.wait_timeout_s else None
            while True:  # poll the cheap count; decode groups only once enough are buffered
                left = deadline - time.monotonic() if deadline is not None else 3600.0
                self.store.wait_for(t.batch_groups, timeout_s=max(left, 0.0), poll_s=t.poll_s)
                groups = self.store.take(t.batch_groups, trainer_version=step - 1, max_staleness=t.max_staleness)
                if len(groups) >= t.batch_groups:
                    break  # (fewer: some were too stale and set aside; wait for more)
                if deadline is not None and time.monotonic() > deadline:
                    raise TrainError(f"step {step}: fewer than {t.batch_groups} groups arrived in "
                                     f"{t.wait_timeout_s:.0f} s ({len(groups)} buffered)")
        groups = self.dist.broadcast(groups)
        return self.sequences(groups, step)

    def sequences(self, groups: list[Group], step: int) -> StepBatch:
        batch = StepBatch(groups=groups, sequences=[], kept_groups=0, zero_variance_groups=0)
        for group in groups:
            rewards = [r.reward for r in group.rollouts]
            batch.rewards += rewards
            batch.staleness.append(step - 1 - group.version)
            advantages = group_advantages(rewards, self.cfg.trainer.std_norm)
            if advantages is None:
                batch.zero_variance_groups += 1
                continue
            batch.kept_groups += 1
            for rollout, adv in zip(group.rollouts, advantages, strict=False):
                seqs = rollout_sequences(rollout, adv)
                if any(not self._fits(s) for s in seqs):
                    batch.invalid_rollouts += 1  # out-of-vocabulary ids or too long: never trained on
                    log.warning("step %d: rollout %s skipped: ids outside the vocabulary or context",
                                step, rollout.id)
                    continue
                batch.sequences += seqs
        return batch

    def _fits(self, seq: Sequence) -> bool:
        cfg = self.model.config
        return max(seq.tokens) < cfg.vocab_size and len(seq.tokens) <= cfg.max_position_embeddings

    def optimize(self, batch: StepBatch, step: int) -> dict[str, Any]:
        """Forward/backward this rank's share, sum gradients across ranks, one optimizer step."""
        seqs = batch.sequences
        total_tokens = sum(s.sampled for s in seqs)
        sums = LossSums()
        self.optimizer.zero_grad(set_to_none=True)
        mine = shard(seqs, self.dist.rank, self.dist.world)
        for mb in micro_batches(mine, self.cfg.trainer.micro_batch_tokens):
            maybe_crash("backward", step)
            loss, part = self._micro_step(mb, total_tokens, len(seqs))
            loss.backward()
            sums.add(part)
        self.dist.sum_grads(self.params)
        sums.all_reduce(self.dist)
        grad_norm = 0.0
        if total_tokens:
            if self.cfg.trainer.grad_clip > 0:
                grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.trainer.grad_clip))
            self.optimizer.step()
            self.scheduler.step()
        tokens = max(sums.tokens, 1.0)
        rewards = torch.tensor(batch.rewards or [0.0])
        return {
            "loss": sums.loss, "tokens": int(sums.tokens), "sequences": len(seqs),
            "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std(unbiased=False)),
            "groups": len(batch.groups), "kept_groups": batch.kept_groups,
            "zero_variance_groups": batch.zero_variance_groups, "invalid_rollouts": batch.invalid_rollouts,
            "staleness_mean": sum(batch.staleness) / max(len(batch.staleness), 1),
            "staleness_max": max(batch.staleness, default=0),
            # behaviour (captured) vs recomputed, before the update: the mismatch the step trains on
            "ratio_mean": sums.ratio / tokens, "ratio_max": sums.ratio_max, "ratio_outside_frac": sums.outside / tokens,
            "clip_frac": sums.clipped / tokens, "tis_frac": sums.truncated / tokens,
            "kl": sums.kl / tokens, "grad_norm": grad_norm, "lr": self.scheduler.get_last_lr()[0],
            "skipped_update": total_tokens == 0,
        }

    def _micro_step(self, mb: list[Sequence], total_tokens: int, total_seqs: int) -> tuple[torch.Tensor, LossSums]:
        p = pack(mb, self.pad_id, self.device)
        self.recompute.begin()
        logp = self._token_logprobs(p.input_ids, p.attention_mask)  # [B, L-1]
        self.recompute.verify()  # under "attention": one saved attention op per layer, else fail loudly
        sel = p.target_mask
        rows = torch.arange(len(mb), device=self.device)[:, None].expand_as(sel)[sel]
        ref = None
        if self.loss_cfg.kl_coef > 0:
            with torch.no_grad(), self.model.disable_adapter():
                ref = self._token_logprobs(p.input_ids, p.attention_mask)[sel]
        out = token_loss(logp[sel], p.old_logprobs[sel], p.advantages[rows], self.loss_cfg, ref)
        loss = aggregate(out.loss, rows, sel.sum(dim=1), self.cfg.trainer.loss_agg, max(total_tokens, 1),
                         max(total_seqs, 1))
        n = int(sel.sum())
        part = LossSums(loss=float(loss.detach()), tokens=float(n), ratio=float(out.ratio.sum()),
                        clipped=float(out.clipped.sum()), truncated=float(out.truncated.sum()),
                        kl=float(out.kl.sum()) if out.kl is not None else 0.0,
                        ratio_max=float(out.ratio.max()) if n else 0.0,
                        outside=float(out.outside.sum()) if out.outside is not None else 0.0)
        return loss, part

    def _token_logprobs(self, ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        """log pi(token_j | tokens_<j) for j = 1..L-1: [B, L-1], float32."""
        logits = self.model(input_ids=ids, attention_mask=attention, use_cache=False).logits[:, :-1].float()
        if self.cfg.temperature != 1.0:  # the behaviour logprobs are of logits / T
            logits = logits / self.cfg.temperature
        targets = ids[:, 1:]
        return logits.gather(-1, targets[..., None])[..., 0] - torch.logsumexp(logits, dim=-1)

    # ---- commit ----
    def commit(self, step: int, batch: StepBatch, stats: dict[str, Any]) -> Path:
        """Checkpoint, then commit the step's consumption marks: the step's commit point."""
        path = checkpoint.step_dir(self.run_dir, step)
        if self.dist.is_main:
            path = checkpoint.save(self.run_dir, step, self.model, self.optimizer, self.scheduler,
                                   {"groups": [g.id for g in batch.groups]})
            maybe_crash("checkpoint_written", step)
            meta = {"checkpoint": str(path), "trainer_version": step - 1, "metrics": stats}
            self.store.commit_step(step, [g.id for g in batch.groups], meta)
            maybe_crash("committed", step)
            checkpoint.prune(self.run_dir, step)
        self.dist.barrier()
        return path

    def repair_metrics(self, last: int) -> None:
        """Make metrics.jsonl hold exactly one line per committed step (1..last), in order.

        A crash after a step's commit but before its metrics line loses the line (recovered here
        from the step's record in the store); a crash before the commit may leave a line for a step
        that will run again (dropped here).
        """
        path = self.run_dir / "metrics.jsonl"
        lines: dict[int, str] = {}
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    step = int(json.loads(line)["step"])
                except (ValueError, KeyError, TypeError):
                    continue  # a torn last line
                if step <= last:
                    lines.setdefault(step, line)
        for step in range(1, last + 1):
            if step not in lines:
                meta = self.store.step_meta(step) or {}
                lines[step] = json.dumps({**meta.get("metrics", {"step": step}), "step": step, "recovered": True})
        write_text(path, "".join(lines[s] + "\n" for s in sorted(lines)))

    def write_metrics(self, metrics: dict[str, Any]) -> None:
        """One line per step in metrics.jsonl (fsynced), and the numbers to TensorBoard."""
        path = self.run_dir / "metrics.jsonl"
        with open(path, "a") as f:
            f.write(json.dumps(metrics) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if self.tensorboard is None:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(str(self.run_dir / "tensorboard"))
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                self.tensorboard.add_scalar(f"train/{key}", value, metrics["step"])
        self.tensorboard.flush()
        log.info("step %d: loss %.4f reward %.3f kept %d/%d groups, %.2f s", metrics["step"], metrics["loss"],
                 metrics["reward_mean"], metrics["kept_groups"], metrics["groups"], metrics["step_s"])

    def close(self) -> None:
        self.publisher.wait()  # the last version reaches the replicas before the trainer exits
        if self.store is not None:
            self.store.close()
        if self.tensorboard is not None:
            self.tensorboard.close()


def train(cfg: TrainConfig, resume: bool = False) -> None:
    """Run this rank until `trainer.steps` steps are committed."""
    from burstrl.model.hf import resolve_device

    dist = Dist(cfg.trainer.backend, resolve_device(cfg.model.device))
    if dist.is_main:
        run_dir = Path(cfg.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "train_config.toml").write_text(dump_toml(cfg))
    trainer = Trainer(cfg, dist)
    try:
        trainer.start(resume)
        trainer.run()
    finally:
        trainer.close()
        dist.close()
