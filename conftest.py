"""pytest set-up for the whole repository: the tests use every core by default.

pytest-xdist (in the `test` extra) runs the tests in `-n auto` worker
processes, each test module in one worker (`--dist loadscope`), so a module's
expensive fixtures (a sharded save in a subprocess) are made once. Passing
`-n` chooses otherwise: `-n 0` runs everything in this one process, as does
`-p no:xdist`. (`addopts = "-n auto"` in pyproject.toml would break
`-p no:xdist`: pytest then rejects `-n` as an unknown argument.)
"""

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    if (
        config.pluginmanager.hasplugin("xdist")
        and config.option.numprocesses is None
        # xdist's workers read the same conftest; they must not spawn workers.
        and not hasattr(config, "workerinput")
    ):
        config.option.numprocesses = "auto"
        if config.option.dist == "no":
            config.option.dist = "loadscope"


def pytest_collection_modifyitems(config, items):
    """Every integration test is slow (subprocesses, several processes, object
    store servers): `pytest -m "not slow"` leaves them out. Unit tests that
    are slow say so themselves (`@pytest.mark.slow`)."""
    for item in items:
        if item.path.parent.name == "integration_tests":
            item.add_marker(pytest.mark.slow)


# Object stores on loopback (integration_tests/_object_servers.py): one real
# moto_server (S3) and one fake-gcs-server (GCS) per test process, started on
# first use. A server that does not start fails the tests that use it, with
# its log tail; nothing is skipped.


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A running moto_server (an `S3Server`): `.url`, `.env()`, `.create_bucket`."""
    from integration_tests import _object_servers

    server = _object_servers.start_s3(tmp_path_factory.mktemp("s3-server"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    """A running fake-gcs-server (a `GCSServer`), in-memory objects."""
    from integration_tests import _object_servers

    server = _object_servers.start_gcs(tmp_path_factory.mktemp("gcs-server"))
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(s3_server):
    """A new, empty bucket's root URL, "s3://<name>", with the S3 env set."""
    yield from _bucket(s3_server)


@pytest.fixture
def gcs_bucket(gcs_server):
    """A new, empty bucket's root URL, "gs://<name>", with the GCS env set."""
    yield from _bucket(gcs_server)


def _bucket(server):
    """Yields a fresh bucket's URL while `server.env()` is in os.environ.

    Every test gets its own bucket, so tests share a server but no objects.
    s3fs and gcsfs cache filesystem objects (and the endpoint and credentials
    they found) per process; their caches are cleared on entry and exit so
    that this environment is the one they see, and no later test reuses it.
    """
    import uuid

    from integration_tests import _object_servers

    url = server.create_bucket(f"test-{uuid.uuid4().hex[:16]}")
    with _object_servers.environ(server.env()):
        _object_servers.clear_fsspec_caches()
        try:
            yield url
        finally:
            _object_servers.clear_fsspec_caches()
