"""A real S3 server for the tests: moto's, in a process of its own on loopback."""

from __future__ import annotations

import itertools
import subprocess
import sys
import time
import urllib.request
import uuid
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.blobs import BlobStore
from tests.support.ports import free_port

_buckets = itertools.count(1)


class MotoServer:
    """``python -m moto.server`` on 127.0.0.1:``port``; ``stop()`` and ``start()`` again.

    moto keeps its state in memory: a restart starts empty (no buckets).
    """

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The endpoint URL."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        """The server process's id."""
        assert self._process is not None
        return self._process.pid

    def start(self, timeout: float = 20.0) -> None:
        """Start the server and wait until it answers."""
        self._process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while True:
            if self._process.poll() is not None:
                raise RuntimeError(f"moto_server exited with {self._process.returncode}")
            try:
                with urllib.request.urlopen(f"{self.url}/moto-api/", timeout=1):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto_server did not answer on {self.url}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        """Stop the server (its state goes with it)."""
        if self._process is None:
            return
        self._process.terminate()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._process = None


def new_bucket() -> str:
    """A bucket name no other test of this run uses."""
    return f"jp-test-{next(_buckets)}-{uuid.uuid4().hex[:8]}"


def blob_store(engine: AsyncEngine, url: str, **kwargs: Any) -> BlobStore:
    """A store on the moto server at ``url``, in a bucket of its own (created at first use)."""
    kwargs.setdefault("bucket", new_bucket())
    return BlobStore(
        engine,
        url=url,
        access_key_id="testing",
        secret_access_key="testing",
        **kwargs,
    )
