"""A gs:// model download logs bytes fetched / total as it goes, and where it put them."""

from __future__ import annotations

import logging
import re

from rlax_tasks.models import model_cache
from rlax_tasks.models.model_cache import local_model_dir
from rlax_tasks.rundir import storage

CHUNK = 256 * 1024


def test_download_logs_bytes_done_rate_and_eta(gcs_bucket, tmp_path, caplog):
    path = storage.join(gcs_bucket, "org", "m")
    storage.write_bytes(storage.join(path, "config.json"), b'{"model_type": "qwen2"}')
    storage.write_bytes(storage.join(path, "model.safetensors"), bytes(4 * CHUNK))
    with caplog.at_level(logging.INFO, logger=model_cache.__name__):
        local = local_model_dir(
            path, str(tmp_path), workers=1, chunk_bytes=CHUNK, progress_every_s=0.0
        )
    prefix = re.escape(f"model cache {path}: ")
    size = r"[\d.]+ (?:B|[KMG]iB)"  # rlax_tasks.utils.byte_sizes.format_bytes
    line = rf"{prefix}{size}/1\.0 MiB \((\d+)%\) {size}/s eta"
    percents = [int(p) for p in re.findall(line, caplog.text)]
    assert len(percents) >= 4 and percents == sorted(percents) and percents[-1] == 100
    assert re.search(rf"{prefix}1\.0 MiB/1\.0 MiB done in \S+ \({size}/s\) -> {local}", caplog.text)
