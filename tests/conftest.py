"""Fixtures: this run's template database and vhost; a database per test."""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack

import pytest
import structlog
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane import logs
from jobplane.blobs import BlobStore
from jobplane.logs import configure
from jobplane.store.db import Database
from jobplane.store.engine import create_engine, migrate
from jobplane.store.machine import MACHINE
from jobplane.topology import Topology, load_topology
from tests.support import services
from tests.support.parts import Started
from tests.support.s3 import MotoServer, blob_store
from tests.support.stack import Stack, start_stack

_counter = itertools.count(1)

# Every jobplane process a test starts (they inherit this environment) serves its
# ops listener on a free port of its own, never on a fixed default another
# process may hold.
os.environ.setdefault("JOBPLANE_METRICS_LISTEN", "127.0.0.1:0")


def _mutated_tree_for_children() -> None:
    """Under ``make mutate``, the processes a test starts import the mutated tree.

    mutmut switches a mutant on by ``MUTANT_UNDER_TEST``, which a child process
    inherits, but the child would import the installed package, not the tree
    the test imported: a mutant of code that only runs in a child (the CLI, the
    ``dev`` processes) would survive every test. The child gets the tree first
    on its path.
    """
    if "MUTANT_UNDER_TEST" not in os.environ:
        return
    import jobplane

    tree = os.path.dirname(os.path.dirname(os.path.abspath(jobplane.__file__)))
    paths = [tree, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))


_mutated_tree_for_children()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything outside tests/unit talks to the real services."""
    for item in items:
        if "tests/unit" not in str(item.path):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(autouse=True)
def _logging_as_it_was() -> Iterator[None]:
    """A command run in the test process configures logging (JSON lines, a level,
    job prefixes): the next test gets it back as it was."""
    saved = structlog.get_config(), logs._json_lines, logs._prefixes
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    config, logs._json_lines, logs._prefixes = saved
    structlog.configure(**config)
    for handler in root.handlers[:]:
        if handler not in handlers and handler.get_name() == logs._HANDLER_NAME:
            root.removeHandler(handler)  # configure()'s, not pytest's own
    for handler in handlers:
        if handler not in root.handlers:
            root.addHandler(handler)
    root.setLevel(level)


@pytest.fixture(autouse=True)
def _machine_as_it_was() -> Iterator[None]:
    """A command run in the test process sets the shared state machine's
    lifecycle events from its settings: the next test gets them back."""
    was = MACHINE.lifecycle_events
    yield
    if MACHINE.lifecycle_events != was:
        MACHINE.set_lifecycle_events(was)


@pytest.fixture(scope="session")
def run_id() -> str:
    """Names this run's databases and vhost."""
    configure("warning")
    return services.run_id()


@pytest.fixture(scope="session")
async def template_db(run_id: str) -> AsyncIterator[str]:
    """A database migrated once per run; each test clones it."""
    name = f"jp_{run_id}_tpl"
    await migrate(services.pg_url(name))
    yield name
    await services.drop_database(name)


@pytest.fixture(scope="session")
def amqp_url(run_id: str) -> Iterator[str]:
    """This run's own vhost."""
    vhost = f"jp_{run_id}"
    url = services.create_vhost(vhost)
    yield url
    services.delete_vhost(vhost)


@pytest.fixture(scope="session")
def moto() -> Iterator[MotoServer]:
    """A moto S3 server process on loopback for the run (each test its own bucket)."""
    server = MotoServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def blobs(engine: AsyncEngine, moto: MotoServer) -> AsyncIterator[BlobStore]:
    """A blob store on the run's S3 server, in a bucket of the test's own."""
    store = blob_store(engine, moto.url)
    yield store
    await store.close()


@pytest.fixture
async def database_url(template_db: str, run_id: str) -> AsyncIterator[str]:
    """A fresh, migrated database for one test."""
    name = f"jp_{run_id}_{next(_counter)}"
    await services.create_database(name, template=template_db)
    yield services.pg_url(name)
    await services.drop_database(name)


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    """The test database's engine."""
    engine = create_engine(database_url, pool_size=10)
    yield engine
    await engine.dispose()


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[Database]:
    """The test database's pool of the hot statements (ADR-0030)."""
    db = Database(database_url)
    yield db
    await db.close()


@pytest.fixture
async def topology(amqp_url: str) -> AsyncIterator[Topology]:
    """The default topology under names no other test uses, deleted after the test.

    Quorum queues are Raft groups: a run that kept every test's queues until
    its vhost is deleted would hold thousands of them, and deleting those at
    once can stall the broker for every other run.
    """
    names = load_topology().prefixed(f"t{next(_counter)}.")
    yield names
    await services.delete_topology(amqp_url, names)


@pytest.fixture
async def stack(
    request: pytest.FixtureRequest,
    engine: AsyncEngine,
    database_url: str,
    amqp_url: str,
    topology: Topology,
) -> AsyncIterator[Stack]:
    """Server + relay + worker with the demo handlers.

    A module leaves parts out with ``pytestmark = pytest.mark.stack(worker=False)``
    (or ``relay=False``): the marker's keywords go to :func:`start_stack`.
    """
    marker = request.node.get_closest_marker("stack")
    parts = dict(marker.kwargs) if marker is not None else {}
    running = await start_stack(engine, database_url, amqp_url, topology, **parts)
    yield running
    await running.close()


@pytest.fixture
async def started() -> AsyncIterator[Started]:
    """A factory: ``await started(part)`` starts a part the test made (server,
    worker, relay, sweeper, ``start_stack(...)``, client); each is stopped at the
    test's end, the last started first (:mod:`tests.support.parts`)."""
    async with AsyncExitStack() as stack:
        yield Started(stack)
