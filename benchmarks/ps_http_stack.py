"""The parameter server's HTTP stack: the same version bytes pulled from `rlax ps serve` (the
standard library's http.server) and from a minimal FastAPI/uvicorn endpoint (a StreamingResponse
of the version's frames; one memoryview Response), against a memcpy of the same bytes as the
ceiling; GB/s of each and the ratios, then time-to-first-byte and p50/p99 of a small JSON request
while ``--pullers`` threads pull. docs/design.md §6 (the HTTP stack) reads these figures.
``.venv/bin/python benchmarks/ps_http_stack.py [--mib 64 512] [--pullers 4] [--quick]``"""

from __future__ import annotations

import argparse
import http.client
import io
import json
import logging
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _setup  # noqa: E402,F401  (the repository on sys.path, JAX on the CPU)
import _timing  # noqa: E402
import numpy as np  # noqa: E402

from rlax_tasks.paramserver import wire  # noqa: E402
from rlax_tasks.paramserver.push_receiver import PushReceiver  # noqa: E402
from rlax_tasks.paramserver.store import VersionStore  # noqa: E402
from rlax_tasks.paramserver.versions import WeightVersion  # noqa: E402

log = logging.getLogger("benchmarks.ps_http_stack")

TOKEN = "ps-http-stack-benchmark"
VERSION = 1
ARRAYS = 8  # the version's arrays, of equal size
STREAM_PATH = f"/v1/versions/{VERSION}"  # the whole version's wire stream (a full pull)
WHOLE_PATH = f"/v1/versions/{VERSION}/whole"  # FastAPI only: one memoryview Response
CONTROL_PATH = "/v1/latest"  # the small JSON request
START_TIMEOUT_S = 120.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, nargs="+", default=[64, 512], help="version sizes, MiB")
    p.add_argument("--repeats", type=int, default=5, help="timed pulls per stack and size")
    p.add_argument("--pullers", type=int, default=4, help="concurrent pulls under the JSON probe")
    p.add_argument("--control-s", type=float, default=5.0, help="seconds of JSON requests")
    p.add_argument("--quick", action="store_true", help="the smallest setting: 4 MiB, 2 repeats")
    p.add_argument("--json-out", default=None)
    p.add_argument("--serve-fastapi-mib", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.mib, args.repeats, args.pullers, args.control_s = [4], 2, 2, 0.5
    return args


# --------------------------------------------------------------------------- the version
def make_params(nbytes: int) -> dict[str, np.ndarray]:
    """``ARRAYS`` float32 arrays of ``nbytes`` in all, the same bytes in every process."""
    rng = np.random.default_rng(0)
    n = max(nbytes // (4 * ARRAYS), 1)
    return {f"layer{i}.w": rng.standard_normal(n, dtype=np.float32) for i in range(ARRAYS)}


def wire_stream(params: dict[str, np.ndarray], chunk_bytes: int) -> bytes:
    """The push stream of ``params`` as ``ParameterServerClient.push`` sends it (its blocks of at
    most ``chunk_bytes``, each with its CRC32C)."""
    from rlax_tasks.paramserver.push_plan import plan_leaf

    specs, plan = [], []
    for index, (name, leaf) in enumerate(params.items()):
        spec, blocks = plan_leaf(index, name, leaf, chunk_bytes)
        specs.append(spec)
        plan.extend(blocks)
    manifest = wire.Manifest(VERSION, tuple(specs), len(plan))
    out, headers = io.BytesIO(), []
    out.write(manifest.encode())
    for b in plan:
        view = b.fetch()
        headers.append(wire.BlockHeader(b.array, b.start, b.stop, b.nbytes, wire.crc32c(view)))
        out.write(headers[-1].encode())
        out.write(view)
    out.write(wire.end_frame(len(headers), wire.version_digest(manifest, headers)))
    return out.getvalue()


def store_version(params: dict[str, np.ndarray]) -> WeightVersion:
    """``params`` as the parameter server holds them: received into a ``VersionStore`` by its
    own push path, CRC32C checked."""
    stream = wire_stream(params, wire.DEFAULT_CHUNK_BYTES)
    receiver = PushReceiver(VersionStore(2, 60.0), None, True, lambda weights, seconds: None)
    return receiver.receive_push(VERSION, io.BytesIO(stream), len(stream))


# --------------------------------------------------------------------------- the FastAPI side
def fastapi_app(weights: WeightVersion) -> Any:
    """The minimal FastAPI endpoint: the version's frames streamed, or all of it as one
    memoryview; its latest-version JSON; the run's bearer token checked on each."""
    from fastapi import FastAPI, Header, HTTPException
    from fastapi.responses import Response, StreamingResponse

    from rlax_tasks.services.http import AuthError, check_bearer

    app = FastAPI()
    whole = memoryview(b"".join(bytes(f) for f in weights.frames()))  # a copy, made once
    length = str(weights.stream_length())

    def auth(authorization: str | None) -> None:
        try:
            check_bearer(authorization, TOKEN)
        except AuthError as e:
            raise HTTPException(e.status, e.message, e.headers) from None

    def frames() -> Iterator[bytes | memoryview]:
        with weights.pinned():
            yield from weights.frames()

    @app.get(STREAM_PATH)
    def stream(authorization: str | None = Header(None)) -> StreamingResponse:
        auth(authorization)
        headers = {"Content-Length": length}
        return StreamingResponse(frames(), media_type="application/octet-stream", headers=headers)

    @app.get(WHOLE_PATH)
    def whole_body(authorization: str | None = Header(None)) -> Response:
        auth(authorization)
        return Response(whole, media_type="application/octet-stream")

    @app.get(CONTROL_PATH)
    def latest(authorization: str | None = Header(None)) -> dict:
        auth(authorization)
        return {"version": weights.version, "digest": weights.digest.hex(), "parts": None}

    return app


def serve_fastapi(mib: int) -> int:
    """This script's other process: the FastAPI endpoint over a ``mib`` MiB version, its URL
    on stdout's first line (as `rlax ps serve` prints its own)."""
    from rlax_tasks.services.endpoints import announce, listen
    from rlax_tasks.services.http import serve_app

    app = fastapi_app(store_version(make_params(mib * 2**20)))
    sock, url = listen("127.0.0.1", 0)
    announce(url)
    serve_app(app, sock)
    return 0


# --------------------------------------------------------------------------- measuring
def start(argv: list[str]) -> tuple[subprocess.Popen, str]:
    """A server process and the URL it prints first."""
    env = {**os.environ, "RLAX_PS_TOKEN": TOKEN}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
    ready: list[str] = []
    reader = threading.Thread(target=lambda: ready.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(START_TIMEOUT_S)
    if not ready or not ready[0].startswith("http"):
        proc.kill()
        raise RuntimeError(f"{argv[1:3]} did not print its URL within {START_TIMEOUT_S:g}s")
    return proc, ready[0].strip()


def _connect(url: str) -> http.client.HTTPConnection:
    where = urllib.parse.urlsplit(url)
    return http.client.HTTPConnection(where.hostname, where.port, timeout=60)


def _get_json(url: str, path: str) -> Any:
    conn = _connect(url)
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {TOKEN}"})
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def pull_into(url: str, path: str, buf: memoryview) -> int:
    """One GET of ``path``, its body read into ``buf`` a chunk at a time as the client reads a
    pull; the bytes received."""
    conn = _connect(url)
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {TOKEN}"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"GET {path}: HTTP {resp.status}: {resp.read()[:200]!r}")
        got, chunk = 0, wire.DEFAULT_CHUNK_BYTES
        while k := resp.readinto(buf[got : got + chunk]):
            got += k
        return got
    finally:
        conn.close()


def time_pulls(url: str, path: str, buf: memoryview, repeats: int) -> dict[str, Any]:
    """GB/s of the median of ``repeats`` pulls (after one untimed)."""
    sizes: list[int] = []
    timing = _timing.median_time(
        lambda: sizes.append(pull_into(url, path, buf)), repeats=repeats, sync=lambda _: None
    )
    if len(set(sizes)) != 1:
        raise RuntimeError(f"GET {path} returned different sizes {sorted(set(sizes))}")
    return {"bytes": sizes[0], "gb_per_s": sizes[0] / timing.median_s / 1e9, **timing.as_dict()}


def control_latency(url: str, pullers: int, seconds: float, nbytes: int) -> dict[str, Any]:
    """Time-to-first-byte (the reply's headers in) and total of ``GET /v1/latest``, one at a
    time for ``seconds``, while ``pullers`` threads pull the whole version again and again."""
    stop, pulled = threading.Event(), []

    def pull_loop() -> None:
        buf = memoryview(bytearray(nbytes))
        while not stop.is_set():
            pulled.append(pull_into(url, STREAM_PATH, buf))

    threads = [threading.Thread(target=pull_loop, daemon=True) for _ in range(pullers)]
    for t in threads:
        t.start()
    ttfb, total = [], []
    conn = _connect(url)
    deadline = time.perf_counter() + seconds
    try:
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            conn.request("GET", CONTROL_PATH, headers={"Authorization": f"Bearer {TOKEN}"})
            resp = conn.getresponse()
            ttfb.append(time.perf_counter() - t0)
            json.loads(resp.read())
            total.append(time.perf_counter() - t0)
            time.sleep(0.005)
    finally:
        conn.close()
        stop.set()
        for t in threads:
            t.join(60)

    def ms(xs: list[float], q: float) -> float:
        return 1e3 * float(np.quantile(xs, q))

    return {
        "requests": len(total), "pulls_meanwhile": len(pulled),
        "ttfb_p50_ms": ms(ttfb, 0.5), "ttfb_p99_ms": ms(ttfb, 0.99),
        "total_p50_ms": ms(total, 0.5), "total_p99_ms": ms(total, 0.99),
    }  # fmt: skip


def memcpy_gbps(nbytes: int, repeats: int) -> float:
    """The ceiling: one copy of ``nbytes`` in memory, GB/s."""
    src, dst = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    timing = _timing.median_time(lambda: np.copyto(dst, src), repeats=repeats, sync=lambda _: None)
    return nbytes / timing.median_s / 1e9


def run_size(mib: int, args: argparse.Namespace) -> dict[str, Any]:
    """Every figure for one version size: both stacks serve the same version bytes."""
    from rlax_tasks.paramserver import ParameterServerClient

    params = make_params(mib * 2**20)
    ps, ps_url = start([sys.executable, "-m", "rlax_tasks.cli", "ps", "serve"])
    script = os.path.abspath(__file__)
    fa, fa_url = start([sys.executable, script, "--serve-fastapi-mib", str(mib)])
    try:
        ParameterServerClient(ps_url, token=TOKEN).push(VERSION, params)
        urls = {"ps": ps_url, "fastapi": fa_url}
        digests = {stack: _get_json(url, CONTROL_PATH)["digest"] for stack, url in urls.items()}
        if digests["ps"] != digests["fastapi"]:
            raise RuntimeError(f"the two stacks hold different versions: {digests}")
        nbytes = store_version(params).stream_length()
        buf = memoryview(bytearray(nbytes))
        result: dict[str, Any] = {"mib": mib, "stream_bytes": nbytes}
        result["ps"] = time_pulls(ps_url, STREAM_PATH, buf, args.repeats)
        result["fastapi_stream"] = time_pulls(fa_url, STREAM_PATH, buf, args.repeats)
        result["fastapi_memoryview"] = time_pulls(fa_url, WHOLE_PATH, buf, args.repeats)
        client = ParameterServerClient(ps_url, token=TOKEN, shared_memory=False, delta=False)
        t = _timing.median_time(lambda: client.pull_version(VERSION), args.repeats, sync=bool)
        result["ps_client_pull_gb_per_s"] = nbytes / t.median_s / 1e9  # CRC32C, arrays
        result["memcpy_gb_per_s"] = memcpy_gbps(nbytes, args.repeats)
        for stack, url in urls.items():
            result[f"{stack}_control"] = control_latency(url, args.pullers, args.control_s, nbytes)
        return result
    finally:
        for proc in (ps, fa):
            proc.terminate()
            proc.wait(30)


def report(result: dict[str, Any], mark: str) -> list[str]:
    """The lines of one size: GB/s and ratios, then the JSON request's latency."""
    ps = result["ps"]["gb_per_s"]
    lines = [f"{result['mib']} MiB version ({result['stream_bytes']:,} stream bytes){mark}:"]
    for name, gbps in (
        ("ps http.server", ps),
        ("fastapi StreamingResponse", result["fastapi_stream"]["gb_per_s"]),
        ("fastapi memoryview Response", result["fastapi_memoryview"]["gb_per_s"]),
        ("ps client pull (CRC32C + arrays)", result["ps_client_pull_gb_per_s"]),
        ("memcpy ceiling", result["memcpy_gb_per_s"]),
    ):
        lines.append(f"  {name:34s} {gbps:7.2f} GB/s   ps / this = {ps / gbps:5.2f}")
    for stack in ("ps", "fastapi"):
        c = result[f"{stack}_control"]
        lines.append(
            f"  {stack:7s} GET {CONTROL_PATH} under {c['pulls_meanwhile']} pulls: ttfb p50 "
            f"{c['ttfb_p50_ms']:.2f} ms, p99 {c['ttfb_p99_ms']:.2f} ms; total p99 "
            f"{c['total_p99_ms']:.2f} ms ({c['requests']} requests)"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve_fastapi_mib is not None:
        return serve_fastapi(args.serve_fastapi_mib)
    _timing.setup_logging()
    t0 = time.perf_counter()
    settle_s = 0.0 if args.quick else 150.0  # the smallest setting is a smoke run: no waiting
    load_before = _timing.machine_load(log, "before", settle_s=settle_s)
    results = [run_size(mib, args) for mib in args.mib]
    load_after = _timing.machine_load(log, "after")
    mark = _timing.contended_mark(load_before, load_after)
    lines = [line for r in results for line in report(r, mark)]
    summary = {
        "sizes": results, "load_before": load_before, "load_after": load_after,
        "pullers": args.pullers, "repeats": args.repeats,
        "peak_rss_bytes": _timing.peak_rss_bytes(), "wall_s": time.perf_counter() - t0,
        "median_ps_over_fastapi_stream": statistics.median(
            r["ps"]["gb_per_s"] / r["fastapi_stream"]["gb_per_s"] for r in results
        ),
    }  # fmt: skip
    _timing.print_report(lines, summary)
    _timing.write_json(args.json_out, summary, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
