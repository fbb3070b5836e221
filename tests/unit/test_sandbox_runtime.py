"""The sandbox runtime in-process: real commands, real files, a temp dir as the root."""

from __future__ import annotations

import base64
import io
import os
import signal
import tarfile
import threading
import time
from pathlib import Path

import pytest

from burstrl.sandbox import runtime
from burstrl.sandbox.protocol import (
    ExecRequest,
    ExecResult,
    ProtocolError,
    ReadFileRequest,
    UploadRequest,
    WriteFileRequest,
    from_json,
    to_json,
)
from burstrl.sandbox.runtime import Runtime


@pytest.fixture
def rt(tmp_path: Path) -> Runtime:
    (tmp_path / "root").mkdir()
    return Runtime(root=str(tmp_path / "root"))


def run(rt: Runtime, cmd, **kw) -> ExecResult:
    return rt.exec(ExecRequest(cmd=cmd, **kw))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(") ")[1].startswith("Z"))


def test_output_exit_code_and_streams(rt: Runtime) -> None:
    res = run(rt, "echo out; echo err >&2; exit 3")
    assert (res.stdout, res.stderr, res.exit_code, res.timed_out, res.truncated) == ("out\n", "err\n", 3, False, False)
    assert run(rt, ["printf", "%s", "a b"]).stdout == "a b"


def test_missing_program_is_127(rt: Runtime) -> None:
    res = run(rt, ["/no/such/program"])
    assert res.exit_code == 127 and "No such file" in res.stderr


def test_killed_by_signal_is_negative(rt: Runtime) -> None:
    assert run(rt, "kill -TERM $$").exit_code == -15


def test_a_program_that_is_not_executable_is_126_and_nothing_is_spawned(rt: Runtime) -> None:
    Path(rt.work_dir, "data.sh").write_text("echo hi\n")
    Path(rt.work_dir, "dir").mkdir()
    for argv in (["./data.sh"], ["./dir"]):
        res = run(rt, argv)
        assert (res.exit_code, res.stderr) == (126, f"{argv[0]}: Permission denied\n"), res
    assert run(rt, ["no-such-program-anywhere"]).stderr == "no-such-program-anywhere: No such file or directory\n"


def test_commands_start_with_default_signals_whatever_the_daemon_ignores(rt: Runtime) -> None:
    """The daemon ignores SIGPIPE (Python) and, as pid 1, SIGTERM and friends (guard): an ignored
    disposition survives exec, so each command's spawn resets them (`timeout` must still end a
    command with SIGTERM, `yes | head` must end `yes`)."""
    before = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        assert run(rt, "kill -TERM $$").exit_code == -15
        res = run(rt, ["grep", "-E", "^Sig(Ign|Blk)", "/proc/self/status"])
    finally:
        signal.signal(signal.SIGTERM, before)
    fields = dict(line.split(":\t") for line in res.stdout.splitlines())
    classic = sum(1 << (sig - 1) for sig in range(1, 32))  # glibc keeps its internal 32 and 33 as they are
    assert int(fields["SigBlk"], 16) == 0 and int(fields["SigIgn"], 16) & classic == 0, res


def test_a_cwd_is_entered_whatever_its_name(rt: Runtime) -> None:
    odd = "it's a $dir `x` -n"
    Path(rt.work_dir, odd).mkdir()
    expected = os.path.realpath(os.path.join(rt.work_dir, odd)) + "\n"
    assert run(rt, "pwd -P", cwd=odd).stdout == expected
    assert run(rt, ["pwd", "-P"], cwd=odd).stdout == expected


def test_without_a_shell_a_program_still_gets_its_cwd_and_score(rt: Runtime, monkeypatch) -> None:
    monkeypatch.setattr(runtime, "SHELL", "/no/shell/in/this/image")
    Path(rt.work_dir, "sub").mkdir()
    res = run(rt, ["cat", "/proc/self/oom_score_adj"], cwd="sub")
    assert (res.stdout, res.exit_code) == ("1000\n", 0), res
    assert run(rt, ["pwd", "-P"], cwd="sub").stdout == os.path.realpath(os.path.join(rt.work_dir, "sub")) + "\n"
    assert run(rt, "echo hi").exit_code == 127  # a string needs the shell the image lacks


def test_output_cap_keeps_head_and_tail(rt: Runtime) -> None:
    res = run(rt, "head -c 5000 /dev/zero | tr '\\0' x; printf END; printf ERR >&2", max_output_bytes=100)
    assert res.truncated and res.stdout_elided_bytes == 5003 - 100 and res.stderr_elided_bytes == 0
    assert res.stdout.startswith("x" * 50) and res.stdout.endswith("x" * 47 + "END")
    assert f"[... {5003 - 100} bytes elided ...]" in res.stdout
    assert res.stderr == "ERR"


def test_non_utf8_output_is_replaced(rt: Runtime) -> None:
    assert run(rt, "printf 'a\\377b'").stdout == "a\ufffdb"


def test_timeout_kills_whole_group_and_keeps_partial_output(rt: Runtime, tmp_path: Path) -> None:
    pidfile = tmp_path / "grandchild.pid"
    start = time.monotonic()
    res = run(rt, f"echo started; sh -c 'sleep 30 & echo $! > {pidfile}; wait'; echo never", timeout=0.5)
    assert time.monotonic() - start < 5
    assert res.timed_out and res.exit_code == -9 and res.stdout == "started\n"
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 2
    while _pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _pid_alive(pid)


def test_background_child_does_not_hold_the_command(rt: Runtime, tmp_path: Path) -> None:
    pidfile = tmp_path / "bg.pid"
    start = time.monotonic()
    res = run(rt, f"sleep 30 & echo $! > {pidfile}; echo done", timeout=20)
    assert time.monotonic() - start < 2 and res.stdout == "done\n" and res.exit_code == 0 and not res.timed_out
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 2
    while _pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _pid_alive(pid)  # the group is killed once the leader exits


def test_stdin_is_closed(rt: Runtime) -> None:
    start = time.monotonic()
    res = run(rt, "cat", timeout=10)
    assert res.exit_code == 0 and res.stdout == "" and time.monotonic() - start < 2


def test_env_and_cwd(rt: Runtime) -> None:
    sub = Path(rt.root) / "sub"
    sub.mkdir()
    res = run(rt, 'echo "$FOO|$PWD|${SANDBOX_TOKEN:-none}"; test -n "$PATH"', env={"FOO": "bar"}, cwd="sub")
    assert res.stdout == f"bar|{sub}|none\n" and res.exit_code == 0
    with pytest.raises(ProtocolError) as err:
        run(rt, "true", cwd="missing")
    assert err.value.status == 400 and "cwd" in err.value.message


def test_request_id_runs_once(rt: Runtime) -> None:
    log = Path(rt.root) / "log"
    cmd = f"echo x >> {log}; sleep 0.3; wc -l < {log}"
    results = []
    threads = [threading.Thread(target=lambda: results.append(run(rt, cmd, request_id="r1"))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results.append(run(rt, cmd, request_id="r1"))
    assert log.read_text() == "x\n"
    assert {r.stdout.strip() for r in results} == {"1"} and len(results) == 4
    assert run(rt, cmd, request_id="r2").stdout.strip() == "2"


def test_read_write_roundtrip(rt: Runtime) -> None:
    w = rt.write_file(WriteFileRequest(path="a/b/c.bin", content_b64=base64.b64encode(b"\x00\x01hi").decode(), mode=0o600))
    assert w.size == 4 and (os.stat(w.path).st_mode & 0o777) == 0o600
    r = rt.read_file(ReadFileRequest(path="a/b/c.bin"))
    assert base64.b64decode(r.content_b64) == b"\x00\x01hi" and r.size == 4 and not r.truncated
    rt.write_file(WriteFileRequest(path=str(Path(rt.root) / "t.txt"), text="héllo"))
    short = rt.read_file(ReadFileRequest(path="t.txt", max_bytes=2))
    assert base64.b64decode(short.content_b64) == b"h\xc3" and short.truncated and short.size == 6


def test_file_errors(rt: Runtime) -> None:
    for req, status in ((ReadFileRequest(path="missing"), 404), (ReadFileRequest(path="."), 400)):
        with pytest.raises(ProtocolError) as err:
            rt.read_file(req)
        assert err.value.status == status
    with pytest.raises(ProtocolError) as err:
        rt.write_file(WriteFileRequest(path="x/y", text="", mkdir=False))
    assert err.value.status == 404


@pytest.mark.parametrize("path", ["../outside", "/etc/passwd", "a/../../outside", "link/passwd", "link"])
def test_paths_escaping_the_root_are_refused(rt: Runtime, path: str) -> None:
    os.symlink("/etc", os.path.join(rt.root, "link"))
    for call in (lambda: rt.read_file(ReadFileRequest(path=path)),
                 lambda: rt.write_file(WriteFileRequest(path=path, text="x")),
                 lambda: rt.upload(UploadRequest(dest=path, archive=_tar({"f": b"x"})))):
        with pytest.raises(ProtocolError) as err:
            call()
        assert err.value.status == 400 and "outside" in err.value.message
    assert not (Path(rt.root).parent / "outside").exists()


def _tar(files: dict, links: dict | None = None, hardlinks: dict | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for kind, table in ((tarfile.SYMTYPE, links or {}), (tarfile.LNKTYPE, hardlinks or {})):
            for name, target in table.items():  # links first, so that files can go through them
                info = tarfile.TarInfo(name)
                info.type, info.linkname = kind, target
                tar.addfile(info)
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_upload_unpacks(rt: Runtime) -> None:
    res = rt.upload(UploadRequest(dest="w", archive=_tar({"a.txt": b"A", "d/b.txt": b"B"}, links={"l": "a.txt"})))
    root = Path(rt.root)
    assert res.files == 3 and (root / "w/d/b.txt").read_bytes() == b"B" and (root / "w/l").read_bytes() == b"A"


@pytest.mark.parametrize("archive", [
    _tar({"/abs": b"x"}), _tar({"../up": b"x"}), _tar({"a/../../up": b"x"}),
    _tar({}, links={"l": "/etc"}), _tar({}, links={"l": "../.."}), _tar({}, hardlinks={"h": "/etc/passwd"}),
    _tar({"b/evil": b"x"}, links={"a": ".", "b": "a/.."}),  # lexically inside, really outside
])
def test_upload_escapes_are_refused(rt: Runtime, archive: bytes) -> None:
    with pytest.raises(ProtocolError) as err:
        rt.upload(UploadRequest(dest="w", archive=archive))
    assert err.value.status == 400
    assert not (Path(rt.root) / "evil").exists() and not (Path(rt.root).parent / "up").exists()


def test_upload_through_an_existing_link_is_refused(rt: Runtime) -> None:
    os.makedirs(os.path.join(rt.root, "w"))
    os.symlink("..", os.path.join(rt.root, "w", "l"))
    with pytest.raises(ProtocolError, match="outside"):
        rt.upload(UploadRequest(dest="w", archive=_tar({"l/evil": b"x"})))
    assert not (Path(rt.root) / "evil").exists()


def test_upload_of_garbage_is_400(rt: Runtime) -> None:
    with pytest.raises(ProtocolError) as err:
        rt.upload(UploadRequest(dest="w", archive=b"not a tar" * 100))
    assert err.value.status == 400


@pytest.mark.parametrize("data, field", [
    ({}, "cmd"), ({"cmd": 3}, "cmd"), ({"cmd": "x", "timeout": "1"}, "timeout"), ({"cmd": "x", "timeout": 0}, "timeout"),
    ({"cmd": "x", "timeout": 1e9}, "timeout"), ({"cmd": "x", "env": {"A": 1}}, "env"), ({"cmd": "x", "bogus": 1}, "bogus"),
    ({"cmd": []}, "cmd"), ({"cmd": "x", "max_output_bytes": True}, "max_output_bytes"),
])
def test_protocol_validation_names_the_field(data: dict, field: str) -> None:
    with pytest.raises(ProtocolError) as err:
        from_json(ExecRequest, data)
    assert err.value.status == 400 and f"'{field}'" in err.value.message


def test_protocol_roundtrip() -> None:
    req = ExecRequest(cmd=["ls", "-l"], timeout=5, env={"A": "b"}, request_id="x")
    assert from_json(ExecRequest, to_json(req)) == req and isinstance(req.timeout, float)
    with pytest.raises(ProtocolError, match="content_b64"):
        from_json(WriteFileRequest, {"path": "p", "text": "a", "content_b64": ""})
    with pytest.raises(ProtocolError, match="must be a JSON object"):
        from_json(ExecRequest, ["ls"])


def test_kept_results_are_bounded_by_bytes(rt: Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    """Oldest results go first once over RESULT_BYTES; a dropped id answers 410, never a re-run."""
    import burstrl.sandbox.runtime as runtime_mod

    monkeypatch.setattr(runtime_mod, "RESULT_BYTES", 3000)
    for i in range(5):
        assert len(run(rt, "head -c 1000 /dev/zero | tr '\\0' a; echo x >> runs", request_id=f"r{i}").stdout) == 1000
    assert len(run(rt, "echo x >> runs", request_id="r4").stdout) == 1000  # kept: recorded, not run
    with pytest.raises(ProtocolError) as err:
        run(rt, "echo x >> runs", request_id="r0")
    assert err.value.status == 410
    assert (Path(rt.root) / "runs").read_text().count("x") == 5
    assert rt._kept_bytes <= 3000


def test_base_env_under_the_request_env(tmp_path: Path) -> None:
    rt = Runtime(root=str(tmp_path), base_env={"FOO": "base", "BAR": "b", "PATH": "/usr/bin:/bin"})
    assert run(rt, 'echo "$FOO $BAR $PATH"', env={"FOO": "req"}).stdout == "req b /usr/bin:/bin\n"


def test_fifo_and_devices_are_not_opened(tmp_path: Path) -> None:
    rt = Runtime(root="/", work_dir=str(tmp_path))
    os.mkfifo(tmp_path / "fifo")
    start = time.monotonic()
    for call in (lambda: rt.read_file(ReadFileRequest(path="fifo")),
                 lambda: rt.write_file(WriteFileRequest(path="fifo", text="x")),
                 lambda: rt.read_file(ReadFileRequest(path="/dev/zero"))):
        with pytest.raises(ProtocolError) as err:
            call()
        assert err.value.status == 400 and "not a regular file" in err.value.message
    assert time.monotonic() - start < 1


def test_commands_get_oom_score_adj_1000(rt: Runtime) -> None:
    assert run(rt, "cat /proc/self/oom_score_adj").stdout == "1000\n"
    assert run(rt, ["cat", "/proc/self/oom_score_adj"]).stdout == "1000\n"
    assert run(rt, ["./nope"]).exit_code == 127
