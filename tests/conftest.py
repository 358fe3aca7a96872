"""Run-wide fixtures every package's tests may use: the tiny tokenizer, tiny random Llama/Qwen2 models and the
tiny task, built once per run. The builders and texts behind them are importable from ``tests.support``."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings


from prefixcache.model.load import LoadedModel
from prefixcache.task.definition import parse_task
from tests.support.models import lean_tokenizer, make_tokenizer, tiny_loaded
from tests.support.tasks import TASK_YAML, TEXTS

# Under mutation testing (mutmut sets MUTANT_UNDER_TEST in every run it makes) each property test draws the same
# examples in every run, so a mutant is judged by the tests that judged the clean run, not by a new draw.
settings.register_profile("mutation", derandomize=True, database=None)
if "MUTANT_UNDER_TEST" in os.environ:
    settings.load_profile("mutation")


@pytest.fixture(scope="session", params=["transformers", "lean"])
def tokenizer(request, tmp_path_factory):
    """The tiny tokenizer as transformers loads it, and as :mod:`prefixcache.task.tokenizer` reads it from
    its saved files: tests of tokenization and prompts run on both."""
    if request.param == "transformers":
        return make_tokenizer()
    return lean_tokenizer(make_tokenizer(), tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny(request) -> LoadedModel:
    return tiny_loaded(request.param)


@pytest.fixture(scope="session")
def tiny_llama() -> LoadedModel:
    return tiny_loaded("llama")


@pytest.fixture(scope="session")
def task():
    return parse_task(TASK_YAML, "tiny.yaml")


@pytest.fixture
def texts():
    return list(TEXTS)


@pytest.fixture(scope="session")
def tiny_qwen2() -> LoadedModel:
    return tiny_loaded("qwen2")
