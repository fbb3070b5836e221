#!/usr/bin/env bash
# The project's GPU figures in one call, for a session that is lent a CUDA GPU.
#
#   bash benchmarks/gpu_check.sh             # needs a CUDA GPU; ~6-9 min on one H200 before the functions step (estimated +3-5 min, not run yet)
#   bash benchmarks/gpu_check.sh --dry-run   # no GPU: checks the commands parse, runs the GRPO step on CPU
#
# Prints one JSON object per check on stdout ({"check", "ok", "rc", "seconds", "result"}; "tail" holds
# the end of the check's stderr when it failed) and a last {"check": "summary"} line; progress and logs
# go to stderr and to $GPU_CHECK_LOGS (default: a temp dir). Checks, each under its own time limit:
#   gpu_tests  the `gpu` pytest marker tests (tests/unit)
#   engine     benchmarks/replica.py on a Qwen3-shaped ~1B model in bf16: the engine (paged KV: block
#              tables, length-grouped block gathers per decode step) vs HF generate (engine_vs_generate)
#              and vs a bare forward loop over a dense preallocated cache (engine_efficiency)
#   grpo_step  one bf16 LoRA-GRPO optimizer step (the trainer's token loss) on the same model
#   recompute  benchmarks/recompute.py at 8k and 32k tokens (none / full / attention checkpointing)
#   push       benchmarks/weight_sync.py with two CUDA replicas (push vs raw loopback vs the volume)
#   gemma3_model, engine_gemma3, engine_gemma3_generic
#              benchmarks/replica.py --quick in bf16 on a random model of Gemma 3 270M's shape (18 layers,
#              5 of 6 sliding with a 512 window, GQA 4:1, head dim 256) with the tiny model's tokenizer
#              (vocabulary 2048, not 262k): the fast runner over paged KV with sliding windows and its
#              start-up probe on a GPU, then the same with --engine-path generic (the two side by side).
#              The real Gemma 3 270M cannot reach the GPU machine (1 GB; no package registry there).
#   kv_window_gemma3  benchmarks/kv_window.py on the same model, 8 sessions x 4,096 tokens: KV bytes per
#              token and the decode step with window-only KV for the sliding layers vs every block kept
#   vllm_engine  benchmarks/vllm_engine.py --gpu on that model in bf16: bare vLLM vs burstrl serving from
#              vLLM vs burstrl's own engine (wrapper_vs_bare, vllm_vs_own). Only where a CUDA vLLM is
#              installed (`make vllm` with the registry reachable, or $BURSTRL_VLLM_PYTHON): the GPU
#              machine reaches no registry and vLLM (GBs) cannot travel with the working tree, so
#              without one the check reports itself skipped (ok, "skipped": why) and measures nothing.
#   functions  benchmarks/functions.py --quick on that random Gemma-3-shaped model (device and dtype
#              auto: CUDA, bf16): the whole RL loop of issue 35 (eval, router, replica, sandboxes,
#              store, LoRA trainer, pushes) on a GPU, for its step costs (wait_s / compute_s) only:
#              random weights write no correct function, so its Pass@1 and lift say nothing.
# Exit status: 0 when every check passed, 1 when one failed, 2 without a GPU (and not --dry-run).
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
MODE=run
case "${1:-}" in
  --dry-run|--cpu) MODE=dry ;;
  "") ;;
  *) echo "usage: $0 [--dry-run]" >&2; exit 2 ;;
esac
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
LOGS="${GPU_CHECK_LOGS:-$(mktemp -d -t gpu-check-XXXXXX)}"
mkdir -p "$LOGS"
LAYERS="${GPU_CHECK_LAYERS:-22}"
MODEL_DIR=".cache/bench-qwen3-2048x5632-l$LAYERS"
FAILED=0

log() { echo "[gpu-check $(date -u +%H:%M:%S)] $*" >&2; }

# emit NAME RC MILLISECONDS: one JSON line from the check's stdout (its last JSON line) and stderr tail
emit() {
  "$PY" - "$1" "$2" "$3" "$LOGS/$1.out" "$LOGS/$1.err" <<'EOF'
import json, sys
name, rc, secs, out, err = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) / 1000, sys.argv[4], sys.argv[5]
result = None
for line in reversed(open(out, errors="replace").read().splitlines()):
    try:
        result = json.loads(line)
        break
    except ValueError:
        continue
row = {"check": name, "ok": rc == 0, "rc": rc, "seconds": round(secs, 1), "result": result}
if rc != 0:
    row["tail"] = open(err, errors="replace").read()[-2000:]
if result is None and rc == 0:
    row["stdout_tail"] = open(out, errors="replace").read()[-1000:]
print(json.dumps(row), flush=True)
EOF
}

# check NAME LIMIT_S CMD...: run CMD under a time limit, then emit its line
check() {
  local name=$1 limit=$2 start rc
  shift 2
  log "$name: $(echo "$*" | head -c 160 | tr '\n' ' ')"
  start=$(date +%s%N)
  timeout --kill-after=10 "$limit" "$@" >"$LOGS/$name.out" 2>"$LOGS/$name.err"
  rc=$?
  [ "$rc" -eq 0 ] || FAILED=1
  emit "$name" "$rc" "$(( ($(date +%s%N) - start) / 1000000 ))"
}

# In --dry-run a benchmark's argument parser checks the exact arguments, and the script stops there:
# `bench` queues each one (NUL-separated files in $LOGS) and `parse_queued` runs every parse in one
# Python process at the end (torch and the benchmarks' imports loaded once, not once per benchmark).
PARSE_ALL='
import argparse, io, json, os, runpy, sys, time, traceback
from contextlib import redirect_stderr
class Parsed(Exception):
    pass
real = argparse.ArgumentParser.parse_args
def parse_only(self, args=None, namespace=None):
    real(self, args, namespace)
    raise Parsed
argparse.ArgumentParser.parse_args = parse_only
queue, failed = sys.argv[1], False
for entry in sorted(os.listdir(queue), key=int):
    name, script, *args = open(os.path.join(queue, entry), "rb").read().decode().split("\0")[:-1]
    start, err, rc = time.monotonic(), io.StringIO(), 1
    sys.argv = [script, *args]
    with redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
            print(f"{script}: ran to its end without parsing its arguments", file=err)
        except Parsed:
            rc = 0
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc(file=err)
    row = {"check": name, "ok": rc == 0, "rc": rc, "seconds": round(time.monotonic() - start, 1),
           "result": {"parsed": True} if rc == 0 else None}
    if rc != 0:
        row["tail"] = err.getvalue()[-2000:]
    print(json.dumps(row), flush=True)
    failed = failed or rc != 0
sys.exit(1 if failed else 0)
'

QUEUED=0
bench() {  # bench NAME LIMIT SCRIPT ARGS...: run it, or in --dry-run queue it for parse_queued
  local name=$1 limit=$2 script=$3
  shift 3
  if [ "$MODE" = dry ]; then
    mkdir -p "$LOGS/parse"
    printf '%s\0' "$name" "$script" "$@" > "$LOGS/parse/$QUEUED"
    QUEUED=$((QUEUED + 1))
  else
    check "$name" "$limit" "$PY" "$script" "$@"
  fi
}

parse_queued() {  # one line per queued benchmark, as `check` prints them
  log "parsing the arguments of $QUEUED benchmarks in one process"
  timeout --kill-after=10 600 "$PY" -c "$PARSE_ALL" "$LOGS/parse" 2>"$LOGS/parse.err" || FAILED=1
}

GRPO_STEP='
import json, sys, time
import torch
from peft import LoraConfig, get_peft_model
from burstrl.config import TrainerSection
from burstrl.model.hf import load_model
from burstrl.trainer.grpo import aggregate, token_loss

model_dir, device, seq, batch = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
base = load_model(model_dir, "bfloat16" if dtype == torch.bfloat16 else "float32", device)
model = get_peft_model(base, LoraConfig(r=32, lora_alpha=64, lora_dropout=0.0, task_type="CAUSAL_LM",
                                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                        "gate_proj", "up_proj", "down_proj"]))
params = [p for p in model.parameters() if p.requires_grad]
for p in params:  # as the trainer: bf16 base, fp32 adapter and optimizer state
    p.data = p.data.float()
opt = torch.optim.AdamW(params, lr=1e-5)
cfg = TrainerSection()
gen = torch.Generator().manual_seed(0)
vocab = base.config.vocab_size
ids = torch.randint(3, vocab, (batch, seq), generator=gen).to(device)
adv = torch.randn(batch, generator=gen).to(device)
def sync():
    if device.startswith("cuda"):
        torch.cuda.synchronize()
def one_step():
    logits = model(input_ids=ids).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0].reshape(-1)
    old = (logp.detach() + 0.01 * torch.randn_like(logp))
    a = adv[:, None].expand(batch, seq - 1).reshape(-1)
    seq_index = torch.arange(batch, device=device)[:, None].expand(batch, seq - 1).reshape(-1)
    tl = token_loss(logp, old, a, cfg)
    loss = aggregate(tl.loss, seq_index, torch.full((batch,), seq - 1, device=device), cfg.loss_agg,
                     batch * (seq - 1), batch)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss)
one_step()  # warm-up: kernels, allocator, optimizer state
sync()
if device.startswith("cuda"):
    torch.cuda.reset_peak_memory_stats()
start = time.perf_counter()
loss = one_step()
sync()
step_s = time.perf_counter() - start
finite = all(bool(torch.isfinite(p).all()) for p in params)
print(json.dumps({"device": device, "dtype": str(next(base.parameters()).dtype), "layers": base.config.num_hidden_layers,
                  "tokens": batch * seq, "step_s": round(step_s, 4), "tokens_per_s": round(batch * seq / step_s, 1),
                  "loss": loss, "adapter_finite": finite,
                  "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.startswith("cuda") else None}))
sys.exit(0 if finite and loss == loss else 1)
'

GEMMA3_DIR=".cache/bench-gemma3-270m-shape"
MAKE_GEMMA3='
import shutil, sys
from pathlib import Path
import torch
from transformers import AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig
from burstrl.model.tiny import ensure_tiny_model
out, tiny = Path(sys.argv[1]), ensure_tiny_model(".cache/tiny-qwen3")
if not (out / "config.json").exists():
    tok = AutoTokenizer.from_pretrained(tiny)
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=len(tok), hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                           query_pre_attn_scalar=256, max_position_embeddings=32768, bos_token_id=tok.bos_token_id,
                           eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    Gemma3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    shutil.copy(tiny / "chat_template.jinja", out / "chat_template.jinja")
print("{\"model\": \"%s\"}" % out)
'

if [ "$MODE" = run ]; then
  if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo '{"check": "gpu", "ok": false, "error": "no CUDA GPU visible to torch: this script measures GPU figures only (use --dry-run to check it without one)"}'
    echo "gpu_check.sh: no CUDA GPU visible to torch; nothing measured. Run it on a machine with a GPU, or pass --dry-run." >&2
    exit 2
  fi
  check gpu_info 120 "$PY" -c 'import json, torch; p = torch.cuda.get_device_properties(0); print(json.dumps({"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1), "torch": torch.__version__, "cuda": torch.version.cuda}))'
  check model 600 "$PY" -c "import sys; sys.path.insert(0, 'benchmarks'); import json, weight_sync as w; m = w.ensure_model($LAYERS); a = w.ensure_adapter(m, 32); print(json.dumps({'model': str(m), 'adapter': str(a)}))"
  check gpu_tests 600 "$PY" -m pytest -m gpu -q -p no:cacheprovider tests/unit
  bench engine 900 benchmarks/replica.py --model "$MODEL_DIR" --batch 32 --new-tokens 128 --repeats 3 \
    --mixed-requests 64 --sessions 8 --turns 4 --cache-repeats 1 --capture-repeats 2
  check grpo_step 600 "$PY" -c "$GRPO_STEP" "$MODEL_DIR" cuda 2048 4
  bench recompute 900 benchmarks/recompute.py --device cuda --dtype bfloat16 --lengths 8192,32768 --rounds 2 \
    --layers 8 --hidden 2048 --heads 16 --kv-heads 8 --out "$LOGS/recompute.json"
  bench push 900 benchmarks/weight_sync.py --device cuda --replicas 2 --repeats 3 --layers "$LAYERS"
  check gemma3_model 600 "$PY" -c "$MAKE_GEMMA3" "$GEMMA3_DIR"
  bench engine_gemma3 900 benchmarks/replica.py --model "$GEMMA3_DIR" --quick
  bench engine_gemma3_generic 900 benchmarks/replica.py --model "$GEMMA3_DIR" --quick --engine-path generic
  bench kv_window_gemma3 900 benchmarks/kv_window.py --model "$GEMMA3_DIR" --sessions 8 --context 4096
  if "$PY" -c 'import sys; from burstrl.config.vllm import VllmSection; from burstrl.inference.vllm.process import vllm_python; vllm_python(VllmSection())' 2>/dev/null; then
    bench vllm_engine 900 benchmarks/vllm_engine.py --gpu --model "$GEMMA3_DIR" --dtypes bfloat16 --completions 64 --max-tokens 128
  else
    echo '{"check": "vllm_engine", "ok": true, "skipped": "no vLLM environment on this machine (make vllm needs the package registry)"}'
  fi
  bench functions 900 benchmarks/functions.py --model "$GEMMA3_DIR" --quick --work-dir "$LOGS/functions"
else
  log "dry run: checking that every command parses (no GPU needed; nothing is measured)"
  check syntax 60 bash -n "$0"
  check gpu_tests 300 "$PY" -m pytest -m gpu --collect-only -q -p no:cacheprovider tests/unit
  bench engine 900 benchmarks/replica.py --model "$MODEL_DIR" --batch 32 --new-tokens 128 --repeats 3 \
    --mixed-requests 64 --sessions 8 --turns 4 --cache-repeats 1 --capture-repeats 2
  check grpo_step 300 "$PY" -c "$GRPO_STEP" "$("$PY" -c 'from burstrl.model.tiny import ensure_tiny_model; print(ensure_tiny_model(".cache/tiny-qwen3"))')" cpu 32 2
  bench recompute 900 benchmarks/recompute.py --device cuda --dtype bfloat16 --lengths 8192,32768 --rounds 2 \
    --layers 8 --hidden 2048 --heads 16 --kv-heads 8 --out "$LOGS/recompute.json"
  bench push 900 benchmarks/weight_sync.py --device cuda --replicas 2 --repeats 3 --layers "$LAYERS"
  check gemma3_model 60 "$PY" -c 'import ast, sys; ast.parse(sys.argv[1]); print("{\"parsed\": true}")' "$MAKE_GEMMA3"
  bench engine_gemma3 900 benchmarks/replica.py --model "$GEMMA3_DIR" --quick
  bench engine_gemma3_generic 900 benchmarks/replica.py --model "$GEMMA3_DIR" --quick --engine-path generic
  bench kv_window_gemma3 900 benchmarks/kv_window.py --model "$GEMMA3_DIR" --sessions 8 --context 4096
  bench vllm_engine 900 benchmarks/vllm_engine.py --gpu --model "$GEMMA3_DIR" --dtypes bfloat16 --completions 64 --max-tokens 128
  bench functions 900 benchmarks/functions.py --model "$GEMMA3_DIR" --quick --work-dir "$LOGS/functions"
  parse_queued
fi
echo "{\"check\": \"summary\", \"ok\": $([ "$FAILED" -eq 0 ] && echo true || echo false), \"mode\": \"$MODE\", \"logs\": \"$LOGS\"}"
exit "$FAILED"
