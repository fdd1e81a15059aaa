"""Starts both servers for a probe script; prints where they are."""

import atexit
import tempfile
from pathlib import Path

from integration_tests import _object_servers as osv


def start(backend="memory"):
    log_dir = Path(tempfile.mkdtemp(prefix="probe-"))
    s3 = osv.start_s3(log_dir)
    gcs = osv.start_gcs(log_dir, backend=backend)
    atexit.register(s3.stop)
    atexit.register(gcs.stop)
    return s3, gcs
