"""An OpenEnv server from a container image, run the way openenv's `LocalDockerProvider` does.

The image contract (openenv's): the server listens on container port 8000 and answers `GET /health`
once ready. The adapter owns the container: started on first use, stopped by `close()` or at exit.
Unlike openenv's provider, the port is published on loopback only and docker picks it (no race for a
free port), and the container is `--rm`, so stopping it also removes it.
"""

from __future__ import annotations

import atexit
import re
import shutil
import subprocess
import threading
import time
import uuid

from burstrl.deadline import CallFailed, fetch, sync_client
from burstrl.envs.base import InfraError

CONTAINER_PORT = 8000
# A docker image reference (name[:tag][@digest]); never starts with '-', so it cannot pass as an option.
IMAGE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@-]{0,254}")
DOCKER_TIMEOUT_S = 30.0  # one docker CLI call (run, port, rm)
HEALTH_TIMEOUT_S = 5.0  # one GET /health while the container starts, start to end
HEALTH_MAX_BYTES = 1 << 16


def check_image(image: str, timeout_s: float = DOCKER_TIMEOUT_S) -> None:
    """ValueError unless `image` reads as an image name and docker can run containers here."""
    if not IMAGE_RE.fullmatch(image):
        raise ValueError(f"{image!r} is neither an http(s):// or ws(s):// URL nor a container image name")
    problem = docker_problem(timeout_s)
    if problem is not None:
        raise ValueError(f"image {image!r}: {problem}")


def docker_problem(timeout_s: float = DOCKER_TIMEOUT_S) -> str | None:
    """Why docker cannot run containers on this machine, or None when it can."""
    if shutil.which("docker") is None:
        return "the docker CLI is not installed (or not on PATH)"
    try:
        r = subprocess.run(["docker", "version", "--format", "{{.Server.Version}}"], capture_output=True,
                           text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`docker version` failed: {exc}"
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return f"docker cannot reach its daemon: {last[:300]}"
    return None


class Container:
    """One OpenEnv server container; `start()` (idempotent, thread-safe) gives its URL."""

    def __init__(self, image: str, start_timeout_s: float) -> None:
        self.image, self.start_timeout_s = image, start_timeout_s
        self.name = f"burstrl-openenv-{uuid.uuid4().hex[:12]}"
        self.url: str | None = None
        self._lock = threading.Lock()
        self._started = False

    def run_command(self) -> list[str]:
        """`docker run`: detached, removed when stopped, port 8000 published on a loopback port docker picks."""
        return ["docker", "run", "-d", "--rm", "--name", self.name, "-p", f"127.0.0.1::{CONTAINER_PORT}", self.image]

    def start(self) -> str:
        """Run the container and wait for `/health` (InfraError naming the failure, container stopped)."""
        with self._lock:
            if self.url is not None:
                return self.url
            problem = docker_problem()
            if problem is not None:
                raise InfraError(f"image {self.image!r}: {problem}")
            self._started = True
            atexit.register(self.stop)
            try:
                self._docker(*self.run_command()[1:])
                url = "http://" + self._docker("port", self.name, f"{CONTAINER_PORT}/tcp").splitlines()[0].strip()
                self._wait_healthy(url)
            except BaseException:
                self.stop()
                raise
            self.url = url
            return url

    def _docker(self, *args: str) -> str:
        try:
            r = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=DOCKER_TIMEOUT_S,
                               check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise InfraError(f"docker {args[0]}: {exc}") from None
        if r.returncode != 0:
            raise InfraError(f"docker {args[0]} {self.image}: exit {r.returncode}: {r.stderr.strip()[-500:]}")
        return r.stdout

    def _wait_healthy(self, url: str) -> None:
        """Poll `/health` until 200; each poll has an overall deadline (a container dripping its answer
        would otherwise hold the start past `start_timeout_s`)."""
        deadline = time.monotonic() + self.start_timeout_s
        with sync_client(timeout=HEALTH_TIMEOUT_S) as http:
            while (left := deadline - time.monotonic()) > 0:
                try:
                    reply = fetch(http, "GET", f"{url}/health", deadline=min(HEALTH_TIMEOUT_S, left),
                                  max_bytes=HEALTH_MAX_BYTES)
                    if reply.status == 200:
                        return
                except CallFailed:
                    pass
                time.sleep(0.25)
        raise InfraError(f"image {self.image!r}: {url}/health did not answer within {self.start_timeout_s:g} s"
                         f"{self._logs()}")

    def _logs(self) -> str:
        try:
            r = subprocess.run(["docker", "logs", "--tail", "20", self.name], capture_output=True, text=True,
                               timeout=DOCKER_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        tail = (r.stdout + r.stderr).strip()[-1500:]
        return f"; its log ends:\n{tail}" if tail else ""

    def stop(self) -> None:
        """Stop and remove the container if this object started one (idempotent; errors ignored)."""
        if not self._started:
            return
        self._started, self.url = False, None
        try:
            subprocess.run(["docker", "rm", "-f", self.name], capture_output=True, timeout=DOCKER_TIMEOUT_S,
                           check=False)
        except (OSError, subprocess.TimeoutExpired):
            pass
        atexit.unregister(self.stop)
