"""The functions grader's runner: what runs in the grading sandbox, next to the candidate's module.

    python3 runner.py DIR        (DIR holds job.json, the module, and plaindata.py beside this file)

job.json: {"module": FILE, "function": NAME, "cases": [ARGS, ...], "case_timeout_s": T}, each ARGS the
`plaindata` form of the tuple of one call's arguments. The sandbox holds nothing else of the task:
no tests, no expected values (the grader keeps those and compares in its own process).

The runner imports the module once, then forks one child per case (fork after import: a fork,
call and pipe cost 0.7-0.9 ms on the sandbox's python3, a fresh interpreter per case 7.8 ms before
it imports anything), one at a time so that no case can starve another of CPU or memory. The child calls the function, encodes what it returned (exact
builtin types only, bounded: `plaindata`) or the exception's type name, writes that to a pipe and
`os._exit`s. The parent waits at most T seconds per case, then kills the child's process group.
An exception, a timeout, an exit, a signal or output that is too large is the failure of that case
only. One line per case goes into DIR/results, which the grader reads back:

    [INDEX, ["ok", VALUE]] | [INDEX, ["raise", TYPE_NAME]] | [INDEX, ["timeout"]]
    [INDEX, ["exit", CODE]] | [INDEX, ["signal", N]] | [INDEX, ["invalid", WHY]]

and ["import", ["raise", TYPE_NAME]] when the module does not import (then no case runs). The
candidate's own stdout and stderr go to /dev/null: an honest `print` costs nothing.

No integrity is needed here, on purpose: the whole sandbox is the candidate's. Whatever its code
does to this runner (rewrite the encoder, write lines of its own, kill or stop this process) can only
yield lines of plain data, which the grader decodes strictly and compares against values the
sandbox never held: data it could have returned honestly, or nothing (a failed case).

Standalone: standard library only, Python 3.8+, imports nothing of burstrl.
"""

import importlib.util
import json
import os
import select
import signal
import sys
import time

try:
    import plaindata  # the copy beside this file (sys.path[0] is the script's directory)
except ImportError:  # imported from the package (tests)
    from burstrl.envs.functions import plaindata

READ_CHUNK = 65536


def main() -> int:
    job_dir = sys.argv[1]
    with open(os.path.join(job_dir, "job.json")) as f:
        job = json.load(f)
    out = os.open(os.path.join(job_dir, "results"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):  # stderr stays the runner's own (its errors); the cases' goes nowhere (`child`)
        os.dup2(null, fd)
    calls = [plaindata.loads(a) for a in job["cases"]]
    try:
        fn = load(os.path.join(job_dir, job["module"]), job["function"])
    except BaseException as exc:  # noqa: BLE001 - whatever the import raised is the result
        emit(out, '["import",' + json.dumps(["raise", exc_name(exc)]) + "]")
        return 0
    for i, args in enumerate(calls):
        entry = run_case(fn, args, float(job["case_timeout_s"]), out)
        emit(out, "[%d,%s]" % (i, entry))
    return 0


def load(path: str, name: str):
    """The function `name` of the module at `path` (imported under the file's own name)."""
    module_name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return getattr(module, name)


def run_case(fn, args, timeout_s: float, out: int) -> str:
    """One call in a child process; the JSON text of its entry."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(r)
        os.close(out)
        os.dup2(0, 2)  # /dev/null
        child(fn, args, w)
    os.close(w)
    try:
        os.setpgid(pid, pid)  # (the child does it too: whichever runs first)
    except OSError:
        pass
    data, timed_out = read_until(r, time.monotonic() + timeout_s, plaindata.MAX_BYTES)
    os.close(r)
    kill_group(pid)
    _, status = os.waitpid(pid, 0)
    if timed_out:
        return '["timeout"]'
    if data is None:
        return json.dumps(["invalid", "over %d bytes" % plaindata.MAX_BYTES])
    if data and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
        return data.decode("utf-8", "replace") if b"\n" not in data else '["invalid", "a line break"]'
    if os.WIFSIGNALED(status):
        return json.dumps(["signal", os.WTERMSIG(status)])
    return json.dumps(["exit", os.WEXITSTATUS(status) if os.WIFEXITED(status) else -1])


def child(fn, args, w: int) -> None:
    """Call, encode, write, exit (exit handlers and buffered files of the candidate never run)."""
    try:
        os.setpgid(0, 0)
    except OSError:
        pass
    try:
        with open("/proc/self/oom_score_adj", "w") as f:  # under memory pressure, a case goes first
            f.write("1000")
    except OSError:
        pass
    try:
        try:
            value = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - the exception's type name is the result
            text = json.dumps(["raise", exc_name(exc)])
        else:
            try:
                text = '["ok",' + plaindata.dumps(value) + "]"
            except BaseException as exc:  # noqa: BLE001 - not plain data, too big, or its repr raised
                text = json.dumps(["invalid", str(exc)[:200] if type(exc) is plaindata.PlainDataError
                                   else "could not encode: " + exc_name(exc)])
        data = text.encode("utf-8", "replace")
        while data:
            data = data[os.write(w, data):]
    finally:
        os._exit(0)


def read_until(fd: int, deadline: float, limit: int):
    """(bytes the child wrote until it closed the pipe, timed out): None for over `limit` bytes."""
    chunks, size = [], 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return b"".join(chunks), True
        chunk = os.read(fd, READ_CHUNK)
        if not chunk:
            return b"".join(chunks), False
        size += len(chunk)
        if size > limit:
            return None, False
        chunks.append(chunk)


def kill_group(pid: int) -> None:
    for target in (-pid, pid):  # the group (anything the case started), then the child itself
        try:
            os.kill(target, signal.SIGKILL)
        except OSError:
            pass


def exc_name(exc: BaseException) -> str:
    return str(type(exc).__name__)[:100]


def emit(fd: int, line: str) -> None:
    data = (line + "\n").encode("utf-8", "replace")
    while data:
        data = data[os.write(fd, data):]


if __name__ == "__main__":
    sys.exit(main())
