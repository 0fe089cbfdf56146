"""ipc shared memory under SIGKILL: nothing stays in /dev/shm once a fresh group has been made,
and the survivors of a rank killed during init name that rank.

Each case runs real worker processes (this file run as a script, one per rank), waits until they
reached the state under test (during init, at the channel handshake, mid-transfer), SIGKILLs
them, then makes a fresh ipc group in the test process, whose init reaps what the dead left:
afterwards no /dev/shm name of the killed group's token may remain.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from _jobs import free_port

SHM = Path("/dev/shm")
TIMEOUT_S = 20.0  # the groups' own timeout; every case must end far sooner


# --- worker side ------------------------------------------------------------------------------


def _report(out: Path, **fields) -> None:
    with out.open("a") as f:
        f.write(json.dumps(fields) + "\n")


def _worker(case: str, rank: int, world: int, port: int, out: Path) -> None:
    """One rank of ``case``; reports what it reached in ``out`` (JSON lines) and, except after
    an init failure, sleeps until the test kills it."""
    import torch

    from awex_fast.transport import init_transfer_group

    started = time.time()
    try:
        group = init_transfer_group("ipc", rank, world, "127.0.0.1", port, timeout=TIMEOUT_S)
    except Exception as exc:  # the survivors of the init case
        _report(out, error=str(exc), type=type(exc).__name__, started=started, ended=time.time())
        return
    _report(out, token=group._token)
    if case == "handshake" and rank == 0:  # a receiver made its channel; its sender never maps it
        group.channel(1, "recv", "exec", 2, 1 << 16)
        _report(out, ready=True)
    elif case == "transfer":
        if rank == 2:  # waits for a message rank 0 has not got to yet: its channel is made
            pending = group.irecv(torch.empty(8), 0, 0)
            _report(out, ready=True)
            pending.wait(3600)
        data = torch.arange(1 << 20, dtype=torch.float32)
        for round_ in range(1_000_000):
            if rank == 0:
                group.isend(data, 1, round_).wait(TIMEOUT_S)
            else:
                group.irecv(torch.empty_like(data), 0, round_).wait(TIMEOUT_S)
            if round_ == 2:
                _report(out, ready=True)
    time.sleep(3600)


# --- test side --------------------------------------------------------------------------------


def _spawn(case: str, rank: int, world: int, port: int, tmp: Path) -> subprocess.Popen:
    log = (tmp / f"log{rank}.txt").open("wb")
    # run as a script, this file finds the shared test helpers (_jobs) only through PYTHONPATH
    tests = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen(
        [sys.executable, __file__, case, str(rank), str(world), str(port), str(tmp / f"out{rank}.jsonl")],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env,
    )


def _reports(tmp: Path, rank: int) -> list[dict]:
    path = tmp / f"out{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _until(what: str, done: Callable[[], bool], tmp: Path, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while not done():
        if time.monotonic() > deadline:
            logs = "\n".join(p.read_text(errors="replace")[-2000:] for p in sorted(tmp.glob("log*.txt")))
            raise AssertionError(f"workers never reached {what!r}:\n{logs}")
        time.sleep(0.05)


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
    for p in procs:
        p.wait()


def _fresh_group_reaps(token: str) -> list[str]:
    """Names of the killed group still in /dev/shm after a fresh one-rank ipc group was made."""
    from awex_fast.transport import init_transfer_group
    from awex_fast.transport.ipc import _REAP_AGE_S

    time.sleep(_REAP_AGE_S)  # the reaper spares segments younger than this (see reap_orphans)
    group = init_transfer_group("ipc", 0, 1, "127.0.0.1", free_port(), timeout=TIMEOUT_S)
    group.close()
    return sorted(n.name for n in SHM.iterdir() if token in n.name)


def _exited_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_reaper_spares_segments_whose_owner_lives_or_still_holds_the_lock():
    from awex_fast.transport.shm import SharedSegment, reap_orphans

    prefix = f"awex_reaptest_{os.getpid()}_"
    dead = _exited_pid()
    # the owner's pid is not seen here but its lock is held (an owner in another PID namespace)
    held = SharedSegment(f"{prefix}p{dead}_held", 4096, create=True, owner_lock=True)
    # the owner runs (this process), lock or not
    mine = SharedSegment(f"{prefix}p{os.getpid()}_mine", 4096, create=True)
    # gone: a dead owner's segment, never locked; and one too young to judge
    orphan = SHM / f"{prefix}p{dead}_orphan"
    orphan.write_bytes(b"x")
    try:
        assert reap_orphans(prefix, min_age_s=60.0) == []  # everything is younger than that
        assert reap_orphans(prefix, min_age_s=0.0) == [orphan.name]
        assert {n.name for n in SHM.iterdir() if n.name.startswith(prefix)} == {held.name, mine.name}
        held.unlink()  # the owner lock goes with the name
        assert not Path(held.path).exists()
    finally:
        held.unlink()
        mine.unlink()
        orphan.unlink(missing_ok=True)


def test_rank_killed_during_init_is_named_and_its_doorbell_reaped(tmp_path):
    port = free_port()
    before = {n.name for n in SHM.iterdir()}
    procs = [_spawn("init", 0, 3, port, tmp_path), _spawn("init", 2, 3, port, tmp_path)]
    try:
        # ranks 0 and 2 wait in init for rank 1; rank 2 has made its doorbell: kill it there
        bells = lambda: [n.name for n in SHM.iterdir() if n.name.endswith("bell2") and n.name not in before]  # noqa: E731
        _until("rank 2's doorbell", lambda: len(bells()) == 1, tmp_path)
        token = bells()[0].removeprefix("awex_ipc_").split("_")[0]
        _kill(procs[1:])
        procs.append(_spawn("init", 1, 3, port, tmp_path))
        _until("the survivors' reports", lambda: all(_reports(tmp_path, r) for r in (0, 1)), tmp_path)
    finally:
        _kill(procs)
    last_joined = _reports(tmp_path, 1)[0]["started"]
    for rank in (0, 1):
        (got,) = _reports(tmp_path, rank)
        assert got["type"] == "RuntimeError" and "rank 2 (pid" in got["error"] and "died" in got["error"], got
        assert got["ended"] - last_joined < TIMEOUT_S / 2, got  # seen dead, not waited out
    assert _fresh_group_reaps(token) == []


@pytest.mark.parametrize("case", ["handshake", "transfer"])
def test_group_killed_at_handshake_or_mid_transfer_leaves_nothing_after_a_fresh_init(case, tmp_path):
    world = 2 if case == "handshake" else 3
    ready = [0] if case == "handshake" else [0, 2]  # the ranks that report the state under test
    port = free_port()
    procs = [_spawn(case, r, world, port, tmp_path) for r in range(world)]
    try:
        _until(case, lambda: all(any(m.get("ready") for m in _reports(tmp_path, r)) for r in ready), tmp_path)
        token = _reports(tmp_path, 0)[0]["token"]
        assert any(token in n.name for n in SHM.iterdir())  # the state under test holds a segment
    finally:
        _kill(procs)
    assert _fresh_group_reaps(token) == []


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5]))
