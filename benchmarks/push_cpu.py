"""CPU seconds of one push's work, old code against new, side by side in one process, by phase.

Why CPU seconds: on a shared 2-core host wall time is mostly waiting for a core (see the weight
push sections of docs/benchmarks.md); `time.process_time` (all threads of this process) counts the
work itself. Measured, interleaved round by round, medians:

- the sender's pack with W = 1 and W = 4 shards (read the two PEFT files, tar them, sha256); the
  new side keeps one `Packer` from round to round, as the trainer does;
- `bf16`: the new code with the adapter cast to bfloat16 on the sender first
  (`trainer.publish.serving_files`: read, cast, serialize, then `Packer.pack_bytes`);
- one replica's side, in process, without HTTP: `receive` (copy the shard into the buffer the
  bulk listener reads into, hashing it as it goes: the listener's `readinto` + sha256) and
  `commit` (stage, manifest, verify, unpack, load to bfloat16), for W = 1 and W = 4.

The old side is `burstrl.protocol.adapters`, `burstrl.inference.adapters` and `burstrl.inference.lora`
as of `--old` (a git commit), read with `git show` into a temp dir and imported against each other.

    PYTHONPATH=src .venv/bin/python benchmarks/push_cpu.py --adapter .cache/bench-qwen3-2048x5632-l22-lora-r32
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

import burstrl.inference.adapters as new_reg
import burstrl.protocol.adapters as new_pack
from burstrl.trainer.publish import serving_files

REPO = Path(__file__).resolve().parents[1]
CHUNK = 1 << 20  # as the bulk listener reads


def old_modules(commit: str, tmp: Path) -> tuple[ModuleType, ModuleType]:
    """The old protocol.adapters and inference.adapters, the latter importing the old lora and protocol."""
    loaded = {}
    saved = {k: sys.modules[k] for k in ("burstrl.protocol.adapters", "burstrl.inference.lora")}
    try:
        for name, path in (("burstrl.protocol.adapters", "src/burstrl/protocol/adapters.py"),
                           ("burstrl.inference.lora", "src/burstrl/inference/lora.py"),
                           ("burstrl.inference.adapters", "src/burstrl/inference/adapters.py")):
            source = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=REPO, check=True,
                                    capture_output=True, text=True).stdout
            file = tmp / (name.replace(".", "_") + ".py")
            file.write_text(source)
            alias = "old_" + name.replace(".", "_")
            spec = importlib.util.spec_from_file_location(alias, file)
            module = importlib.util.module_from_spec(spec)
            sys.modules[alias] = module  # dataclasses look their module up there
            sys.modules[name] = module  # what the next old module imports
            spec.loader.exec_module(module)
            loaded[name] = module
    finally:
        sys.modules["burstrl.inference.adapters"] = new_reg
        sys.modules.update(saved)
    return loaded["burstrl.protocol.adapters"], loaded["burstrl.inference.adapters"]


def clock(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, out


def receive(reg: Any, shard: Any) -> tuple[bytearray, str]:
    """What the bulk listener does with a shard's body (the same code on both sides): read it into a
    buffer the registry hands out, hashing each MiB."""
    data = reg.take_buffer(len(shard))
    src, dst, hasher = memoryview(shard), memoryview(data), hashlib.sha256()
    for start in range(0, len(data), CHUNK):
        dst[start:start + CHUNK] = src[start:start + CHUNK]
        hasher.update(dst[start:start + CHUNK])
    return data, hasher.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--adapter", required=True, help="A PEFT adapter directory.")
    p.add_argument("--layers", type=int, default=22, help="Decoder layers of its base model.")
    p.add_argument("--old", default="7062184", help="The commit whose code is the old side.")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)  # as a replica runs (--engine.num_threads 1)
    tmp = Path(tempfile.mkdtemp(prefix="push-cpu-"))
    rows: dict[str, list[tuple[float, float]]] = {}
    try:
        old_pack, old_reg = old_modules(args.old, tmp)
        src, packer = Path(args.adapter), new_pack.Packer()
        bf16_packer = new_pack.Packer()
        sides = {"old": (old_pack.pack_adapter, old_reg.AdapterRegistry),
                 "new": (packer.pack, new_reg.AdapterRegistry),
                 "bf16": (lambda src, w, name: bf16_packer.pack_bytes(serving_files(src, "bfloat16"), w, name),
                          new_reg.AdapterRegistry)}
        regs = {side: reg(tmp / side, args.layers, torch.bfloat16, torch.device("cpu"))
                for side, (_, reg) in sides.items()}
        for rnd in range(args.rounds):
            for w in (1, 4):
                for side, (pack, _) in sides.items():
                    reg, name = regs[side], f"v{rnd}-w{w}"
                    wall, cpu, (manifest, shards) = clock(lambda pack=pack, w=w, name=name: pack(src, w, name))
                    rows.setdefault(f"{side}_w{w}_pack", []).append((wall, cpu))
                    wall, cpu, got = clock(lambda reg=reg, shards=shards: [receive(reg, s) for s in shards])
                    rows.setdefault(f"{side}_w{w}_receive", []).append((wall, cpu))

                    def commit(reg=reg, name=name, manifest=manifest, got=got) -> None:
                        for i, (data, digest) in enumerate(got):
                            reg.put_shard(name, i, manifest.num_shards, data, manifest.shard_sha256[i], digest=digest)
                        reg.put_manifest(name, manifest.to_json())
                        reg.commit(name)

                    wall, cpu, _ = clock(commit)
                    rows.setdefault(f"{side}_w{w}_commit", []).append((wall, cpu))
                    reg.unload(name, {})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out = {k: {"cpu_s": round(statistics.median(c for _, c in v), 3),
               "wall_s": round(statistics.median(w for w, _ in v), 3)} for k, v in rows.items()}
    print(json.dumps({"benchmark": "push_cpu", "old": args.old, "rounds": args.rounds, "figures": out}))


if __name__ == "__main__":
    sys.exit(main())
