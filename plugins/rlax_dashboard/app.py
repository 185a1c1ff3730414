"""The RLAX dashboard as a FastAPI app: a runs table and per-run plots, mounted by the plugin.

Routes (relative to the mount point, /rlax in Airflow):
- ``GET /`` — HTML table of every run under the configured run roots with its state.
- ``GET /api/runs`` — the same as JSON.
- ``GET /runs/{root}/{run_id}/`` — HTML page with the run's four plots (root = index of the
  run root in the configured list).
- ``GET /runs/{root}/{run_id}/series`` — the plotted series as JSON.
- ``GET /runs/{root}/{run_id}/plots/{name}.png`` — one plot (reward, pass_at_k, staleness,
  weight_sync).
Every link is relative, so the pages work under any mount prefix and reverse proxy.
"""

from __future__ import annotations

import asyncio
import html
import time
from collections.abc import Sequence

from fastapi import Depends, FastAPI, HTTPException
from fastapi.responses import HTMLResponse, Response

from rlax_dashboard.plots import PLOTS, render_png
from rlax_dashboard.runs import (
    ACTIVE_WINDOW_S,
    RUN_ID_RE,
    list_runs,
    read_series,
    run_dir,
    run_roots_from_env,
)

_STYLE = """
body{font-family:system-ui,sans-serif;margin:1.2rem;color:#222}
table{border-collapse:collapse}
td,th{padding:.3rem .7rem;border-bottom:1px solid #ddd;text-align:left}
.state{font-weight:600}.running{color:#0a7}.finished,.succeeded{color:#36c}
.failed{color:#c33}.stopped,.pending{color:#888}
.plots{display:grid;grid-template-columns:repeat(auto-fill,minmax(420px,1fr));gap:1rem}
img{max-width:100%;border:1px solid #eee}
"""


def _page(title: str, body: str) -> HTMLResponse:
    return HTMLResponse(
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{_STYLE}</style></head><body>{body}</body></html>"
    )


def _fmt(value: float | None, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _when(ts: float | None) -> str:
    return "–" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def create_app(
    run_roots: Sequence[str] | None = None,
    *,
    require_auth: bool = False,
    active_window_s: float = ACTIVE_WINDOW_S,
) -> FastAPI:
    """The dashboard over ``run_roots`` (default: RLAX_RUN_ROOTS, read per request).

    ``require_auth`` protects every route with Airflow's session (the ``_token`` cookie the UI
    sets, or a bearer token): use it when mounted in the Airflow api-server.
    """
    dependencies = []
    if require_auth:
        from airflow.api_fastapi.core_api.security import requires_authenticated

        dependencies.append(Depends(requires_authenticated()))
    app = FastAPI(title="RLAX dashboard", dependencies=dependencies)

    def roots() -> list[str]:
        return list(run_roots) if run_roots is not None else run_roots_from_env()

    def resolve(root: int, run_id: str) -> str:
        configured = roots()
        if not 0 <= root < len(configured):
            raise HTTPException(404, f"no run root #{root} (configured: {len(configured)})")
        if not RUN_ID_RE.match(run_id):
            raise HTTPException(404, f"invalid run id {run_id!r}")
        return run_dir(configured[root], run_id)

    @app.get("/api/runs")
    async def runs_json() -> dict:
        runs = await asyncio.to_thread(list_runs, roots(), active_window_s)
        return {"run_roots": roots(), "runs": [r.to_dict() for r in runs]}

    @app.get("/", response_class=HTMLResponse)
    async def index() -> HTMLResponse:
        configured = roots()
        runs = await asyncio.to_thread(list_runs, configured, active_window_s)
        ks = sorted({k for r in runs for k in r.pass_at}, key=lambda k: int(k.split("@")[1]))
        head = "".join(
            f"<th>{h}</th>"
            for h in ["run", "state", "step", "reward", *map(html.escape, ks), "updated", "root"]
        )
        rows = []
        for r in runs:
            link = f"runs/{r.root_index}/{html.escape(r.run_id)}/"
            cells = [
                f"<a href='{link}'>{html.escape(r.run_id)}</a>",
                f"<span class='state {html.escape(r.state)}'>{html.escape(r.state)}</span>",
                "–" if r.step is None else str(r.step),
                _fmt(r.reward_mean),
                *[_fmt(r.pass_at.get(k)) for k in ks],
                _when(r.updated),
                html.escape(r.run_root),
            ]
            rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
        table = (
            f"<table><tr>{head}</tr>{''.join(rows)}</table>"
            if rows
            else "<p>No runs yet under " + html.escape(", ".join(configured)) + ".</p>"
        )
        return _page("RLAX runs", f"<h1>RLAX runs</h1>{table}")

    @app.get("/runs/{root}/{run_id}/", response_class=HTMLResponse)
    async def run_page(root: int, run_id: str) -> HTMLResponse:
        path = resolve(root, run_id)
        imgs = "".join(
            f"<figure><img alt='{html.escape(title)}' src='plots/{name}.png'></figure>"
            for name, (title, _, _) in PLOTS.items()
        )
        body = (
            f"<p><a href='../../../'>← all runs</a></p><h1>{html.escape(run_id)}</h1>"
            f"<p>{html.escape(path)} · <a href='series'>series (JSON)</a></p>"
            f"<div class='plots'>{imgs}</div>"
        )
        return _page(f"RLAX run {run_id}", body)

    @app.get("/runs/{root}/{run_id}/series")
    async def run_series(root: int, run_id: str) -> dict:
        return (await asyncio.to_thread(read_series, resolve(root, run_id))).to_dict()

    @app.get("/runs/{root}/{run_id}/plots/{name}.png")
    async def run_plot(root: int, run_id: str, name: str) -> Response:
        if name not in PLOTS:
            raise HTTPException(404, f"unknown plot {name!r}; plots: {', '.join(PLOTS)}")
        series = await asyncio.to_thread(read_series, resolve(root, run_id))
        png = await asyncio.to_thread(render_png, series, name)
        return Response(png, media_type="image/png", headers={"Cache-Control": "no-store"})

    return app
