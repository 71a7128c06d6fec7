"""The demo's pass-2 check: exact first tokens, near-ties, real differences."""

from __future__ import annotations

from ucm_db.connector.demo import NEAR_TIE_LOGPROB, compare_first_tokens


def _run(tokens: list[int], tops: list[dict[int, float]]) -> dict[str, object]:
    return {"first_tokens": tokens, "top_logprobs": [{str(k): v for k, v in top.items()} for top in tops]}


def test_same_near_tie_and_different_are_told_apart() -> None:
    first = _run([7, 7, 7, 7], [{7: -2.000, 9: -2.001, 3: -4.0}] * 4)
    second = _run([7, 9, 3, 12], [
        {7: -2.000, 9: -2.001},   # same token
        {9: -2.000, 7: -2.002},   # a flip between two tokens pass 1 scored 0.001 apart
        {3: -1.0, 7: -3.0},       # a flip to a token pass 1 scored 2 nats lower: wrong KV
        {12: -1.0, 5: -2.0},      # a token pass 1 did not have in its top 5
    ])
    verdicts = compare_first_tokens(first, second)
    assert verdicts[0] == "same"
    assert verdicts[1].startswith("near-tie") and NEAR_TIE_LOGPROB > 0.001
    assert verdicts[2:] == ["DIFFERENT", "DIFFERENT"]
