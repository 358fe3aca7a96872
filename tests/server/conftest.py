"""The server tests' model: the run's tiny Llama (tests/conftest.py), shared, never rebuilt per module.
Serving does not change a model, so one instance serves every server test."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def loaded(tiny_llama):
    return tiny_llama
