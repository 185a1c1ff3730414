"""The RLAX Airflow plugin: the dashboard app at /rlax and an "RLAX" UI entry embedding it (an
iframe at /plugin/rlax), behind the Airflow session like the rest of the UI. Run roots come from
``RLAX_RUN_ROOTS`` (comma-separated local directories or gs:// URIs, default "runs");
``RLAX_DASHBOARD_AUTH=0`` serves it without Airflow authentication (local development only)."""

from __future__ import annotations

import os
import sys

from airflow.plugins_manager import AirflowPlugin

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # Airflow puts the plugins folder on sys.path; tests may not
    sys.path.append(_HERE)

from rlax_dashboard import create_app  # noqa: E402

URL_PREFIX = "/rlax"


def _auth_required() -> bool:
    return os.environ.get("RLAX_DASHBOARD_AUTH", "1").strip().lower() not in ("0", "false", "no")


class RlaxPlugin(AirflowPlugin):
    """Registers the dashboard FastAPI app and its navigation entry."""

    name = "rlax"
    fastapi_apps = [
        {
            # links to DAG runs: the UI's root is ".." of the dashboard's (mounted at /rlax)
            "app": create_app(require_auth=_auth_required(), airflow_ui=".."),
            "url_prefix": URL_PREFIX,
            "name": "RLAX dashboard",
        }
    ]
    external_views = [
        {
            "name": "RLAX",
            "href": URL_PREFIX.lstrip("/") + "/",  # relative to the UI's base URL
            "url_route": "rlax",
            "destination": "nav",
            "nav_top_level": True,
        }
    ]
