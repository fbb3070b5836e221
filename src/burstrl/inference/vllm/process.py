"""Start, watch and stop the vLLM server a replica drives.

Why a private Unix socket: the replica is vLLM's only client. On a socket in the replica's own state
directory (mode 0700) no other process on the host can reach vLLM, with or without its API key, and
there is no port to pick, race for or leave open. The API key is kept anyway (defence in depth).

Why its own process group, led by a guard: vLLM starts an engine-core process, workers and a
resource tracker; stopping it must end every one of them (`stop`), and a replica killed -9 must not
leave them running. The kernel's parent-death signal reaches only the direct child, and vLLM's
children outlive their parent (measured: engine core, worker and tracker still running 20 s after
the replica's SIGKILL). So the child is a shell guard (`GUARD`) whose parent-death signal is SIGUSR1:
it then SIGKILLs its whole group, vLLM's children included. A normal stop SIGTERMs the group (vLLM
shuts down gracefully) and SIGKILLs what is left.
"""

from __future__ import annotations

import ctypes
import logging
import os
import secrets
import signal
import subprocess
import time
from pathlib import Path

import httpx

from burstrl.config.vllm import VllmSection

log = logging.getLogger(__name__)
MODULE = "vllm.entrypoints.openai.api_server"
GUARD = 'trap "kill -KILL 0" USR1; "$@" & wait $!'  # `wait` returns on the trapped signal; the group dies


class VllmStartError(RuntimeError):
    """vLLM did not come up: its interpreter is missing, it exited, or it missed the start deadline."""


# `make vllm`'s environment beside the checkout (src/burstrl/inference/vllm -> the checkout)
DEFAULT_PYTHON = Path(__file__).resolve().parents[4] / ".venv-vllm" / "bin" / "python"


def vllm_python(cfg: VllmSection, default: Path = DEFAULT_PYTHON) -> str:
    """The interpreter vLLM runs under (see `VllmSection.python`); VllmStartError naming `make vllm` if none."""
    if cfg.python and not Path(cfg.python).is_file():
        raise VllmStartError(f"engine.vllm.python: {cfg.python}: no such interpreter")
    for path in (cfg.python, os.environ.get("BURSTRL_VLLM_PYTHON", ""), str(default)):
        if path and Path(path).is_file():
            return path
    raise VllmStartError("engine.backend = \"vllm\" needs vLLM's environment: run `make vllm`, or set "
                         "engine.vllm.python (or $BURSTRL_VLLM_PYTHON) to its interpreter")


def server_argv(python: str, model: str, dtype: str, max_model_len: int, socket: Path, api_key: str,
                cfg: VllmSection, cpu: bool) -> list[str]:
    """vLLM's command line: exact capture needs processed logprobs (after temperature and top-p, the
    distribution sampled from), and the token-in endpoint needs `--enable-scale-out`."""
    argv = [python, "-m", MODULE, "--model", model, "--dtype", dtype, "--uds", str(socket),
            "--api-key", api_key, "--max-model-len", str(max_model_len), "--served-model-name", "base",
            "--enable-lora", "--max-lora-rank", str(cfg.max_lora_rank), "--max-loras", str(cfg.max_loras),
            "--logprobs-mode", "processed_logprobs", "--enable-scale-out", "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--tensor-parallel-size", str(cfg.tensor_parallel_size), "--disable-uvicorn-access-log"]
    if not cpu:
        argv += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
    if cfg.enforce_eager:
        argv.append("--enforce-eager")
    return argv + list(cfg.extra_args)


def server_env(cfg: VllmSection, cpu: bool) -> dict[str, str]:
    """The child's environment: ours, plus vLLM's CPU settings (without a KV size vLLM demands 92% of
    RAM free at start) and runtime LoRA loading."""
    env = dict(os.environ, VLLM_ALLOW_RUNTIME_LORA_UPDATING="1", PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)  # burstrl's own packages must not shadow the vLLM environment's
    if cpu:
        cores = cfg.cpu_cores or _cores()
        env.update(VLLM_CPU_KVCACHE_SPACE=str(cfg.kv_cache_gib), VLLM_CPU_OMP_THREADS_BIND=cores)
    return env


def _cores() -> str:
    """The cores this process may run on, as vLLM's list syntax ("0,1,5")."""
    return ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))


class VllmProcess:
    """One vLLM server, child of this replica, listening on `socket` (see module docstring)."""

    def __init__(self, model: str, dtype: str, max_model_len: int, cfg: VllmSection, state_dir: Path,
                 cpu: bool) -> None:
        self.cfg, self.cpu, self.model, self.dtype = cfg, cpu, model, dtype
        self.socket = state_dir / "vllm.sock"
        self.log_path = state_dir / "vllm.log"
        self.api_key = secrets.token_urlsafe(24)
        self.argv = server_argv(vllm_python(cfg), model, dtype, max_model_len, self.socket, self.api_key, cfg, cpu)
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        """Spawn vLLM and return once /health answers 200 (VllmStartError with the log's tail otherwise)."""
        self.socket.unlink(missing_ok=True)
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(["bash", "-c", GUARD, "vllm-guard", *self.argv], stdin=subprocess.DEVNULL,
                                         stdout=out, stderr=subprocess.STDOUT, env=server_env(self.cfg, self.cpu),
                                         start_new_session=True, preexec_fn=_usr1_on_parent_death)
        log.info("vLLM starting (pid %d, log %s)", self.proc.pid, self.log_path)
        self._wait_healthy(time.monotonic() + self.cfg.start_timeout_s)

    def _wait_healthy(self, end: float) -> None:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(self.socket)), timeout=5.0) as client:
            while time.monotonic() < end:
                if self.proc.poll() is not None:
                    raise VllmStartError(f"vLLM exited with {self.proc.returncode} at start:\n{self.log_tail()}")
                if self.socket.exists():
                    try:
                        if client.get("http://vllm/health").status_code == 200:
                            return
                    except httpx.HTTPError:
                        pass
                time.sleep(0.5)
        self.stop(grace_s=1.0)
        raise VllmStartError(f"vLLM not healthy within {self.cfg.start_timeout_s:g} s:\n{self.log_tail()}")

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exit_reason(self) -> str:
        code = None if self.proc is None else self.proc.poll()
        return "not started" if self.proc is None else f"vLLM exited with {code}" if code is not None else ""

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM vLLM's process group, SIGKILL what is left of it after `grace_s`."""
        if self.proc is None:
            return
        pgid = self.proc.pid
        _signal_group(pgid, signal.SIGTERM)
        end = time.monotonic() + grace_s
        while time.monotonic() < end and _signal_group(pgid, 0):
            self.proc.poll()  # reaps the guard; vLLM's own processes are reaped by init once orphaned
            time.sleep(0.1)
        _signal_group(pgid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.socket.unlink(missing_ok=True)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def _usr1_on_parent_death() -> None:
    """In the forked child before exec: SIGUSR1 when the replica's thread that started it dies (kept
    across exec; the guard's trap turns it into SIGKILL for the whole group)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGUSR1)  # PR_SET_PDEATHSIG


def _signal_group(pgid: int, sig: int) -> bool:
    """Signal a process group; False once nothing is left in it."""
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def is_cpu(device: str) -> bool:
    """Whether vLLM runs on CPU: `model.device` cpu, or auto without a GPU torch can see."""
    if device != "auto":
        return device == "cpu"
    import torch

    return not torch.cuda.is_available()
