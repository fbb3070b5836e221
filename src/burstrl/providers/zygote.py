"""A zygote: one process with torch, transformers and the replica's code imported, forking replicas.

Why: a replica process spends ~90% of its start importing (torch, transformers, FastAPI: ~14 s
of 15 s on the 2-core dev machine with the tiny model); loading the weights is the rest. The
local provider starts one zygote per run that pays the imports once; every replica, the first
fleet and each replacement, is then a fork that only binds, loads the weights and the newest
adapter, and serves.

Invariants (checked before every fork, a violation refuses the spawn):
- the zygote has ONE Python thread when it forks: a fork copies only the calling thread, so a lock
  held by any other thread would stay held forever in the child. The zygote therefore only
  imports (no model load: transformers' loader starts tqdm's monitor thread) and runs a
  single-threaded select loop. Native pools that exist after `import numpy`/`torch` (OpenBLAS,
  OpenMP) re-create themselves in a child through their own pthread_atfork handlers, the same
  path PyTorch's fork-based DataLoader workers take.
- CUDA is never initialised in the zygote (a CUDA context does not survive fork); the child
  initialises it when it loads the model.

Ownership: the launcher's `Zygote` starts it (own process group, SIGKILL when the launcher's
thread dies) and `close()` stops it. Each child gets its own session (so `killpg` of its pid
stops it and whatever it started, as for a plain role) and SIGKILL when the zygote dies, so
nothing outlives the launcher. The zygote reaps its children (pidfds in the select loop) and
reports each exit status to the launcher. A request may name a `watch` pid, the child's owner
when that is not the launcher (the Ray actor that holds the replica, providers/ray_zygote.py):
the zygote holds a pidfd of it and SIGKILLs the child's group the moment the owner exits.

Wire format, one JSON object per line: launcher -> zygote stdin `{"id", "args", "log", "append"}`
plus optional `"env"` (the child's whole environment instead of the zygote's) and `"watch"`;
zygote stdout -> launcher `{"event": "zygote_ready"}`, `{"event": "spawned", "id", "pid"}`,
`{"event": "spawn_failed", "id", "error"}`, `{"event": "exit", "pid", "code"}`, and the child's
own ready line `{"event": "ready", "url", "pid"}` (children write to the zygote's stdout; each
line is one write under PIPE_BUF, so lines never interleave).
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TextIO

from burstrl.protocol.process import die_with_parent_signal

# What a replica imports before it can load a model; anything heavy it imports lazily belongs here.
PRELOAD = ("torch", "transformers", "uvicorn", "fastapi", "burstrl.cli", "burstrl.inference.server",
           "burstrl.inference.replica", "burstrl.model.hf", "burstrl.model.attention", "burstrl.weights.volume")


# ---------------------------------------------------------------------------------- the zygote


def _emit(event: dict[str, Any]) -> None:
    os.write(1, (json.dumps(event) + "\n").encode())


def _preload(model_path: str) -> None:
    """Import what a replica needs, including the model's own transformers classes (lazy there)."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    if model_path and (Path(model_path) / "config.json").is_file():
        from transformers import AutoConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        config = AutoConfig.from_pretrained(model_path)
        MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]  # noqa: B018 - the lookup imports the model's module


def line_stdout() -> TextIO:
    """A stdout that writes each line with ONE write(2): forked siblings share the pipe, and with
    PYTHONUNBUFFERED (the launcher sets it) `print` writes the text and its newline separately,
    so two replicas ready at once interleaved into `{..}{..}` and both ready lines were lost."""
    return open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's stdout, never closed


def fork_safe() -> str:
    """Why forking now would be unsafe, or "" (the invariants in the module docstring)."""
    if threading.active_count() != 1:
        return f"{threading.active_count()} Python threads: {[t.name for t in threading.enumerate()]}"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA is initialised"
    return ""


def zygote_main(model_path: str = "") -> None:
    """The zygote process: preload, then fork one child per request line until stdin closes."""
    _preload(model_path)
    sel = selectors.DefaultSelector()
    sel.register(0, selectors.EVENT_READ, "stdin")
    watches: dict[int, int] = {}  # child pid -> pidfd of its owner (requests with "watch")
    buf = b""
    _emit({"event": "zygote_ready", "pid": os.getpid()})
    while True:
        for key, _ in sel.select():
            if key.data == "stdin":
                data = os.read(0, 65536)
                if not data:
                    return  # the launcher closed our stdin: stop (children die with us)
                buf += data
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    _spawn(json.loads(line), sel, watches)
            elif isinstance(key.data, tuple):  # ("owner", pid): the child's owner exited
                child = key.data[1]
                if child in watches:  # else reaped earlier in this round: its pid may be another's now
                    _unwatch(sel, watches, child)
                    _kill_child(child)
            else:
                pid = key.data
                sel.unregister(key.fd)
                os.close(key.fd)
                _, status = os.waitpid(pid, 0)
                _unwatch(sel, watches, pid)
                _emit({"event": "exit", "pid": pid, "code": os.waitstatus_to_exitcode(status)})


def _spawn(req: dict[str, Any], sel: selectors.BaseSelector, watches: dict[int, int]) -> None:
    unsafe = fork_safe()
    if unsafe:
        _emit({"event": "spawn_failed", "id": req["id"], "error": f"zygote not fork-safe: {unsafe}"})
        return
    owner = -1
    if req.get("watch"):
        try:  # opened before the fork: an owner that dies from here on is seen
            owner = os.pidfd_open(int(req["watch"]))
        except ProcessLookupError:
            _emit({"event": "spawn_failed", "id": req["id"], "error": f"its owner {req['watch']} is gone"})
            return
    zygote = os.getpid()
    pid = os.fork()
    if pid == 0:
        _child(req, zygote, sel, owner)
    sel.register(os.pidfd_open(pid), selectors.EVENT_READ, pid)
    if owner >= 0:
        watches[pid] = owner
        sel.register(owner, selectors.EVENT_READ, ("owner", pid))
    _emit({"event": "spawned", "id": req["id"], "pid": pid})


def _unwatch(sel: selectors.BaseSelector, watches: dict[int, int], child: int) -> None:
    owner = watches.pop(child, -1)
    if owner >= 0:
        sel.unregister(owner)
        os.close(owner)


def _kill_child(pid: int) -> None:
    """SIGKILL a child that is not reaped yet (so its pid and group id are still its own). The pid
    too: a child killed before its setsid() has no group of its own yet."""
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _child(req: dict[str, Any], zygote: int, sel: selectors.BaseSelector, owner: int) -> None:
    """In the forked child: become a role process, run `burstrl ARGS`, never return to the loop."""
    code = 1
    try:
        os.setsid()
        die_with_parent_signal()
        if os.getppid() != zygote:  # the zygote died before the line above took effect
            os._exit(1)
        for key in list(sel.get_map().values()):
            if key.fd != 0:
                os.close(key.fd)  # the siblings' pidfds and their owners'
        sel.close()
        if owner >= 0:
            os.close(owner)
        if "env" in req:  # the owner's environment (a Ray actor's CUDA_VISIBLE_DEVICES, ...), as a Popen'd child gets
            os.environ.clear()
            os.environ.update(req["env"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | (os.O_APPEND if req.get("append") else os.O_TRUNC),
                      0o644)
        os.dup2(log, 2)
        os.close(log)
        sys.stdout = line_stdout()
        import random

        random.seed()  # a fresh process would have fresh state; siblings must not share it
        import importlib

        # The CLI by name, as `start_role`'s command line runs it: cli imports the providers, not back.
        cli = importlib.import_module("burstrl.cli")
        cli.app(args=list(req["args"]), prog_name="burstrl", standalone_mode=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - the child must exit here, whatever happened
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


# ---------------------------------------------------------------------------- the launcher side


@dataclass
class ForkedRole:
    """A role forked by the zygote: the `RoleHandle` surface of a plain subprocess role."""

    url: str
    pid: int
    log: Path
    cause: str = ""
    restarts: int = 0
    code: int | None = None
    exited: threading.Event = field(default_factory=threading.Event)

    def poll(self) -> int | None:
        return self.code

    @property
    def returncode(self) -> int | None:
        return self.code

    def _signal(self, sig: int) -> None:
        if not self.exited.is_set():  # not yet reaped, so the pid (its group id) is still ours
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, timeout: float = 15.0) -> None:
        self._signal(signal.SIGTERM)
        if not self.exited.wait(timeout):
            self.kill()

    def kill(self) -> None:
        """SIGKILL its process group; return once the zygote reaped it."""
        self._signal(signal.SIGKILL)
        self.exited.wait()


class Zygote:
    """Start the zygote process now (it preloads in the background); `spawn` forks roles from it.

    Thread-safe: the fleet starts replicas from several threads. A reader thread owns the zygote's
    stdout; `close()` stops the children, the zygote and the reader.
    """

    def __init__(self, logs_dir: Path, env: dict[str, str], model_path: str = "", name: str = "zygote") -> None:
        logs_dir.mkdir(parents=True, exist_ok=True)
        self.log = logs_dir / f"{name}.log"
        # The log's path is on the command line too: `ps`/`pgrep -f RUN_DIR` then show whose zygote it is.
        cmd = [sys.executable, "-c", "import sys; from burstrl.providers.zygote import zygote_main; "
               "zygote_main(sys.argv[1])", model_path, str(self.log)]
        with open(self.log, "a") as err:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                         start_new_session=True, env={**os.environ, **env},
                                         preexec_fn=die_with_parent_signal)
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.next_id = 0
        self.spawned: dict[int, int | str] = {}  # request id -> pid, or the error
        self.children: dict[int, ForkedRole] = {}
        self.urls: dict[int, str] = {}
        self.exits: dict[int, int] = {}
        self.ready = False
        self.dead = False
        self.reader = threading.Thread(target=self._read, name="zygote-reader", daemon=True)
        self.reader.start()

    def alive(self) -> bool:
        with self.lock:
            return not self.dead

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            if not raw.startswith(b"{"):
                continue  # a child's stray print
            try:
                event = json.loads(raw)
            except ValueError:
                continue
            self._on_event(event)
        with self.lock:  # EOF: the zygote is gone, and its children with it (SIGKILL on its death)
            self.dead = True
            for pid, child in self.children.items():
                if child.code is None:
                    child.code = self.exits.get(pid, -signal.SIGKILL)
                    child.exited.set()
            self.changed.notify_all()

    def _on_event(self, event: dict[str, Any]) -> None:
        kind = event.get("event")
        with self.lock:
            if kind == "zygote_ready":
                self.ready = True
            elif kind == "spawned":
                self.spawned[event["id"]] = event["pid"]
            elif kind == "spawn_failed":
                self.spawned[event["id"]] = str(event["error"])
            elif kind == "ready":
                self.urls[event["pid"]] = event["url"]
            elif kind == "exit":
                self.exits[event["pid"]] = event["code"]
                child = self.children.get(event["pid"])
                if child is not None:
                    child.code = event["code"]
                    child.exited.set()
            self.changed.notify_all()

    def spawn(self, args: list[str], log: Path, timeout: float, append: bool = False,
              env: dict[str, str] | None = None, watch: int = 0) -> ForkedRole:
        """Fork `burstrl ARGS` (stderr to `log`); return once it printed its ready line.

        `env`: the child's whole environment (default: the zygote's). `watch`: a pid whose exit
        SIGKILLs the child (its owner, when that is not this process).
        RuntimeError (quoting the log) if it exits first, is not ready within `timeout`, or the
        zygote is gone; the caller may then start the role the ordinary way."""
        deadline = time.monotonic() + timeout
        with self.lock:
            if self.dead:
                raise RuntimeError(f"the zygote is gone; log {self.log}")
            self.next_id += 1
            rid = self.next_id
            assert self.proc.stdin is not None
            req: dict[str, Any] = {"id": rid, "args": args, "log": str(log), "append": append}
            if env is not None:
                req["env"] = env
            if watch:
                req["watch"] = watch
            try:
                self.proc.stdin.write((json.dumps(req) + "\n").encode())
                self.proc.stdin.flush()
            except BrokenPipeError:
                raise RuntimeError(f"the zygote is gone; log {self.log}") from None
            while rid not in self.spawned and not self.dead:
                self._wait(deadline, f"the zygote did not fork {args[:1]}")
            got = self.spawned.pop(rid, f"the zygote is gone; log {self.log}")
            if isinstance(got, str):
                raise RuntimeError(got)
            child = ForkedRole(url="", pid=got, log=Path(log))
            self.children[got] = child
            if got in self.exits:
                child.code = self.exits[got]
                child.exited.set()
        try:
            with self.lock:
                while got not in self.urls and child.code is None:
                    self._wait(deadline, lambda: f"{args[:1]} not ready after {timeout:.0f}s; log {log}:\n"
                               f"{_tail(Path(log))}")  # the log says how far it got
                if child.code is not None:
                    raise RuntimeError(f"{args[:1]} exited with {child.code}; log {log}:\n{_tail(Path(log))}")
                child.url = self.urls.pop(got)
        except BaseException:
            child.stop(timeout=5.0)
            raise
        return child

    def _wait(self, deadline: float, what: str | Callable[[], str]) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(what if isinstance(what, str) else what())
        self.changed.wait(min(left, 1.0))

    def close(self, timeout: float = 5.0) -> None:
        """Stop every child still running, then the zygote; wait for the reader to finish."""
        with self.lock:
            children = [c for c in self.children.values() if c.code is None]
        for child in children:
            child.stop(timeout=timeout)
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        self.reader.join(timeout=timeout)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""
