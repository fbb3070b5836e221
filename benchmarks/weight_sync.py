"""Weight-sync benchmark: how fast a new policy version becomes servable on R replicas.

Prints one JSON object (one line) on stdout; progress goes to stderr. Contenders, interleaved
round by round on the same replicas and the same adapter bytes, medians over `--repeats` rounds:

- sharded push (`burstrl.weights.push`) with W = 1, 2, 4 senders (threads playing trainer ranks):
  pack the version as a tar cut into W shards (one `Packer` kept from round to round, as the
  trainer keeps one), PUT shards to every replica's bulk listener
  (`inference.bulk`) in parallel, commit; servable = every replica's commit returned 200 (the
  replica verified sha256s and loaded it from memory); `push_w1_main` is W = 1 with the shards sent
  over the replicas' main (uvicorn) servers instead, the path before the bulk listener;
  `push_w1_bf16` is W = 1 with the adapter cast to bfloat16 on the sender first (half the bytes,
  the same served weights), cast and pack timed together;
- the volume path: `publish` the version into a versions directory (copy, fsync, manifest, rename),
  then every replica `POST /v1/load_lora_adapter` from it, in parallel;
- the physical limit: the same bytes sent to R trivial receiver processes over loopback, as raw TCP
  (`sendall` -> `recv_into`) and as a plain HTTP PUT (httpx, body in slices as the push sends it)
  to a stdlib server that discards the body; measured every round like the others.

Goals: push throughput (R x tar bytes / push seconds, end to end) >= 0.5 of raw loopback
(`push_vs_loopback`; `send_vs_loopback` is the shard transfer alone), and push faster than the
volume path (`volume_over_push_time` > 1).

Model and adapter (synthetic, cached under .cache/): a random-init Qwen3 shaped like a ~1B model
(hidden 2048, intermediate 5632, 16 heads, 8 KV heads, head_dim 128, vocab 2048) with `--layers`
decoder layers (default 22, the count of a real ~1B model, so the adapter has its real size), served
in bfloat16; LoRA rank 32 on all 7 linear layers of every layer, float32 as PEFT saves it.

    .venv/bin/python benchmarks/weight_sync.py            # full run, ~45 s (+~30 s the first time)
    .venv/bin/python benchmarks/weight_sync.py --quick    # smoke test: 4 layers, 1 round, < 60 s
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from burstrl.protocol.adapters import Packer, pack_adapter
from burstrl.protocol.process import RoleProcess, start_replica
from burstrl.trainer.publish import serving_files
from burstrl.weights.gc import unload_old
from burstrl.weights.push import SEND_CHUNK, PushReport, ReplicaTarget, in_parallel, push_commit, send_shards
from burstrl.weights.volume import gc, publish

REPO = Path(__file__).resolve().parents[1]
TOKEN = "bench-admin-token"
SHAPE = {"hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 16,
         "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 2048}
REAL_LAYERS = 22
MB = 1e6

RECEIVER = r"""
import socket, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
if sys.argv[1] == "tcp":
    srv = socket.create_server(("127.0.0.1", 0))
    print(srv.getsockname()[1], flush=True)
    view = memoryview(bytearray(1 << 20))
    while True:
        conn, _ = srv.accept()
        with conn:
            n, got = int.from_bytes(conn.recv(8, socket.MSG_WAITALL), "big"), 0
            while got < n:
                k = conn.recv_into(view)
                if not k:
                    break
                got += k
            conn.sendall(b"k")
else:
    class Sink(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        def do_PUT(self):
            left = int(self.headers["Content-Length"])
            while left:
                left -= len(self.rfile.read(min(left, 1 << 20)))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()
        def log_message(self, *args):
            pass
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    print(srv.server_address[1], flush=True)
    srv.serve_forever()
"""


def log(msg: str) -> None:
    print(f"[bench-weight-sync {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=2, help="Replica processes R.")
    p.add_argument("--layers", type=int, default=REAL_LAYERS, help="Decoder layers of the model.")
    p.add_argument("--rank", type=int, default=32, help="LoRA rank.")
    p.add_argument("--senders", default="1,2,4", help="Sender counts W for the push, comma-separated.")
    p.add_argument("--repeats", type=int, default=3, help="Interleaved rounds; medians are reported.")
    p.add_argument("--quick", action="store_true", help="Smoke test: 4 layers, 1 round.")
    p.add_argument("--device", default="cpu", help="The replicas' torch device (cuda: push to GPU replicas).")
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.repeats = 4, 1
    args.senders = [int(w) for w in args.senders.split(",")]
    return args


def ensure_model(layers: int) -> Path:
    """The ~1B-shaped random Qwen3 with `layers` layers (tokenizer of the tiny model); cached."""
    out = REPO / ".cache" / f"bench-qwen3-2048x5632-l{layers}"
    if (out / "model.safetensors").is_file():
        return out
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from burstrl.model.tiny import ensure_tiny_model

    log(f"building the {layers}-layer benchmark model in {out} (once)")
    tiny = ensure_tiny_model(REPO / ".cache" / "tiny-qwen3")
    cfg = Qwen3Config(num_hidden_layers=layers, max_position_embeddings=4096, tie_word_embeddings=True,
                      bos_token_id=0, eos_token_id=2, pad_token_id=0, **SHAPE)
    with torch.device("meta"):  # no init pass: the weights are filled once, below
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model = model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gave the embedding and the LM head separate storage
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(1.0) if param.dim() == 1 else param.uniform_(-0.03, 0.03, generator=gen)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-bench-model-", dir=out.parent))
    model.save_pretrained(tmp)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(tiny / name, tmp / name)
    tmp.rename(out)
    return out


def ensure_adapter(model_dir: Path, rank: int) -> Path:
    out = model_dir.parent / f"{model_dir.name}-lora-r{rank}"
    if (out / "adapter_model.safetensors").is_file():
        return out
    from burstrl.model.lora import make_random_adapter

    log(f"making the rank-{rank} adapter in {out} (once)")
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-bench-lora-", dir=out.parent))
    make_random_adapter(model_dir, tmp, seed=1, rank=rank)
    tmp.rename(out)
    return out


def start_replicas(model_dir: Path, root: Path, count: int, device: str = "cpu") -> list[RoleProcess]:
    """`count` real replica processes (bfloat16, one torch thread each), started together."""
    reps: list[RoleProcess] = []

    def start(i: int) -> None:
        reps.append(start_replica(model_dir, root / f"replica{i}", "--server.admin_token", TOKEN,
                                  "--server.state_dir", str(root / f"replica{i}" / "state"),
                                  "--model.dtype", "bfloat16", "--model.device", device,
                                  "--engine.num_threads", "1",
                                  "--engine.max_total_num_tokens", "2048", timeout=300))

    try:
        in_parallel(start, list(range(count)))
    except BaseException:
        for rep in reps:
            rep.stop()
        raise
    return reps


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def push_trial(src: Path, name: str, targets: list[ReplicaTarget], senders: int, packer: Packer,
               pids: list[int], bulk: bool = True, dtype: str = "") -> dict[str, float]:
    """`burstrl.weights.push.push`, with a clock on each phase, and the CPU seconds spent in it.

    `packer` is kept from round to round, as the trainer's `Publisher` keeps one from version to
    version (the pack reads and hashes the files into the same buffer each time). CPU: the sender's
    (this process, all threads) and the replicas' (`pids`, summed), so a phase's wall time on a
    busy host can be told apart from its work. `dtype`: the trainer casts the adapter to the
    replicas' serving dtype before packing (`trainer.publish.serving_files`, timed in the pack).
    """
    row: dict[str, float] = {}
    out: dict[str, object] = {}

    def phase(key: str, fn: Callable[[], object]) -> None:
        cpu, rep = time.process_time(), replica_cpu_s(pids)
        row[f"{key}_s"], out[key] = timed(fn)
        row[f"{key}_cpu_s"] = time.process_time() - cpu
        row[f"{key}_replica_cpu_s"] = replica_cpu_s(pids) - rep

    phase("pack", lambda: packer.pack_bytes(serving_files(src, dtype), senders, name) if dtype
          else packer.pack(src, senders, name))
    manifest, shards = out["pack"]
    phase("send", lambda: PushReport.merge(in_parallel(
        lambda r: send_shards(manifest, shards, targets, r, senders, bulk=bulk), list(range(senders)))))
    phase("commit", lambda: push_commit(src, name, out["send"].usable(targets), senders, manifest=manifest))
    report = PushReport.merge([out["send"], out["commit"]])
    if report.failed or len(report.ok) != len(targets):
        raise RuntimeError(f"push failed: {report.to_json()}")
    return {"total_s": row["pack_s"] + row["send_s"] + row["commit_s"], **row}


def replica_cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of these processes so far (Linux /proc; 10 ms resolution)."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / os.sysconf("SC_CLK_TCK")


def volume_trial(src: Path, volume: Path, version: int, targets: list[ReplicaTarget],
                 pids: list[int]) -> dict[str, float]:
    """Publish into the versions directory, then every replica loads it from there (CPU split as in
    `push_trial`: the publisher's, then the replicas')."""
    name = f"policy-v{version}"
    cpu = time.process_time()
    t_pub, path = timed(lambda: publish(volume, version, src))
    publish_cpu, rep = time.process_time() - cpu, replica_cpu_s(pids)

    def load(t: ReplicaTarget) -> None:
        r = httpx.post(t.url + "/v1/load_lora_adapter", headers={"Authorization": f"Bearer {t.token}"},
                       json={"lora_name": name, "lora_path": str(path)}, timeout=120)
        r.raise_for_status()

    t_load, _ = timed(lambda: in_parallel(load, targets))
    return {"total_s": t_pub + t_load, "publish_s": t_pub, "publish_cpu_s": publish_cpu, "load_s": t_load,
            "load_replica_cpu_s": replica_cpu_s(pids) - rep}


def check_served(targets: list[ReplicaTarget], name: str, chat: bool) -> None:
    for t in targets:
        ids = [m["id"] for m in httpx.get(t.url + "/v1/models", timeout=30).json()["data"]]
        if name not in ids:
            raise RuntimeError(f"{t.url} does not list {name}")
        if chat:
            body = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            r = httpx.post(t.url + "/v1/chat/completions", json=body, timeout=120)
            if r.status_code != 200 or r.json()["meta_info"]["weight_version"] != name:
                raise RuntimeError(f"{t.url} cannot serve {name}: {r.text[:300]}")


class Sinks:
    """`receivers` trivial receiver processes per mode (raw TCP, stdlib HTTP): the loopback limit."""

    def __init__(self, receivers: int) -> None:
        self.procs: dict[str, list[subprocess.Popen]] = {}
        self.ports: dict[str, list[int]] = {}
        try:
            for mode in ("tcp", "http"):
                self.procs[mode] = [subprocess.Popen([sys.executable, "-c", RECEIVER, mode],
                                                     stdout=subprocess.PIPE, text=True) for _ in range(receivers)]
                self.ports[mode] = [int(p.stdout.readline()) for p in self.procs[mode]]
        except BaseException:
            self.close()
            raise

    def send(self, mode: str, blob: bytes) -> dict[str, float]:
        """Send `blob` to every receiver of `mode` at once; the time until all have it."""
        send = _tcp_send if mode == "tcp" else _http_put
        t, _ = timed(lambda: in_parallel(lambda port: send(port, blob), self.ports[mode]))
        return {"total_s": t}

    def close(self) -> None:
        for procs in self.procs.values():
            for p in procs:
                p.kill()
                p.wait()
                p.stdout.close()


def _tcp_send(port: int, blob: bytes) -> None:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(len(blob).to_bytes(8, "big"))
        s.sendall(blob)
        s.recv(1)


def _http_put(port: int, blob: bytes) -> None:
    """A plain PUT; the body in slices, as the push sends it (one big bytes body is slow in httpx)."""
    view = memoryview(blob)
    chunks = (view[i:i + SEND_CHUNK] for i in range(0, len(blob), SEND_CHUNK))
    httpx.put(f"http://127.0.0.1:{port}/sink", content=chunks, headers={"Content-Length": str(len(blob))},
              timeout=120).raise_for_status()


def median_of(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    import torch

    # the sender's cast (push_w1_bf16) on one thread, as the replicas run: on a busy 2-core host
    # torch's default OpenMP threads spin and the cast took 0.7 CPU s instead of 0.05
    torch.set_num_threads(1)
    model_dir = ensure_model(args.layers)
    src = ensure_adapter(model_dir, args.rank)
    adapter_bytes = (src / "adapter_model.safetensors").stat().st_size
    _, shards = pack_adapter(src, 1, "policy-v0")
    blob = bytes(shards[0])
    log(f"model {model_dir.name}; adapter {adapter_bytes / MB:.1f} MB (tar {len(blob) / MB:.1f} MB)")

    work = Path(tempfile.mkdtemp(prefix="bench-weight-sync-"))
    volume = work / "adapters"
    keys = ["loopback_tcp", "loopback_http", *(f"push_w{w}" for w in args.senders), "push_w1_main",
            "push_w1_bf16", "volume"]
    rows: dict[str, list[dict[str, float]]] = {key: [] for key in keys}
    version, reps, packer, bf16_packer = 0, [], Packer(), Packer()
    sinks = Sinks(args.replicas)
    try:
        for mode in ("tcp", "http"):
            sinks.send(mode, blob)  # warm-up: imports, first connections
        t_rep = time.perf_counter()
        reps = start_replicas(model_dir, work, args.replicas, args.device)
        log(f"{args.replicas} replicas up in {time.perf_counter() - t_rep:.1f}s")
        targets = [ReplicaTarget(r.url, TOKEN) for r in reps]
        pids = [r.proc.pid for r in reps]
        for rnd in range(args.repeats):
            for key in keys:
                if key.startswith("loopback"):
                    rows[key].append(sinks.send(key.removeprefix("loopback_"), blob))
                    continue
                version += 1
                name = f"policy-v{version}"
                if key == "volume":
                    row = volume_trial(src, volume, version, targets, pids)
                elif key == "push_w1_main":
                    row = push_trial(src, name, targets, 1, packer, pids, bulk=False)
                elif key == "push_w1_bf16":
                    row = push_trial(src, name, targets, 1, bf16_packer, pids, dtype="bfloat16")
                else:
                    row = push_trial(src, name, targets, int(key.removeprefix("push_w")), packer, pids)
                check_served(targets, name, chat=rnd == 0)
                rows[key].append(row)
                log(f"round {rnd}: {key} {row['total_s']:.2f}s")
                unload = unload_old(targets, keep_names=set())  # memory flat; off the clock
                if unload.failed:
                    raise RuntimeError(f"unload failed: {unload.to_json()}")
                gc(volume, keep=1)
    finally:
        sinks.close()
        for rep in reps:
            rep.stop()
        shutil.rmtree(work, ignore_errors=True)

    figures = {key: median_of(r) for key, r in rows.items()}
    delivered = args.replicas * len(blob) / MB
    for fig in figures.values():
        fig["MBps"] = delivered / fig["total_s"]
        if "send_s" in fig:
            fig["send_MBps"] = delivered / fig["send_s"]  # the shard transfer alone
    pushes = {k: v for k, v in figures.items() if k.startswith("push") and k not in ("push_w1_main", "push_w1_bf16")}
    best = min(pushes, key=lambda k: pushes[k]["total_s"])
    tcp, http = figures["loopback_tcp"]["MBps"], figures["loopback_http"]["MBps"]
    push_vs_loopback = figures[best]["MBps"] / tcp
    push_vs_volume = figures["volume"]["total_s"] / figures[best]["total_s"]
    result = {
        "benchmark": "weight_sync",
        "replicas": args.replicas,
        "model": {"layers": args.layers, **SHAPE, "dtype": "bfloat16", "weights": "random", "device": args.device},
        "adapter": {"rank": args.rank, "targets": 7, "dtype": "float32", "safetensors_bytes": adapter_bytes,
                    "tar_bytes": len(blob),
                    "bytes_at_22_layers": round(adapter_bytes * REAL_LAYERS / args.layers)},
        "figures": {key: {k: round(v, 4 if k.endswith("_s") else 1) for k, v in fig.items()}
                    for key, fig in figures.items()},
        "best_push": best,
        "push_vs_loopback": round(push_vs_loopback, 3),
        "push_vs_http_put": round(figures[best]["MBps"] / http, 3),
        "send_vs_loopback": round(figures[best]["send_MBps"] / tcp, 3),
        "volume_over_push_time": round(push_vs_volume, 3),
        # the same served weights, cast on the trainer: half the bytes; times, not MB/s, compared
        "bf16_push_vs_loopback_time": round(figures["loopback_tcp"]["total_s"] / figures["push_w1_bf16"]["total_s"], 3),
        "volume_over_bf16_push_time": round(figures["volume"]["total_s"] / figures["push_w1_bf16"]["total_s"], 3),
        "bulk_over_main_time": round(figures["push_w1_main"]["total_s"] / figures["push_w1"]["total_s"], 3)
        if "push_w1" in figures else None,
        "goals": {"push_vs_loopback": {"goal": ">= 0.5", "met": push_vs_loopback >= 0.5},
                  "volume_over_push_time": {"goal": "> 1 (push faster)", "met": push_vs_volume > 1}},
        "repeats": args.repeats,
        "quick": args.quick,
        "python": platform.python_version(),
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
