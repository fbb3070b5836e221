"""Decode steps of a batch that mixes LoRA versions: this tree vs a before tree, side by side.

Why: on a shared fleet every replica serves several tenants' adapters at once, so its batches mix
versions. Before the concatenated path (`inference/lora.py` LoraBatch) a batch did one matmul pair
per adapter per projection, and a step mixing three versions cost ~1.4x one with a single version
on the tiny model. This times the engine's own runner (`ModelRunner.forward` over a `DecodeBatch`,
the batch's LoraBatch built once, as the engine keeps it while rows stay) for `--rows` rows with
64-token prompts, decoding `--steps` tokens, in three cases: the base model, one adapter on every
row, and three adapters (rank 8, every projection) taking turns by row. Each tree runs in its own
subprocess (`PYTHONPATH=<tree>/src`), sides alternate by round, one torch thread; the figures are
medians of per-round mean step times, and the ratios three / one (the mixing penalty) per tree and
after / before per case.

    .venv/bin/python benchmarks/lora_mix.py --before 0596dc0              # tiny model, ~1 min
    .venv/bin/python benchmarks/lora_mix.py --before 0596dc0 --gemma --rounds 3 --steps 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CASES = ("base", "one", "three")


def side(model: str, rows: int, steps: int) -> dict[str, float]:
    """In a subprocess of one tree: mean ms per decode step for each case."""
    import torch
    from transformers import AutoModelForCausalLM

    from burstrl.inference.dense import DecodeBatch, PackedPrefillAttention, SessionKV
    from burstrl.inference.lora import LoraAdapter, LoraBatch
    from burstrl.inference.runner import ModelRunner

    torch.set_num_threads(1)
    runner = ModelRunner(AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval())
    adapters = [random_adapter(runner, LoraAdapter, seed) for seed in range(3)]
    which = {"base": [None] * rows, "one": [adapters[0]] * rows, "three": [adapters[r % 3] for r in range(rows)]}

    def new_kv() -> SessionKV:
        return SessionKV(runner.num_layers, runner.num_kv_heads, runner.head_dim, runner.dtype, runner.device, 4)

    @torch.no_grad()
    def one_case(rows_adapters: list[Any]) -> float:
        batch = DecodeBatch(runner.num_layers, runner.num_kv_heads, runner.head_dim, runner.dtype,
                            runner.device, runner.scaling)
        for adapter in rows_adapters:
            kv, ids = new_kv(), list(range(5, 69))
            att = PackedPrefillAttention([kv], [len(ids)], runner.scaling)
            runner.forward(torch.tensor([ids]), torch.arange(len(ids))[None], att,
                           LoraBatch([adapter]) if adapter else None)
            att.commit()
            batch.add(kv)
        lora = LoraBatch(rows_adapters) if any(rows_adapters) else None
        start = time.perf_counter()
        for _ in range(steps):
            batch.prepare()
            runner.forward(torch.tensor([[7]] * len(rows_adapters)), batch.lens[:, None].clone(), batch, lora)
            batch.advance()
        return (time.perf_counter() - start) / steps * 1e3

    one_case(which["three"])  # first-call costs off the clock
    return {case: one_case(which[case]) for case in CASES}


def random_adapter(runner: Any, cls: type, seed: int) -> Any:
    """Rank 8 on every projection of every layer (the trainer's targets), scale 2."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for i, layer in enumerate(runner.layers):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            module = getattr(layer.self_attn if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else layer.mlp,
                             name)
            a = torch.randn(8, module.in_features, generator=gen) * 0.05
            b = torch.randn(module.out_features, 8, generator=gen) * 0.05
            weights[(i, name)] = (a, b, 2.0)
    return cls(name=f"policy-v{seed + 1}", path="(bench)", rank=8, weights=weights)


def checkout(rev: str) -> Path:
    dest = Path(tempfile.mkdtemp(prefix="burstrl-before-"))
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "src"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest


def run_side(tree: Path, model: str, rows: int, steps: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": f"{tree / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, __file__, "--side", model, "--rows", str(rows), "--steps", str(steps)],
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", default="", help="the tree to compare with (a git revision)")
    ap.add_argument("--gemma", action="store_true", help="Gemma 3 270M (fp32) instead of the tiny model")
    ap.add_argument("--rows", type=int, default=12)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--side", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side:
        print(json.dumps(side(args.side, args.rows, args.steps)))
        return
    sys.path.insert(0, str(REPO / "src"))
    if args.gemma:
        from burstrl.model.gguf import default_gemma_dir
        model = str(default_gemma_dir())
    else:
        from burstrl.launcher.preflight import quickstart_model
        model = str(quickstart_model())
    trees = {"after": REPO, **({"before": checkout(args.before)} if args.before else {})}
    got: dict[str, dict[str, list[float]]] = {t: {c: [] for c in CASES} for t in trees}
    for i in range(args.rounds):
        for name in (list(trees) if i % 2 == 0 else list(reversed(trees))):
            for case, ms in run_side(trees[name], model, args.rows, args.steps).items():
                got[name][case].append(ms)
            print(f"round {i + 1}/{args.rounds} {name}: done", file=sys.stderr)
    med = {t: {c: round(statistics.median(v), 3) for c, v in cases.items()} for t, cases in got.items()}
    result: dict[str, Any] = {"model": "gemma-3-270m" if args.gemma else "tiny", "rows": args.rows,
                              "steps": args.steps, "rounds": args.rounds, "ms_per_step": med,
                              "three_over_one": {t: round(m["three"] / m["one"], 3) for t, m in med.items()}}
    if "before" in med:
        result["after_over_before"] = {c: round(med["after"][c] / med["before"][c], 3) for c in CASES}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
