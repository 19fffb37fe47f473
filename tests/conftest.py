"""Shared fixtures: tiny models made locally (cached across runs), free ports."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="session")
def tiny_mla_dir() -> Path:
    """The tiny random DeepSeek-V2 MLA model (made once, cached under VLLM_DSA_MODEL_DIR or ~/.cache)."""
    from vllm_dsa_connector.tiny_models import make_tiny_mla

    return make_tiny_mla()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def port() -> int:
    return free_port()
