"""Step 0 of the vLLM rendezvous (engines claim their place), against a real KV store: engines
are numbered by client, then data-parallel replica; a client behind which nothing claimed, or
behind which one engine could not claim, is refused by name (updating the others would label a
server one of whose replicas never joined)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="awex_fast.vllm needs vLLM")

from awex_fast.net import KVStoreClient, KVStoreServer
from awex_fast.vllm import rendezvous

KEY = "rendezvous-test-key"
CLIENTS = ["http://a:8000", "http://b:8000"]


@pytest.fixture
def kv():
    with KVStoreServer(admin_api_key=KEY) as srv:
        client = KVStoreClient(srv.url, KEY)
        yield client
        client.close()


def test_engines_are_ordered_by_client_then_replica_and_learn_their_index(kv):
    rendezvous.claim_engine(kv, "p", 1, "tok-b", 2)
    rendezvous.claim_engine(kv, "p", 0, "tok-z", 1, replica=1)
    rendezvous.claim_engine(kv, "p", 0, "tok-y", 1, replica=0)
    order = rendezvous.order_engines(kv, "p", CLIENTS)
    assert [(e.client, e.replica, e.token, e.size) for e in order] == [
        (0, 0, "tok-y", 1), (0, 1, "tok-z", 1), (1, 0, "tok-b", 2)]
    assert rendezvous.engine_index(kv, "p", "tok-z", 5.0) == (1, 3)
    assert order[1].name(CLIENTS[0], alone=False).startswith(f"{CLIENTS[0]} (data-parallel replica 1")
    assert order[2].name(CLIENTS[1], alone=True) == CLIENTS[1]
    with pytest.raises(rendezvous.WorkerInitError, match="not in the engine order"):
        rendezvous.engine_index(kv, "p", "tok-late", 5.0)


def test_a_client_without_a_claim_is_named(kv):
    rendezvous.claim_engine(kv, "p", 0, "tok-a", 2)
    with pytest.raises(rendezvous.WorkerInitError, match=r"no vLLM engine behind http://b:8000"):
        rendezvous.order_engines(kv, "p", CLIENTS)


def test_a_failed_claim_refuses_the_join_naming_the_client_and_the_reason(kv):
    rendezvous.claim_engine(kv, "p", 0, "tok-a", 1, replica=0)
    rendezvous.claim_engine(kv, "p", 1, "tok-b", 1)
    rendezvous.claim_failed(kv, "p", 0, "vLLM engine ? worker 0", RuntimeError("world group has 3 ranks"))
    with pytest.raises(rendezvous.WorkerInitError) as info:
        rendezvous.order_engines(kv, "p", CLIENTS)
    text = str(info.value)
    assert CLIENTS[0] in text and "world group has 3 ranks" in text and "would not receive" in text, text
