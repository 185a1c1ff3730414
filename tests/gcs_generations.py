"""GCS's generation preconditions and headers, which the gcp-storage-emulator lacks, added to it.

Real GCS honours ``ifGenerationMatch`` / ``ifGenerationNotMatch`` / ``ifMetagenerationMatch`` /
``ifMetagenerationNotMatch`` on reads and writes (412 when a write's or a ``*Match`` read's
condition fails, 304 when a ``*NotMatch`` read's does), and names the object's generation in
``x-goog-generation`` on every read. TensorStore's OCDBT commits (Orbax's checkpoints) re-read
their manifest with ``ifGenerationNotMatch`` and create it with ``ifGenerationMatch=0``;
``storage.commit_pointer`` is a compare-and-swap on ``ifGenerationMatch``. Without this layer
an emulated conditional re-read returns the manifest with no generation and the checkpoint
fails ("Malformed StorageGeneration", now and then, when two OCDBT commits overlap), and a stale
compare-and-swap succeeds.

``install()`` wraps the emulator's handlers once per process; ``gcs_emulator`` calls it. A
precondition check and the request it guards run under one lock, as GCS serialises the writes
of one object. A resumable upload's preconditions are checked when the upload is opened (GCS
checks them again when it finishes).
"""

from __future__ import annotations

import threading
from http import HTTPStatus
from typing import Any

_lock = threading.RLock()
_installed = False
# query parameter -> the object field it compares
_CONDITIONS = {
    "ifGenerationMatch": "generation",
    "ifGenerationNotMatch": "generation",
    "ifMetagenerationMatch": "metageneration",
    "ifMetagenerationNotMatch": "metageneration",
}


def install() -> None:
    """Wraps every object handler of the emulator's routes (idempotent)."""
    global _installed
    from gcp_storage_emulator import server

    with _lock:
        if _installed:
            return
        for _, handlers in server.HANDLERS:
            for method, handler in list(handlers.items()):
                handlers[method] = _conditional(handler)
        _installed = True


def _target(request: Any) -> tuple[str, str] | None:
    """(bucket, object name) the request reads or writes; None when it names no one object."""
    params = request.params or {}
    bucket = params.get("bucket_name")
    if bucket is None:
        return None
    if "object_id" in params and "dest_object_id" not in params:
        return bucket, params["object_id"]
    if request.method != "POST" or "upload_id" in request.query:
        return None  # a listing, or the later chunks of a resumable upload
    if "name" in request.query:
        return bucket, request.query["name"][0]
    upload = request.query.get("uploadType", [""])[0]
    data = request.data
    if upload == "multipart" and isinstance(data, dict):
        return bucket, data["meta"].get("name")
    if upload == "resumable" and isinstance(data, dict):
        return bucket, data.get("name")
    return None


def _current(storage: Any, bucket: str, name: str) -> dict[str, Any] | None:
    from gcp_storage_emulator.exceptions import NotFound

    try:
        return storage.get_file_obj(bucket, name)
    except NotFound:
        return None


def _failed_condition(query: dict[str, list[str]], obj: dict[str, Any] | None) -> str | None:
    """The first precondition in ``query`` that ``obj`` (None: no live object) does not meet."""
    for param, field in _CONDITIONS.items():
        if param not in query:
            continue
        want = int(query[param][0])
        have = int(obj[field]) if obj is not None else None
        if param.endswith("NotMatch"):
            # 0: "some live version exists"; n: "the live version is not n"
            holds = have is not None and (want == 0 or have != want)
        else:
            # 0: "no live version exists"; n: "the live version is n"
            holds = have is None if want == 0 else have == want
        if not holds:
            return param
    return None


def _conditional(handler: Any) -> Any:
    def run(request: Any, response: Any, storage: Any) -> Any:
        target = _target(request)
        if target is None or target[1] is None:
            return handler(request, response, storage)
        reading = request.method == "GET"
        with _lock:
            obj = _current(storage, *target)
            failed = _failed_condition(request.query, obj)
            if failed is not None and not (reading and obj is None):  # a missing read is a 404
                if reading and failed.endswith("NotMatch"):
                    response.status = HTTPStatus.NOT_MODIFIED
                    _name_generation(response, obj)
                else:
                    response.status = HTTPStatus.PRECONDITION_FAILED
                    response.json({"error": {"code": 412, "message": f"{failed} failed"}})
                return None
            out = handler(request, response, storage)
            if reading and response.status in (HTTPStatus.OK, HTTPStatus.PARTIAL_CONTENT):
                _name_generation(response, obj)
            return out

    return run


def _name_generation(response: Any, obj: dict[str, Any] | None) -> None:
    if obj is not None:
        response["x-goog-generation"] = str(obj["generation"])
        response["x-goog-metageneration"] = str(obj["metageneration"])
