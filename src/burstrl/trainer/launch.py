"""Start the trainer's ranks: in this process for one rank, as child processes for several.

Rank processes get BURSTRL_RANK / BURSTRL_WORLD_SIZE / MASTER_ADDR / MASTER_PORT and read the
resolved config from the run directory. The launcher supervises them: if one exits with an error
the others are killed (they share its process group) and the launcher exits with that rank's code
and the path of its log. Children also die with the launcher (PR_SET_PDEATHSIG on Linux).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from burstrl.config import TrainConfig, dump_toml
from burstrl.protocol.process import die_with_parent_signal


def run_trainer(cfg: TrainConfig, resume: bool) -> int:
    """Run `cfg.trainer.world_size` ranks to completion; returns an exit status."""
    if cfg.trainer.world_size == 1:
        from burstrl.trainer.loop import train

        train(cfg, resume)
        return 0
    run_dir = Path(cfg.run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "train_config.toml"
    config_path.write_text(dump_toml(cfg))
    port = _free_port()
    procs = [_spawn_rank(rank, cfg.trainer.world_size, port, config_path, run_dir, resume)
             for rank in range(cfg.trainer.world_size)]
    return _supervise(procs, run_dir)


def _spawn_rank(rank: int, world: int, port: int, config: Path, run_dir: Path, resume: bool) -> subprocess.Popen:
    env = {**os.environ, "BURSTRL_RANK": str(rank), "BURSTRL_WORLD_SIZE": str(world),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    code = "from burstrl.trainer.launch import rank_main; rank_main()"
    cmd = [sys.executable, "-c", code, str(config), "1" if resume else "0"]
    log = open(run_dir / "logs" / f"rank-{rank}.log", "w")
    return subprocess.Popen(cmd, env=env, stdout=None if rank == 0 else log, stderr=None if rank == 0 else log,
                            preexec_fn=die_with_parent_signal)


def _supervise(procs: list[subprocess.Popen], run_dir: Path) -> int:
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                print(f"error: trainer rank {rank} exited with {code}; log: {run_dir / 'logs' / f'rank-{rank}.log'}",
                      file=sys.stderr)
                _kill(procs)
                return code if code > 0 else 1
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.2)
    except KeyboardInterrupt:
        _kill(procs)
        return 130


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
    for p in procs:
        p.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main() -> None:
    """Entry point of a rank process: argv = [config.toml, resume 0|1]."""
    import logging

    from burstrl.config import load_config
    from burstrl.trainer.loop import train

    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank%(process)d %(levelname)s %(message)s")
    cfg = load_config(TrainConfig, [sys.argv[1]])
    train(cfg, resume=sys.argv[2] == "1")
