"""Starts `strata serve` on a fixture model for the SDK tests."""
import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "fixtures" / "qwen3_5-tiny-a"
BINARY = Path(os.environ.get("STRATA_BIN", ROOT / "target" / "debug" / "strata"))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(*extra, fixture=FIXTURE):
    port = free_port()
    # The log goes to a file: a pipe nobody reads fills up, and then every server thread that
    # logs blocks on it.
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen([str(BINARY), "serve", "--model", str(fixture), "--port", str(port), *extra],
                            stdout=subprocess.DEVNULL, stderr=log)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            return proc, url
        except OSError:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError("strata serve exited: " + log.read().decode())
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("strata serve did not come up")


@pytest.fixture(scope="session")
def server():
    proc, url = start()
    yield url
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="session")
def keyed_server():
    proc, url = start("--api-key", "sekrit")
    yield url
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="session")
def reference():
    return json.loads((FIXTURE / "reference.json").read_text())
