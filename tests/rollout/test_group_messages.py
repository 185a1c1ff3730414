"""The controller ⇄ worker messages survive their JSON encoding (both ends use requests.py)."""

from __future__ import annotations

import json

import pytest

from rlax_tasks.rollout.requests import (
    Completion,
    GroupRequest,
    GroupResult,
    Request,
    SamplingParams,
)


def test_group_request_round_trips_through_json() -> None:
    params = SamplingParams(max_new_tokens=7, temperature=0.5, stop_token_ids=(3, 4), seed=9)
    sent = GroupRequest("p1", (1, 2, 3), 4, params, min_version=2)
    wire = json.loads(json.dumps(sent.to_dict()))
    assert wire["params"]["stop_token_ids"] == [3, 4]
    assert GroupRequest.from_dict(wire) == sent


def test_group_request_names_a_bad_field() -> None:
    wire = GroupRequest("p1", (1,), 2).to_dict()
    with pytest.raises(ValueError, match="group_size"):
        GroupRequest.from_dict({**wire, "group_size": 0})
    with pytest.raises(ValueError, match="unknown sampling parameter"):
        GroupRequest.from_dict({**wire, "params": {"temprature": 1.0}})


@pytest.mark.parametrize("texts", [["a", "b"], None])
def test_group_result_round_trips_through_json(texts: list[str] | None) -> None:
    prompt = (5, 6)
    completions = [
        Completion(Request(prompt, sample_index=i), [7 + i, 8], [-0.5, -0.25], reason)
        for i, reason in enumerate(("eos", "length"))
    ]
    sent = GroupResult("p1", 3, prompt, completions, texts, 1.5)
    got = GroupResult.from_dict(json.loads(json.dumps(sent.to_dict())))
    assert (got.prompt_id, got.version, got.prompt_tokens, got.seconds) == ("p1", 3, prompt, 1.5)
    assert [(c.tokens, c.logprobs, c.finish_reason) for c in got.completions] == [
        ([7, 8], [-0.5, -0.25], "eos"),
        ([8, 8], [-0.5, -0.25], "length"),
    ]
    assert [c.request.request_id for c in got.completions] == [("p1", 0), ("p1", 1)]
    assert got.texts == (texts or ["", ""])  # a worker without a tokenizer sends no text
