"""CPU seconds of one push's work, old code against new, side by side in one process.

Why CPU seconds: on a shared 2-core host wall time is mostly waiting for a core (see the weight
push sections of docs/benchmarks.md); `time.process_time` (all threads of this process) counts the
work itself. Measured, interleaved round by round, medians:

- the sender's pack (`pack_adapter`: read the two PEFT files, tar them, sha256) with W = 1;
- one replica's side: take the shard's bytes, hash and stage them, the manifest, and the commit
  (verify, unpack, load to bfloat16), in process, without HTTP.

The old side is `burstrl.protocol.adapters` and `burstrl.inference.adapters` as of `--old` (a git
commit), read with `git show` into a temp dir; both sides use this tree's `inference.lora`.

    PYTHONPATH=src .venv/bin/python benchmarks/push_cpu.py --adapter .cache/bench-qwen3-2048x5632-l22-lora-r32
"""

from __future__ import annotations

import argparse
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

import torch

from burstrl.inference.adapters import AdapterRegistry
from burstrl.protocol.adapters import pack_adapter

REPO = Path(__file__).resolve().parents[1]


def old_module(commit: str, path: str, name: str, tmp: Path):
    source = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=REPO, check=True, capture_output=True,
                            text=True).stdout
    file = tmp / f"{name}.py"
    file.write_text(source)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def clock(fn: Callable[[], object]) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--adapter", required=True, help="A PEFT adapter directory.")
    p.add_argument("--layers", type=int, default=22, help="Decoder layers of its base model.")
    p.add_argument("--old", default="7013ae0", help="The commit whose code is the old side.")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)  # as a replica runs (--engine.num_threads 1)
    tmp = Path(tempfile.mkdtemp(prefix="push-cpu-"))
    try:
        old_pack = old_module(args.old, "src/burstrl/protocol/adapters.py", "old_pack", tmp)
        old_reg = old_module(args.old, "src/burstrl/inference/adapters.py", "old_reg", tmp)
        src = Path(args.adapter)
        rows: dict[str, list[tuple[float, float]]] = {k: [] for k in ("pack_old", "pack_new", "replica_old",
                                                                      "replica_new")}
        for _ in range(args.rounds):
            rows["pack_old"].append(clock(lambda: old_pack.pack_adapter(src, 1, "v")))
            rows["pack_new"].append(clock(lambda: pack_adapter(src, 1, "v")))
            manifest, shards = pack_adapter(src, 1, "v")
            for key, cls in (("replica_old", old_reg.AdapterRegistry), ("replica_new", AdapterRegistry)):
                state = tmp / "state"
                shutil.rmtree(state, ignore_errors=True)
                reg = cls(state, args.layers, torch.bfloat16, torch.device("cpu"))

                def receive_and_commit(reg=reg, key=key, shards=shards, manifest=manifest) -> None:
                    # what each path holds after reading the body: bytes (uvicorn) or a bytearray (bulk)
                    data = bytearray(shards[0]) if key == "replica_new" else bytes(shards[0])
                    reg.put_shard("v", 0, 1, data, manifest.shard_sha256[0])
                    reg.put_manifest("v", manifest.to_json())
                    reg.commit("v")

                rows[key].append(clock(receive_and_commit))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out = {k: {"cpu_s": round(statistics.median(c for _, c in v), 3),
               "wall_s": round(statistics.median(w for w, _ in v), 3)} for k, v in rows.items()}
    print(json.dumps({"benchmark": "push_cpu", "old": args.old, "rounds": args.rounds,
                      "tar_bytes": manifest.total_bytes, "figures": out}))


if __name__ == "__main__":
    sys.exit(main())
