"""The controller's pool of HTTP workers: a snapshot asks every holder for its progress at once on
the result feeds' event loop (``HttpWorkerPool.progress_many``), and one worker that is down,
answers nonsense or refuses the run's token costs only its own report."""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator

import pytest

from rlax_tasks.controller.partials import PartialRollouts
from rlax_tasks.controller.ports import LateAnswer, WorkerError
from rlax_tasks.controller.service import HttpWorkerPool

SAMPLE = {"sample": 0, "tokens": [5, 6], "logprobs": [-0.5, -0.25], "versions": [3, 3]}


class _Workers:
    """``n`` HTTP workers on threads; ``answers[i]`` is worker i's progress reply (status,
    body). Every progress request waits at a barrier of all ``n``: it passes only if the
    requests are open at the same time (asked one by one, the first times out)."""

    def __init__(self, n: int, hung: tuple[int, ...] = ()) -> None:
        self.barrier = threading.Barrier(n - len(hung), timeout=20)
        self.hung = hung  # these answer only after 5 s, without the barrier
        self.answers: dict[int, tuple[int, bytes]] = {}
        self.servers = [self._serve(i) for i in range(n)]

    def _serve(self, i: int) -> http.server.ThreadingHTTPServer:
        workers = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                if self.path.startswith("/v1/results"):  # the feeds' long poll: nothing yet
                    status, body = 200, b'{"results": []}'
                elif i in workers.hung:
                    time.sleep(5.0)
                else:
                    workers.barrier.wait()
                    status, body = workers.answers[i]
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server

    def url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.servers[i].server_address[1]}"

    def close(self) -> None:
        for s in self.servers:
            s.shutdown()
            s.server_close()


@pytest.fixture
def workers() -> Iterator[_Workers]:
    w = _Workers(4)
    yield w
    w.close()


def _pool(tmp_path, addresses: dict[str, str]) -> HttpWorkerPool:  # noqa: ANN001
    path = tmp_path / "workers.json"
    path.write_text(json.dumps(addresses))
    return HttpWorkerPool(str(path), timeout_s=5.0)


def _report(prompt_id: str) -> tuple[int, bytes]:
    return 200, json.dumps({"groups": [{"prompt_id": prompt_id, "samples": [SAMPLE]}]}).encode()


def test_progress_many_asks_every_worker_at_once_and_keeps_each_failure_its_own(
    tmp_path, workers
):
    workers.answers = {
        0: _report("p0"),
        1: _report("p1"),
        2: (200, b'{"groups": [{"prompt_id": "p2"}]}'),  # no samples: another version's worker
        3: (500, b"generation thread died"),
    }
    addresses = {f"w{i}": workers.url(i) for i in range(4)}
    pool = _pool(tmp_path, addresses)
    try:
        reports = pool.progress_many(["w0", "w1", "w2", "w3", "gone"])
        assert reports["w0"]["p0"][0].tokens == (5, 6)
        assert reports["w1"]["p1"][0].versions == (3, 3)
        assert isinstance(reports["w2"], WorkerError) and "unreadable" in str(reports["w2"])
        assert isinstance(reports["w3"], ConnectionError) and "HTTP 500" in str(reports["w3"])
        assert isinstance(reports["gone"], WorkerError) and "left the fleet" in str(
            reports["gone"]
        )
    finally:
        pool.close()


def test_a_snapshot_gather_keeps_older_records_of_workers_that_fail(tmp_path, workers):
    workers.answers = {i: _report(f"p{i}") for i in range(3)}
    workers.answers[3] = (401, b"bad token")
    pool = _pool(tmp_path, {f"w{i}": workers.url(i) for i in range(4)})
    partials = PartialRollouts()
    held = {"prompt_id": "p3", "sample": 0, "tokens": [9], "logprobs": [-1.0], "versions": [2]}
    partials.load([held])  # what w3 held when last asked
    try:
        with pytest.raises(RuntimeError, match="RLAX_PS_TOKEN"):  # a wrong token is no outage
            partials.gather(pool, {f"w{i}": [f"p{i}"] for i in range(4)})
        workers.answers[3] = (503, b"compiling")
        partials.gather(pool, {f"w{i}": [f"p{i}"] for i in range(4)})
    finally:
        pool.close()
    assert [r.tokens for r in partials.resume("p0", 0)] == [(5, 6)]
    assert [r.tokens for r in partials.resume("p3", 0)] == [(9,)]  # kept: w3 did not answer


def test_a_snapshot_waits_for_no_worker_past_its_deadline(tmp_path):
    """A worker that has not answered by the deadline is cut off (``LateAnswer``) and keeps its
    older records; the others' answers are taken; the report counts both."""
    workers = _Workers(3, hung=(2,))
    workers.answers = {i: _report(f"p{i}") for i in range(3)}
    pool = _pool(tmp_path, {f"w{i}": workers.url(i) for i in range(3)})
    try:
        report = PartialRollouts().gather(pool, {f"w{i}": [f"p{i}"] for i in range(3)}, 1.0)
        assert (report.asked, report.answered, report.late, report.failed) == (3, 2, 1, 0)
        answers = pool.progress_many(["w0", "w1", "w2"], deadline_s=1.0)
        assert isinstance(answers["w2"], LateAnswer) and answers["w0"]["p0"]
    finally:
        pool.close()
        workers.close()
