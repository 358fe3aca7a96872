"""Property tests (hypothesis): for any prefix and suffix text, the cached label equals the full label."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache.scheduler.classify import Classifier, RunConfig, RunStats, records_from_texts
from prefixcache.task.definition import Task
from prefixcache.eval.verify import compare

from tests.support.checks import assert_cached_path_ran

# Text with the characters that stress BPE boundaries: spaces, punctuation, digits, accents, CJK, newlines.
ALPHABET = st.sampled_from(list("abcdefghijklmnopqrstuvwxyz ABCXYZ0123456789.,:;!?'\"-_/\n\té日本"))
texts = st.text(ALPHABET, min_size=0, max_size=40)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    instruction=st.text(ALPHABET, min_size=1, max_size=60).filter(lambda s: s.strip()),
    lead=st.text(ALPHABET, max_size=12).map(lambda s: s.replace("{", "").replace("}", "")),
    records=st.lists(texts, min_size=1, max_size=6),
    batch=st.integers(min_value=1, max_value=7),
)
def test_cached_label_equals_full_label(tiny_llama, instruction, lead, records, batch):
    task = Task(
        name="prop",
        instruction=instruction,
        labels={"billing": "money", "technical": "bugs", "account": "access"},
        input_template=lead + "{text}",
    )
    classifier = Classifier(tiny_llama, task, "first-token")
    items = records_from_texts(records)
    reference = classifier.classify_all(items, RunConfig("full", 1))
    stats = RunStats()
    candidate = classifier.classify_all(items, RunConfig("batched", batch), stats=stats)
    agreement = compare(reference, candidate)
    assert agreement.ok, f"labels differ for ids {agreement.disagreeing_ids} (lead={lead!r})"
    drift = agreement.max_abs_logprob_diff
    assert drift < 1e-4, f"log-probs drift by {drift:.2e} (lead={lead!r})"
    # the cached path really ran: only records whose whole prompt crosses the prefix boundary fell back
    assert_cached_path_ran(classifier, items, candidate, stats)
