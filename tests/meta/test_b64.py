"""`metas_to_b64` / `metas_from_b64`: the one base64 form of metas JSON, validated on every
decode, every error naming its source."""

from __future__ import annotations

import base64
import json

import pytest

import awex_fast as af
from awex_fast.meta import (
    MetadataError,
    ParameterMeta,
    ShardMeta,
    metas_from_b64,
    metas_to_b64,
    metas_to_json,
)


def _metas() -> list[ParameterMeta]:
    halves = (ShardMeta(0, (0, 0), (2, 2)), ShardMeta(1, (2, 0), (2, 2)))
    return [ParameterMeta("w", (4, 2), "float32", halves),
            ParameterMeta("b", (3,), "bfloat16", (ShardMeta(0, (0,), (3,)),))]


def test_round_trip_is_the_json_codec_in_base64():
    metas = _metas()
    text = metas_to_b64(metas)
    # independent oracle: the stdlib's base64 of the JSON codec's bytes
    assert text == base64.b64encode(metas_to_json(metas)).decode("ascii")
    assert metas_from_b64(text, what="here") == metas
    assert metas_from_b64(text.encode("ascii"), what="here") == metas
    assert af.metas_from_b64 is metas_from_b64 and af.metas_to_b64 is metas_to_b64


@pytest.mark.parametrize(
    ("payload", "defect"),
    [
        (None, "must be a base64 string"),
        (17, "must be a base64 string"),
        ("not base64 at all!", "not base64"),
        ("QUJD\n", "not base64"),  # strict: no stray characters
        (base64.b64encode(b"{not json").decode(), "malformed"),
        (base64.b64encode(json.dumps({"format": "other", "version": 1}).encode()).decode(), "format tag"),
    ],
)
def test_malformed_payload_names_its_source(payload: object, defect: str):
    with pytest.raises(MetadataError, match=defect) as err:
        metas_from_b64(payload, what="engine 1 rank 0: report_weight_meta")  # type: ignore[arg-type]
    assert str(err.value).startswith("engine 1 rank 0: report_weight_meta: ")


def test_invalid_metadata_is_refused_on_decode():
    # two pieces of rank 0 overlap: well-formed JSON (the encoder does not validate) that
    # validate_metas refuses; every decode validates, so the peer's mistake stops here
    bad = [ParameterMeta("w", (4,), "float32", (ShardMeta(0, (0,), (3,)), ShardMeta(0, (2,), (2,))))]
    with pytest.raises(MetadataError, match=r"^KV key 'x': parameter 'w': rank 0 holds overlapping"):
        metas_from_b64(metas_to_b64(bad), what="KV key 'x'")
