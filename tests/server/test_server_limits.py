"""Issue 19 ("Server hardening"), items 1 and 4, against the app on a tiny in-process model.

* 1: a task upload is read by libyaml's C parser where PyYAML has it (keeping the duplicate-key refusal, the
  scalar checks and the line numbers), and is capped: its body (``max_task_bytes``, 413, refused before it is
  parsed), its labels and examples (``max_labels``, ``max_examples``, 422, refused before it is validated).
  Timings are not asserted (they would flake); the tests check *what* runs instead.
* 4: the pool's byte budget bounds prefix memory: after six tasks were each used once under a budget that
  holds one and a half prefixes, the prefix tensors still alive fit in the budget (runners keep no prefix
  between passes); and ``max_tasks`` caps how many tasks are registered.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import yaml

from prefixcache.cache.kv import PrefixKV
from prefixcache.cache.pool import PrefixPool
from prefixcache.errors import SettingsError, TaskError
from prefixcache.scheduler.classify import Classifier
from prefixcache.scheduler.extract import Extractor
from prefixcache.server import ServerSettings, create_app
from prefixcache.task import definition as task_module
from prefixcache.task import yaml_source
from prefixcache.task.definition import parse_task

from tests.server.inprocess import client, named
from tests.support.tasks import EXTRACT_YAML, TASK_YAML

TASK = "tiny-tickets"
YAML = {"Content-Type": "application/yaml"}
needs_libyaml = pytest.mark.skipif(not yaml.__with_libyaml__, reason="PyYAML without libyaml has no C loader")


def refuse(what: str):
    def called(*args, **kwargs):
        raise AssertionError(f"{what} ran for an upload that a limit should have refused first")
    return called


# --- item 1: the C loader ---------------------------------------------------------------------------------


@needs_libyaml
def test_a_valid_task_is_read_by_the_c_loader(monkeypatch):
    assert issubclass(yaml_source.FAST_LOADER, yaml.CSafeLoader), yaml_source.FAST_LOADER
    monkeypatch.setattr(yaml_source, "UniqueKeyLoader", refuse("the pure-Python YAML loader"))
    big = TASK_YAML + "example_pool:\n" + "".join(
        f"  - text: \"pool ticket {i}: my invoice is wrong\"\n    label: billing\n" for i in range(2000)
    )
    parsed = parse_task(big, "big.yaml")
    assert len(parsed.example_pool) == 2000 and parsed.labels["account"] == "login, password and profile"


@needs_libyaml
def test_the_c_loader_refuses_duplicate_keys_and_keeps_line_numbers():
    with pytest.raises(yaml.constructor.ConstructorError) as refused:
        yaml_source._compose(yaml_source.FAST_LOADER, TASK_YAML.replace("  technical:", "  billing:"))
    assert "duplicate key 'billing'" in str(refused.value) and refused.value.problem_mark.line + 1 == 5
    root, data = yaml_source._compose(yaml_source.FAST_LOADER, TASK_YAML)
    assert data == yaml.safe_load(TASK_YAML) and yaml_source.line_of(root, ("examples", 1, "label")) == 11


BROKEN = {  # a task file -> what its error must say, read by the C loader or not
    "unknown key (validated on the C loader's nodes)": TASK_YAML.replace("examples:", "colour: red\nexamples:"),
    "bad example label": TASK_YAML.replace("    label: technical", "    label: shipping"),
    "duplicate key": TASK_YAML.replace("  technical:", "  billing:"),
    "lone surrogate escape": TASK_YAML.replace("  account: login", '  "acc\\ud800": login'),
    "integer over the digit limit": TASK_YAML.replace("  account: login, password and profile", "  account: " + "9" * 4400),
    "unclosed quote": TASK_YAML.replace('input_template: "Ticket: {text}"', 'input_template: "Ticket: {text}'),
    "tab indentation": TASK_YAML.replace("  billing: invoices", "\tbilling: invoices"),
}


@needs_libyaml
@pytest.mark.parametrize("text", BROKEN.values(), ids=BROKEN.keys())
def test_errors_read_the_same_with_the_c_loader_as_without(monkeypatch, text):
    """A file the C loader refuses is read again by the pure-Python one, so messages (lines, fields) do not change."""
    with pytest.raises(TaskError) as fast:
        parse_task(text, "broken.yaml")
    monkeypatch.setattr(yaml_source, "FAST_LOADER", None)
    with pytest.raises(TaskError) as pure:
        parse_task(text, "broken.yaml")
    assert str(fast.value) == str(pure.value) and "broken.yaml:" in str(fast.value), str(fast.value)


# --- item 1: caps on uploads ------------------------------------------------------------------------------


def test_an_upload_over_max_task_bytes_is_413_before_it_is_parsed(loaded, task, monkeypatch):
    body = named("big").encode()
    with client(loaded, [task], max_task_bytes=len(body) - 1) as c:
        monkeypatch.setattr(task_module, "compose_and_construct", refuse("the YAML parser"))
        response = c.put("/v1/tasks/big", content=body, headers=YAML)
        assert response.status_code == 413, response.text
        assert f"max_task_bytes={len(body) - 1}" in response.json()["detail"], response.text
        monkeypatch.undo()
        assert c.put("/v1/tasks/big", content=body[:-1], headers=YAML).status_code == 201, "a body at the limit is taken"


def labels_yaml(count: int) -> str:
    return named("many", TASK_YAML).replace("labels:\n", "labels:\n" + "".join(f"  extra_{i}: label {i}\n" for i in range(count)))


def examples_yaml(key: str, count: int) -> str:
    rows = "".join(f"  - text: ticket {i}\n    label: billing\n" for i in range(count))
    if key == "examples":
        return named("many").replace("examples:\n", "examples:\n" + rows, 1)
    return named("many") + "example_pool:\n" + rows


def fields_yaml(count: int) -> str:
    return named("many", EXTRACT_YAML).replace("fields:\n", "fields:\n" + "".join(f"  extra_{i}: field {i}\n" for i in range(count)), 1)


OVER_DEFAULTS = {  # an upload over a default cap -> the limit its 422 must name
    "labels": (labels_yaml(1000), "max_labels=1000"),  # 1,003 labels
    "examples": (examples_yaml("examples", 998), "max_examples=1000"),  # 3 + 998
    "example_pool": (examples_yaml("example_pool", 998), "max_examples=1000"),  # 3 + 998, counted together
    "extract-fields": (fields_yaml(999), "max_labels=1000"),  # 2 + 999
}


def test_too_many_labels_or_examples_are_422_naming_the_limit_before_validation(loaded, task, monkeypatch):
    assert ServerSettings().max_labels == ServerSettings().max_examples == 1000
    with client(loaded, [task]) as c:
        monkeypatch.setattr(task_module, "_task_model", refuse("the task's validation"))
        answers = {what: c.put("/v1/tasks/many", content=text, headers=YAML) for what, (text, _) in OVER_DEFAULTS.items()}
    for what, response in answers.items():
        limit = OVER_DEFAULTS[what][1]
        assert response.status_code == 422 and limit in response.json()["detail"], f"{what}: {response.text[:300]}"


def test_labels_and_examples_at_the_caps_are_taken(loaded, task):
    with client(loaded, [task], max_labels=3, max_examples=3) as c:
        at_caps = c.put("/v1/tasks/many", content=named("many"), headers=YAML)  # 3 labels, 3 examples
        over = {"label": c.put("/v1/tasks/many", content=labels_yaml(1), headers=YAML),
                "example": c.put("/v1/tasks/many", content=examples_yaml("example_pool", 1), headers=YAML)}
    assert at_caps.status_code == 201, at_caps.text
    for what, response in over.items():
        assert response.status_code == 422 and "=3" in response.json()["detail"], f"one {what} too many: {response.text}"


# --- item 4: prefix memory and the number of tasks --------------------------------------------------------


def variant(i: int) -> str:
    """A task with its own prefix (the instruction differs); the last one is an extraction task."""
    if i == 5:
        return named(f"t{i}", EXTRACT_YAML).replace("from the support ticket.", "from the support ticket, variant f.")
    return named(f"t{i}").replace("the customer support ticket.", f"the customer support ticket, variant {'abcde'[i]}.")


def live_prefixes() -> list[PrefixKV]:
    """Every live PrefixKV that holds a prefix (the empty prefix of full re-encoding left out)."""
    gc.collect()
    return [obj for obj in gc.get_objects() if type(obj) is PrefixKV and obj.length > 0]


def live_prefix_bytes(old: dict[int, weakref.ref]) -> tuple[int, int]:
    """(bytes of the distinct key/value storages of the live prefixes not in ``old``, how many such prefixes).

    ``old`` (id -> weak reference) are the prefixes alive before the test's app started: FastAPI caches route
    functions process-wide, so the apps of earlier tests stay alive with their pools.
    """
    storages, count = {}, 0
    for prefix in live_prefixes():
        if id(prefix) in old and old[id(prefix)]() is prefix:
            continue
        count += 1
        for tensor in (*prefix.keys, *prefix.values):
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values()), count


def test_live_prefix_bytes_stay_within_the_budget_after_six_tasks(loaded):
    """Six tasks, each used once, under a budget of one and a half prefixes: what is alive fits in the budget.
    (Before, every runner kept its last lookup, prefix included: all six prefixes, 2.8x the budget, stayed alive.)"""
    tasks = [parse_task(variant(i), f"v{i}.yaml", kinds=("classify", "extract")) for i in range(6)]
    bound = [(Extractor if i == 5 else Classifier)(loaded, t) for i, t in enumerate(tasks)]
    sizes = [PrefixPool().size_of(loaded, len(b.prompt.prefix_ids)) for b in bound]
    assert len({tuple(b.prompt.prefix_ids) for b in bound}) == 6, "the six prefixes must differ"
    del bound
    budget = int(1.5 * max(sizes))
    old = {id(prefix): weakref.ref(prefix) for prefix in live_prefixes()}
    with client(loaded, [], cache_budget_bytes=budget) as c:
        for i, t in enumerate(tasks):
            assert c.put(f"/v1/tasks/{t.name}", content=variant(i), headers=YAML).status_code == 201
            route = "/v1/extract" if i == 5 else "/v1/classify"
            assert c.post(route, json={"task": t.name, "items": ["refund me"]}).status_code == 200
        alive, prefixes = live_prefix_bytes(old)
        stats = c.app.state.service.pool.stats()
    assert stats.evictions >= 4, f"the budget must have evicted most prefixes for this test to mean anything: {stats}"
    assert alive <= budget, (
        f"{prefixes} prefixes ({alive} bytes, {alive / budget:.1f}x the budget of {budget}) are alive with nothing in "
        f"flight; the pool holds {stats.entries} ({stats.bytes_held} bytes): something keeps evicted prefixes"
    )


def test_max_tasks_caps_new_tasks_but_not_replacements(loaded, task):
    with client(loaded, [task], max_tasks=2) as c:
        assert c.put("/v1/tasks/second", content=named("second"), headers=YAML).status_code == 201
        refused = c.put("/v1/tasks/third", content=named("third"), headers=YAML)
        replaced = c.put("/v1/tasks/second", content=named("second"), headers=YAML)
        names = [t["name"] for t in c.get("/v1/tasks").json()["tasks"]]
        assert c.delete("/v1/tasks/second").status_code == 204
        after_delete = c.put("/v1/tasks/third", content=named("third"), headers=YAML)
    assert refused.status_code == 422 and "max_tasks=2" in refused.json()["detail"], refused.text
    assert replaced.status_code == 200 and names == ["second", TASK], (replaced.text, names)
    assert after_delete.status_code == 201, after_delete.text


def test_more_start_up_tasks_than_max_tasks_do_not_start(loaded, task):
    other = parse_task(named("other"), "other.yaml")
    with pytest.raises(SettingsError, match="max_tasks=1"):
        create_app(loaded, [task, other], ServerSettings(max_tasks=1, api_key=None))
