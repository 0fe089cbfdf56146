"""The one join (`awex_fast.sync.join`) against a real KV store: each step's value on the wire
is docs/DESIGN.md's ("KV keys"), and each step's failure names the step, the pair, the KV store
and the rank."""

from __future__ import annotations

import pytest

from awex_fast.meta import (
    MetadataError,
    ParameterMeta,
    ShardMeta,
    metas_from_b64,
    metas_to_b64,
    transfer_ranks,
)
from awex_fast.net import KVStoreClient, KVStoreServer
from awex_fast.sync import (
    INFER_META_KEY,
    MASTER_PORT_KEY,
    TRAINING_META_KEY,
    JoinError,
    JoinTimeoutError,
    World,
    check_digests,
    decode_side_metas,
    digest_key,
    form_transfer_group,
    gather_rank_metas,
    merge_per_engine,
    publish_side,
    read_report,
    reset_group_keys,
    run_step,
    wait_side,
)

KEY = "join-test-key"
PAIR = "joinpair"


@pytest.fixture(scope="module")
def kv():
    server = KVStoreServer(admin_api_key=KEY).start()
    client = KVStoreClient(server.url, KEY)
    yield client
    client.close()
    server.stop()


def _rows(rank: int, start: int, rows: int) -> ParameterMeta:
    return ParameterMeta("w", (4, 2), "float32", (ShardMeta(rank, (start, 0), (rows, 2)),))


def test_world_matches_transfer_ranks():
    world = World((2, 1, 3), 2)
    bases, train_base = transfer_ranks([2, 1, 3], 2)  # the metadata layer's own rule
    assert [world.inference_rank(e, 0) for e in range(3)] == bases
    assert world.training_rank(1) == train_base + 1 and world.world_size == 8
    args = world.init_args(PAIR, "http://kv", "10.0.0.1", 0, world.inference_rank(2, 1))
    assert args == {"pair_name": PAIR, "kv_store_url": "http://kv", "infer_world_size": 6,
                    "train_world_size": 2, "num_engines": 3, "master_addr": "10.0.0.1", "master_port": 0,
                    "transfer_rank": 4, "world_size": 8}
    with pytest.raises(ValueError, match="engine sizes"):
        World((), 1)


def test_publish_and_wait_side_round_trip_on_the_design_keys(kv: KVStoreClient):
    engines = merge_per_engine([[_rows(0, 0, 2)], [_rows(1, 2, 2)], [_rows(0, 0, 4)]], [2, 1])
    publish_side(kv, PAIR, "inference", engines, [2, 1])
    publish_side(kv, PAIR, "training", [[_rows(0, 0, 4)]], [1], bucket_bytes=1 << 20)
    raw = kv.get(PAIR, INFER_META_KEY)  # the wire value, read without the join's helpers
    assert raw["sizes"] == [2, 1] and raw["side"] == "inference" and raw["rank_space"] == "side_local"
    assert metas_from_b64(raw["metas"][1], what="engine 1") == [_rows(0, 0, 4)]
    sizes, groups, value = wait_side(kv, PAIR, "training", 5.0)
    assert sizes == [1] and groups == [[_rows(0, 0, 4)]] and value["bucket_bytes"] == 1 << 20
    assert kv.get(PAIR, TRAINING_META_KEY) == value
    assert decode_side_metas(raw, "inference")[0] == [2, 1]


def test_a_missing_side_names_the_step_pair_and_store(kv: KVStoreClient):
    with pytest.raises(JoinTimeoutError) as err:
        wait_side(kv, "nobody-here", "inference", 0.3, who="the inference side")
    exc = err.value
    assert isinstance(exc, TimeoutError) and exc.step == "wait for infer_params_meta"
    assert exc.pair == "nobody-here" and exc.kv_url == kv.url
    parts = ("'wait for infer_params_meta'", "'nobody-here'", kv.url, "the inference side", INFER_META_KEY)
    for part in parts:
        assert part in str(exc)


def test_a_malformed_side_value_names_the_key_and_group(kv: KVStoreClient):
    value = {"format": "awex_fast.side_metas", "version": 1, "side": "training", "rank_space": "side_local",
             "sizes": [1], "metas": ["%%%"]}
    kv.put("badpair", TRAINING_META_KEY, value)
    with pytest.raises(MetadataError, match=r"training_params_meta.*training group 0: metadata is not base6"):
        wait_side(kv, "badpair", "training", 5.0)


def test_gather_names_the_rank_that_never_published(kv: KVStoreClient):
    keys = ["gather_rank0", "gather_rank1"]
    kv.put(PAIR, keys[0], metas_to_b64([_rows(0, 0, 4)]))
    with pytest.raises(JoinTimeoutError, match="training rank 1 did not publish") as err:
        gather_rank_metas(kv, PAIR, keys, 0.5, step="merge", who="training rank",
                          decode=lambda v, what: metas_from_b64(v, what=what))
    assert err.value.rank == 1 and err.value.step == "merge"
    kv.put(PAIR, keys[1], "not base64!")
    with pytest.raises(MetadataError, match=r"^training rank 1 \(KV key 'gather_rank1'"):
        gather_rank_metas(kv, PAIR, keys, 5.0, step="merge", who="training rank",
                          decode=lambda v, what: metas_from_b64(v, what=what))


def test_run_step_wraps_a_failure_naming_the_step():
    def boom() -> None:
        raise ConnectionError("refused")

    with pytest.raises(JoinError) as err:
        run_step("publish training metadata", boom, pair=PAIR, kv_url="http://kv:1", rank=3)
    exc = err.value
    assert (exc.step, exc.pair, exc.kv_url, exc.rank) == ("publish training metadata", PAIR, "http://kv:1", 3)
    assert "join step 'publish training metadata' of pair 'joinpair' at http://kv:1 (rank 3)" in str(exc)
    assert "ConnectionError: refused" in str(exc) and isinstance(exc.__cause__, ConnectionError)
    assert run_step("fine", lambda: 7, pair=PAIR, kv_url=None) == 7


def test_report_and_digests(kv: KVStoreClient):
    assert read_report({"metas": metas_to_b64([_rows(0, 0, 4)])}, what="w0") == [_rows(0, 0, 4)]
    with pytest.raises(MetadataError, match=r"^w0: report_weight_meta answered"):
        read_report({"oops": 1}, what="w0")
    reset_group_keys(kv, PAIR, range(3))
    for r in range(3):
        kv.put(PAIR, digest_key(r), "abc" if r != 2 else "xyz")
    with pytest.raises(JoinError, match="compare plan digests") as err:
        check_digests(kv, PAIR, range(3))
    assert err.value.rank == 2
    kv.put(PAIR, digest_key(2), "abc")
    assert check_digests(kv, PAIR, range(3)) == "abc"
    reset_group_keys(kv, PAIR, range(3))
    with pytest.raises(JoinError):  # nobody mirrored a digest
        check_digests(kv, PAIR, range(3))


def test_form_transfer_group_publishes_the_port_rank0_bound(kv: KVStoreClient):
    reset_group_keys(kv, "grouppair")
    group, store = form_transfer_group(kv, "grouppair", "gloo", "127.0.0.1", 0, 0, 1, 30.0)
    try:
        published = kv.get("grouppair", MASTER_PORT_KEY)
        assert published == {"addr": "127.0.0.1", "port": store.port} and store.port > 0
    finally:
        group.close()
    with pytest.raises(JoinTimeoutError, match="transfer rank 0 did not publish") as err:
        form_transfer_group(kv, "nogroup", "gloo", "127.0.0.1", 0, 1, 2, 0.3)
    assert err.value.step == "form the transfer group" and err.value.rank == 0
