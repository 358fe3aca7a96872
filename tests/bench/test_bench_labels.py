"""bench with labels that share first tokens (issue 16): the many-label lanes on a tiny model.

No timed assertions: the lanes, their agreement with full re-encoding, the memory figures and the
trie's floor arithmetic.
"""

from __future__ import annotations

import csv
import json

import pytest
from typer.testing import CliRunner

from prefixcache.bench.workload import file_records, fitting_records
from prefixcache.cli.app import app
from prefixcache.errors import InputError
from prefixcache.task.definition import parse_task

from tests.support.models import save_tiny_model

TASK = """\
name: shared-first-tokens
instruction: Route the ticket.
labels:
  refund_request: the customer wants money back
  refund_status: the customer asks where a refund is
  refund_denied: the customer's refund was refused
  login_help: the customer cannot log in
examples:
  - text: please refund the extra payment
    label: refund_request
  - text: I cannot log in since yesterday
    label: login_help
input_template: "Ticket: {text}"
"""

TEXTS = [
    ("please refund the extra payment", "refund_request"),  # an example: never a bench record
    ("where is my refund", "refund_status"),
    ("refund it now", "refund_request"),
    ("why was my refund refused", "refund_denied"),
    ("the password reset email never arrives", "login_help"),
    ("I was charged twice", "refund_request"),
    ("my refund has not come", "refund_status"),
    ("they said no to my refund", "refund_denied"),
    ("login fails on the app", "login_help"),
    ("refund my subscription", "refund_request"),
    ("is the refund on its way", "refund_status"),
    ("cannot reset my password", "login_help"),
] + [(f"{words} {n}", label) for n in range(5) for words, label in (
    ("please give my money back", "refund_request"), ("what happened to my refund", "refund_status"),
    ("my refund request was rejected", "refund_denied"), ("I am locked out of my account", "login_help"))]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("labels-bench")
    (folder / "task.yaml").write_text(TASK)
    with open(folder / "rows.csv", "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["text", "category"])
        writer.writerows(TEXTS)
    return folder


def test_file_records_leave_out_the_prompts_examples_and_take_the_gold_label_field(files):
    task = parse_task(TASK, "task.yaml")
    records = file_records(str(files / "rows.csv"), task, 11, "category")
    assert len(records) == 11
    assert "please refund the extra payment" not in {r.fields["text"] for r in records}
    assert all(r.fields["label"] in task.labels and "category" not in r.fields for r in records)
    with pytest.raises(InputError, match="31 rows that are not examples"):
        file_records(str(files / "rows.csv"), task, 32, "category")
    fitting = fitting_records(str(files / "rows.csv"), task, 3, records, "category")
    assert not {r.fields["text"] for r in fitting} & ({r.fields["text"] for r in records} | {"please refund the extra payment"})
    assert sorted(r.fields["label"] for r in fitting) == sorted(list(task.labels) * 3)


@pytest.mark.slow
def test_bench_with_shared_first_tokens_runs_the_many_label_lanes(files, tmp_path_factory):
    model_dir = save_tiny_model(tmp_path_factory, "qwen2")
    out = files / "bench.json"
    args = ["bench", "--model", model_dir, "--task", str(files / "task.yaml"), "--records", str(files / "rows.csv"),
            "--label-field", "category", "--items", "9", "--full-items", "5", "--before-batch-size", "2",
            "--batch-size", "4", "--head", "fit", "--json", str(out)]
    result = CliRunner().invoke(app, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    labels = document["labels"]
    assert [m["mode"] for m in labels["subset_modes"]] == ["full", "batched/per-label", "batched"]
    assert [m["records"] for m in labels["subset_modes"]] == [5, 5, 5]
    assert [m["batch_size"] for m in labels["subset_modes"]] == [1, 2, 4]
    for lane in labels["subset_modes"]:  # both whole-label paths give full re-encoding's labels and log-probs
        assert lane["label_agreement"] == 1.0, lane
        assert lane["max_abs_logprob_diff"] <= 1e-4, lane
        assert lane["disagreements_outside_ties"] == 0, lane
    assert [m["mode"] for m in labels["modes"]] == ["batched", "batched+head"]
    assert all(m["records"] == 9 for m in labels["modes"])
    assert all(0 <= m["gold_accuracy"] <= 1 for m in labels["subset_modes"] + labels["modes"])
    assert "held out of the bench's records" in " ".join(result.output.split())
    for lane in labels["subset_modes"] + labels["modes"]:
        assert lane["peak_rss_bytes"] > 0 and 0 <= lane["added_rss_bytes"] <= lane["peak_rss_bytes"]
    floor = labels["floor"]
    assert floor["labels"] == 4 and floor["fed_nodes"] >= 1
    assert floor["edges"] >= floor["labels"] and floor["label_tokens"] >= floor["edges"]
    assert 0 < floor["ms_without_attention"] < floor["ms"]
    assert "per-label" in result.output and "fed nodes" in result.output
