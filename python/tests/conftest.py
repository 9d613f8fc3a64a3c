import os
import socket

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def port() -> int:
    return free_port()


def flatpipe_bin():
    """The flatpipe binary built by cargo (release first), or None."""
    root = os.path.join(os.path.dirname(__file__), "..", "..", "target")
    for profile in ("release", "debug"):
        path = os.path.abspath(os.path.join(root, profile, "flatpipe"))
        if os.access(path, os.X_OK):
            return path
    return None
