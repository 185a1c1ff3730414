"""A worker's answer is checked before the controller takes it: malformed results name the
field, an oversized answer is a failure of that worker read no further."""

from __future__ import annotations

import http.server
import json
import threading

import pytest

from rlax_tasks.rollout.requests import GroupResult, check_result_json
from rlax_tasks.rollout.service import WorkerClient


def _result(**over) -> dict:
    good = {
        "prompt_id": "math/3",
        "version": 2,
        "prompt_tokens": [1, 2, 3],
        "completions": [
            {"tokens": [4, 5], "logprobs": [-0.1, -0.2], "finish_reason": "eos",
             "versions": [2, 2]},
        ],
        "seconds": 0.5,
    }  # fmt: skip
    good.update(over)
    return good


def _completion(**over) -> dict:
    return {**_result()["completions"][0], **over}


def test_a_well_formed_result_reads_back():
    r = GroupResult.from_dict(_result())
    assert r.prompt_id == "math/3" and r.completions[0].tokens == [4, 5]
    assert GroupResult.from_dict(r.to_dict()).to_dict() == r.to_dict()


@pytest.mark.parametrize(
    "bad, message",
    [
        ([], "a result must be an object"),
        (_result(prompt_id=7), "prompt_id must be a non-empty string"),
        (_result(version=-1), "'math/3': version must be an int >= 0"),
        (_result(version=True), "version must be an int"),
        (_result(prompt_tokens=[1, "x"]), "prompt_tokens must be a list of token ids"),
        (_result(completions=[]), "completions must be a non-empty list"),
        (_result(seconds="soon"), "seconds must be a number"),
        (_result(completions=[_completion(tokens=[4, -5])]), "completion 0: tokens must"),
        (_result(completions=[_completion(logprobs=[-0.1])]), "logprobs must be a list as long"),
        (
            _result(completions=[_completion(logprobs=[-0.1, float("nan")])]),
            "logprobs must be finite numbers",
        ),
        (_result(completions=[_completion(finish_reason="tired")]), "finish_reason must be"),
        (_result(completions=[_completion(versions=[2])]), "versions must be one int >= 0"),
        (_result(completions=[_completion(mask=[1, 1, 1])]), "mask must be one int >= 0"),
    ],
)
def test_a_malformed_result_names_its_field(bad, message):
    with pytest.raises(ValueError, match=message):
        check_result_json(bad)
    with pytest.raises(ValueError, match=message):
        GroupResult.from_dict(bad)


@pytest.fixture
def talkative_worker():
    """A server that answers every GET with ``body`` (set by the test)."""
    state = {"body": b"{}"}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - stdlib name
            body = state["body"]
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield state, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_an_oversized_answer_is_the_workers_failure(talkative_worker):
    state, url = talkative_worker
    client = WorkerClient(url, token="t", max_reply_bytes=10_000)
    state["body"] = json.dumps({"results": [_result()]}).encode()
    assert client.results() == [_result()]
    state["body"] = json.dumps({"results": [_result()] * 100}).encode()  # > 10 kB
    with pytest.raises(ConnectionError, match="answered too much: .* exceeds 10000 bytes"):
        client.results()
