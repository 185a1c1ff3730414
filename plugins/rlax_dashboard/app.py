"""The RLAX dashboard as a FastAPI app, mounted by the plugin (at /rlax in Airflow): a runs table
(``/``, ``/api/runs``), per-run pages with before/after numbers, plots and nightly evaluations
(``/runs/{root}/{run_id}/``; root: index in the configured run roots) and a compare view
(``/compare?runs=0/a,0/b``). Links are relative, so pages work under any mount prefix and proxy;
links to the Airflow UI's DAG runs are relative to ``airflow_ui``."""

from __future__ import annotations

import asyncio
import dataclasses
import html
import json
import re
import time
import urllib.parse
from collections.abc import Sequence
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Query
from fastapi.responses import HTMLResponse, Response

from rlax_dashboard.empty import empty_reasons
from rlax_dashboard.plots import COMPARE_PLOTS, NO_DATA, PLOTS, render_compare_png, render_png
from rlax_dashboard.runs import (
    ACTIVE_WINDOW_S,
    RUN_ID_RE,
    RunSeries,
    RunSummary,
    before_after,
    config_differences,
    list_runs,
    pass_key_order,
    read_config,
    read_series,
    run_dir,
    run_roots_from_env,
    summarize,
)
from rlax_tasks.evaluation.history import read_history
from rlax_tasks.rundir import storage
from rlax_tasks.rundir.paths import run_paths

MAX_COMPARED = 8  # runs in one compare view (each is read and drawn per plot)
HISTORY_ROWS = 30  # nightly evaluations listed on a run's page (newest first)
_K_RE = re.compile(r"^pass@\d+$")
# ?runs=0/a,0/b or ?runs=0/a&runs=0/b (the runs table's checkboxes)
_Runs = Annotated[list[str] | None, Query()]

_STYLE = """
body{font-family:system-ui,sans-serif;margin:1.2rem;color:#222}
table{border-collapse:collapse;margin-bottom:1rem}
td,th{padding:.3rem .7rem;border-bottom:1px solid #ddd;text-align:left}
.state{font-weight:600}.running{color:#0a7}.finished,.succeeded{color:#36c}
.failed{color:#c33}.stopped,.pending{color:#888}
.up{color:#0a7}.down{color:#c33}
.plots{display:grid;grid-template-columns:repeat(auto-fill,minmax(420px,1fr));gap:1rem}
img{max-width:100%;border:1px solid #eee}
"""


# Links to the Airflow UI have target=_top; inside the UI's sandboxed iframe (no
# allow-top-navigation) a same-origin link of the top page follows them instead.
_SCRIPT = """
document.addEventListener("click", (event) => {
  const link = event.target.closest("a[target=_top]");
  if (!link || window.top === window) return;
  try {
    const top = window.top.document, out = top.createElement("a");
    out.href = link.href;
    top.body.appendChild(out);
    event.preventDefault();
    out.click();
    out.remove();
  } catch (error) {}  // another origin: the browser decides
});
"""


def _page(title: str, body: str, status_code: int = 200) -> HTMLResponse:
    return HTMLResponse(
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{_STYLE}</style><script>{_SCRIPT}</script></head><body>{body}</body></html>",
        status_code=status_code,
    )


def _fmt(value: float | None, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _when(ts: float | None) -> str:
    return "–" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _table(head: Sequence[str], rows: Sequence[Sequence[str]], cls: str = "") -> str:
    """An HTML table of cells that are already HTML."""
    attr = f" class='{cls}'" if cls else ""
    out = [f"<table{attr}><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"]
    out += ["<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows]
    return "".join(out) + "</table>"


def _change(before: float | None, after: float | None) -> str:
    if before is None or after is None:
        return "–"
    delta = after - before
    cls = "up" if delta > 0 else "down" if delta < 0 else ""
    return f"<span class='{cls}'>{delta:+.3f}</span>"


def _before_after_table(numbers: dict[str, Any]) -> str:
    """metric | before (v0) | after (vN) | change, for the pass@k and mean reward measured."""
    before, after = numbers["before"] or {}, numbers["after"] or {}
    if not before and not after:
        return "<p class='before-after'>No held-out evaluation yet.</p>"
    keys = sorted((set(before) | set(after)) - {"version"}, key=pass_key_order)
    head = [
        "metric",
        f"before (v{before['version']})" if before else "before",
        f"after (v{after['version']})" if after else "after",
        "change",
    ]
    rows = [
        [
            html.escape(k),
            _fmt(before.get(k)),
            _fmt(after.get(k)),
            _change(before.get(k), after.get(k)),
        ]
        for k in keys
    ]
    return _table(head, rows, "before-after")


def _history_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "<p>No nightly evaluation yet.</p>"
    keys = sorted({k for r in rows for k in r if _K_RE.match(k)}, key=pass_key_order)
    head = ["date", "version", *map(html.escape, keys), "mean reward"]
    body = []
    for r in reversed(rows[-HISTORY_ROWS:]):
        number = {k: r.get(k) if isinstance(r.get(k), int | float) else None for k in keys}
        reward = r.get("mean_reward") if isinstance(r.get("mean_reward"), int | float) else None
        body.append(
            [
                html.escape(str(r.get("date", "–"))),
                html.escape(str(r.get("version", "–"))),
                *[_fmt(number[k]) for k in keys],
                _fmt(reward),
            ]
        )
    return _table(head, body, "history")


def _value(value: Any) -> str:
    if value is None:
        return "–"
    return html.escape(value if isinstance(value, str) else json.dumps(value))


@dataclasses.dataclass
class _Compared:
    """One run of a compare view."""

    label: str
    summary: RunSummary
    series: RunSeries
    numbers: dict[str, Any]
    config: dict[str, Any] | None


def create_app(
    run_roots: Sequence[str] | None = None,
    *,
    require_auth: bool = False,
    active_window_s: float = ACTIVE_WINDOW_S,
    airflow_ui: str | None = "..",
) -> FastAPI:
    """The dashboard over ``run_roots`` (default: RLAX_RUN_ROOTS, read per request).
    ``require_auth``: every route needs Airflow's session (``_token`` cookie or bearer token),
    for the Airflow api-server. ``airflow_ui``: the Airflow UI's root, relative to the
    dashboard's (".." under /rlax) or absolute; None: no links to DAG runs."""
    dependencies = []
    if require_auth:
        # lazy: the dashboard also runs without Airflow (local development)
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

    def plotted(root: int, run_id: str) -> tuple[RunSummary, RunSeries, dict[str, str]]:
        """The run's summary, its series and why each empty plot is empty."""
        path = resolve(root, run_id)
        summary = summarize(root, roots()[root], run_id, active_window_s)
        series = read_series(path)
        why = empty_reasons(series, read_config(path), summary.state, summary.step)
        return summary, series, why

    def dag_run_link(summary: RunSummary, to_root: str) -> str:
        """The run's DAG run in the Airflow UI (opened in the whole window, not the iframe)."""
        path = summary.dag_run_path
        if path is None or airflow_ui is None:
            return "–"
        base = airflow_ui.rstrip("/")
        href = (
            f"{base}/{path}" if base.startswith("/") or "://" in base else f"{to_root}{base}/{path}"
        )
        return (
            f"<a class='dag-run' href='{html.escape(href)}' target='_top'>"
            f"{html.escape(summary.dag_run_id or '')}</a>"
        )

    # ------------------------------------------------------------------ runs
    @app.get("/api/runs")
    async def runs_json() -> dict:
        runs = await asyncio.to_thread(list_runs, roots(), active_window_s)
        return {"run_roots": roots(), "runs": [r.to_dict() for r in runs]}

    @app.get("/", response_class=HTMLResponse)
    async def index() -> HTMLResponse:
        configured = roots()
        runs = await asyncio.to_thread(list_runs, configured, active_window_s)
        ks = sorted({k for r in runs for k in r.pass_at}, key=pass_key_order)
        head = ["", "run", "state", "step", "reward", *map(html.escape, ks), "updated", "root"]
        head.append("DAG run")
        rows = []
        for r in runs:
            key = html.escape(f"{r.root_index}/{r.run_id}")
            link = f"runs/{r.root_index}/{html.escape(r.run_id)}/"
            rows.append(
                [
                    f"<input type='checkbox' name='runs' value='{key}' "
                    f"aria-label='select {html.escape(r.run_id)}'>",
                    f"<a href='{link}'>{html.escape(r.run_id)}</a>",
                    f"<span class='state {html.escape(r.state)}'>{html.escape(r.state)}</span>",
                    "–" if r.step is None else str(r.step),
                    _fmt(r.reward_mean),
                    *[_fmt(r.pass_at.get(k)) for k in ks],
                    _when(r.updated),
                    html.escape(r.run_root),
                    dag_run_link(r, ""),
                ]
            )
        if not rows:
            body = "<p>No runs yet under " + html.escape(", ".join(configured)) + ".</p>"
        else:
            body = (
                "<form id='compare' action='compare' method='get'>"
                f"{_table(head, rows, 'runs')}"
                "<p><button type='submit' id='compare-button'>Compare selected runs</button> "
                "(tick two or more)</p></form>"
            )
        return _page("RLAX runs", f"<h1>RLAX runs</h1>{body}")

    @app.get("/runs/{root}/{run_id}/", response_class=HTMLResponse)
    async def run_page(root: int, run_id: str) -> HTMLResponse:
        path = resolve(root, run_id)
        (summary, _, empty), numbers, nightly = await asyncio.to_thread(
            lambda: (plotted(root, run_id), before_after(path), read_history(path))
        )
        imgs = "".join(
            f"<figure><img alt='{html.escape(title)}' src='plots/{name}.png'>"
            + (f"<figcaption>{html.escape(why)}</figcaption>" if (why := empty.get(name)) else "")
            + "</figure>"
            for name, (title, _, _) in PLOTS.items()
        )
        state = html.escape(summary.state)
        body = (
            f"<p><a href='../../../'>← all runs</a></p><h1>{html.escape(run_id)}</h1>"
            f"<p><span class='state {state}'>{state}</span> · {html.escape(path)} · "
            f"<a href='series'>series (JSON)</a> · DAG run: {dag_run_link(summary, '../../../')}"
            "</p><h2>Held-out, before and after training</h2>"
            f"{_before_after_table(numbers)}"
            f"<div class='plots'>{imgs}</div>"
            f"<h2>Nightly evaluations</h2>{_history_table(nightly)}"
        )
        return _page(f"RLAX run {run_id}", body)

    @app.get("/runs/{root}/{run_id}/series")
    async def run_series(root: int, run_id: str) -> dict:
        path = resolve(root, run_id)

        def read() -> dict:
            _, series, empty = plotted(root, run_id)
            return {**series.to_dict(), "empty": empty, "before_after": before_after(path)}

        return await asyncio.to_thread(read)

    @app.get("/runs/{root}/{run_id}/plots/{name}.png")
    async def run_plot(root: int, run_id: str, name: str) -> Response:
        if name not in PLOTS:
            raise HTTPException(404, f"unknown plot {name!r}; plots: {', '.join(PLOTS)}")
        _, series, empty = await asyncio.to_thread(plotted, root, run_id)
        png = await asyncio.to_thread(render_png, series, name, empty.get(name, NO_DATA))
        return Response(png, media_type="image/png", headers={"Cache-Control": "no-store"})

    # ------------------------------------------------------------------ compare
    def holds_run(run_root: str, run_id: str) -> bool:
        paths = run_paths(run_dir(run_root, run_id))
        return storage.exists(paths.config) or storage.exists(paths.metrics)

    def selection(values: list[str] | None) -> list[tuple[int, str]]:
        """(root index, run id) of each run named in ``runs`` ("root/run_id" or a run id found
        in the first root that holds it), deduplicated; HTTPException for a bad selection."""
        items = [x.strip() for v in values or [] for x in v.split(",") if x.strip()]
        configured = roots()
        out: list[tuple[int, str]] = []
        for item in items:
            root_text, sep, run_id = item.rpartition("/")
            if sep and not root_text.isdigit():
                raise HTTPException(404, f"{item!r}: name a run as <root index>/<run id>")
            resolve(int(root_text) if sep else 0, run_id)  # a valid root and run id
            candidates = [int(root_text)] if sep else range(len(configured))
            found = [i for i in candidates if holds_run(configured[i], run_id)]
            if not found:
                raise HTTPException(404, f"no run {item!r} under the run roots")
            root = found[0]
            if (root, run_id) not in out:
                out.append((root, run_id))
        if len(out) < 2:
            raise HTTPException(400, "select two or more runs to compare")
        if len(out) > MAX_COMPARED:
            raise HTTPException(400, f"compare at most {MAX_COMPARED} runs, not {len(out)}")
        return out

    def labelled(chosen: list[tuple[int, str]]) -> list[tuple[str, int, str, str]]:
        """(label, root index, run id, run directory): a run is labelled by its id, or by
        root/id where two roots hold the same id."""
        configured = roots()
        ids = [run_id for _, run_id in chosen]
        return [
            (run_id if ids.count(run_id) == 1 else f"{root}/{run_id}", root, run_id,
             run_dir(configured[root], run_id))
            for root, run_id in chosen
        ]  # fmt: skip

    def compared(chosen: list[tuple[int, str]]) -> list[_Compared]:
        configured = roots()
        return [
            _Compared(
                label,
                summarize(root, configured[root], run_id, active_window_s),
                read_series(path),
                before_after(path),
                read_config(path),
            )
            for label, root, run_id, path in labelled(chosen)
        ]

    def pick_k(series: list[RunSeries], k: str | None) -> tuple[str, list[str]]:
        """The pass@k to plot (``k``, else the smallest measured in every run, else in any) and
        every pass@k measured."""
        measured = [set(s.pass_at) for s in series]
        every = sorted(set().union(*measured), key=pass_key_order)
        if k is not None:
            if not _K_RE.match(k):
                raise HTTPException(404, f"k: give pass@<k>, e.g. pass@1, not {k!r}")
            return k, every
        common = sorted(set.intersection(*measured), key=pass_key_order)
        return (common or every or ["pass@1"])[0], every

    def compare_json(runs: list[_Compared], k: str, every: list[str]) -> dict[str, Any]:
        differences = config_differences([r.config for r in runs])
        return {
            "k": k,
            "ks": every,
            "runs": [
                {
                    "label": r.label,
                    **r.summary.to_dict(),
                    "before_after": r.numbers,
                }
                for r in runs
            ],
            "series": {r.label: r.series.to_dict() for r in runs},
            "config_differences": [{"key": key, "values": values} for key, values in differences],
        }

    @app.get("/api/compare")
    async def compare_api(runs: _Runs = None, k: str | None = None) -> dict:
        chosen = await asyncio.to_thread(selection, runs)
        data = await asyncio.to_thread(compared, chosen)
        return compare_json(data, *pick_k([r.series for r in data], k))

    @app.get("/compare", response_class=HTMLResponse)
    async def compare_page(runs: _Runs = None, k: str | None = None) -> Any:
        try:
            chosen = await asyncio.to_thread(selection, runs)
        except HTTPException as e:
            body = f"<p><a href='./'>← all runs</a></p><p>{html.escape(str(e.detail))}</p>"
            return _page("RLAX compare", body, e.status_code)
        data = await asyncio.to_thread(compared, chosen)
        k, every = pick_k([r.series for r in data], k)
        names = ",".join(f"{root}/{run_id}" for root, run_id in chosen)
        query = urllib.parse.urlencode({"runs": names, "k": k})
        rows = []
        for r in data:
            before, after = r.numbers["before"] or {}, r.numbers["after"] or {}
            link = f"runs/{r.summary.root_index}/{html.escape(r.summary.run_id)}/"
            state = html.escape(r.summary.state)
            rows.append(
                [
                    f"<a href='{link}'>{html.escape(r.label)}</a>",
                    f"<span class='state {state}'>{state}</span>",
                    "–" if r.summary.step is None else str(r.summary.step),
                    _fmt(before.get(k)),
                    _fmt(after.get(k)),
                    _change(before.get(k), after.get(k)),
                    dag_run_link(r.summary, ""),
                ]
            )
        esc_k = html.escape(k)
        head = ["run", "state", "step", f"{esc_k} before", f"{esc_k} after", "change", "DAG run"]

        def k_link(key: str) -> str:
            if key == k:
                return html.escape(key)
            href = "compare?" + urllib.parse.urlencode({"runs": names, "k": key})
            return f"<a href='{html.escape(href)}'>{html.escape(key)}</a>"

        switch = " · ".join(map(k_link, every))
        imgs = "".join(
            f"<figure><img alt='{html.escape(title.format(k=k))}' "
            f"src='compare/plots/{name}.png?{html.escape(query)}'></figure>"
            for name, (title, _, _) in COMPARE_PLOTS.items()
        )
        differences = config_differences([r.config for r in data])
        if differences:
            config = _table(
                ["key", *(html.escape(r.label) for r in data)],
                [[html.escape(key), *map(_value, values)] for key, values in differences],
                "config-differences",
            )
        else:
            config = "<p class='config-differences'>The configurations do not differ.</p>"
        body = (
            f"<p><a href='./'>← all runs</a></p><h1>Compare {len(data)} runs</h1>"
            f"{_table(head, rows, 'compared')}"
            f"<p>pass@k shown: {switch or esc_k} · "
            f"<a href='api/compare?{html.escape(query)}'>data (JSON)</a></p>"
            f"<div class='plots'>{imgs}</div>"
            f"<h2>Configuration differences</h2>{config}"
        )
        return _page("RLAX compare", body)

    @app.get("/compare/plots/{name}.png")
    async def compare_plot(name: str, runs: _Runs = None, k: str | None = None) -> Response:
        if name not in COMPARE_PLOTS:
            raise HTTPException(404, f"unknown plot {name!r}; plots: {', '.join(COMPARE_PLOTS)}")
        chosen = await asyncio.to_thread(selection, runs)

        def read() -> dict[str, RunSeries]:
            return {label: read_series(path) for label, _, _, path in labelled(chosen)}

        lines = await asyncio.to_thread(read)
        k, _ = pick_k(list(lines.values()), k)
        png = await asyncio.to_thread(render_compare_png, lines, name, k)
        return Response(png, media_type="image/png", headers={"Cache-Control": "no-store"})

    return app
