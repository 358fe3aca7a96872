"""Invariant 3 (checked boundary) and label tokenization."""

from __future__ import annotations

import json

import pytest

from prefixcache.errors import LabelCollisionError, PromptError
from prefixcache.task.prompt import build_prompt, token_encoder
from prefixcache.scheduler.classify import Classifier, Record, RunConfig, RunStats, records_from_texts
from prefixcache.task.definition import parse_task
from prefixcache.eval.verify import compare

from tests.support.checks import assert_cached_path_ran
from tests.support.tasks import TASK_YAML


def _task(**changes) -> object:
    text = TASK_YAML
    for old, new in changes.items():
        text = text.replace(old, new)
    return parse_task(text, "t.yaml")


def test_trailing_space_prefix_is_healed_and_matches_full(tiny_llama, texts):
    """A prefix ending in 'Ticket: ' would split ' word' tokens; healing moves the space into the suffix."""
    task = _task()
    prompt = build_prompt(task, tiny_llama.tokenizer)
    assert prompt.prefix_text.endswith("Ticket: ")
    raw = tuple(tiny_llama.tokenizer(prompt.prefix_text, add_special_tokens=False)["input_ids"])
    assert prompt.heal >= 1, "the trailing space should have forced healing"
    assert prompt.prefix_ids == raw[: len(raw) - prompt.heal]
    for text in texts:
        full = tuple(tiny_llama.tokenizer(prompt.full_text({"text": text}), add_special_tokens=False)["input_ids"])
        encoded = prompt.encode(tiny_llama.tokenizer, [prompt.suffix_text({"text": text})])[0]
        assert encoded.suffix_ids is not None, f"record {text!r} broke the healed boundary"
        assert prompt.prefix_ids + encoded.suffix_ids == full, "cached tokens differ from full re-encoding"
    classifier = Classifier(tiny_llama, task)
    records = records_from_texts(texts)
    stats = RunStats()
    candidate = classifier.classify_all(records, RunConfig("batched", 4), stats=stats)
    assert not any(p.boundary_fallback for p in candidate), "a record of the healed prompt fell back to full"
    assert_cached_path_ran(classifier, records, candidate, stats)
    agreement = compare(classifier.classify_all(records, RunConfig("full", 1)), candidate)
    assert agreement.ok and agreement.max_abs_logprob_diff < 1e-4, f"cached differs from full: {agreement}"


def test_unhealed_split_would_differ(tiny_llama):
    """Guard the guard: without healing, prefix + suffix tokens would NOT equal the full tokenization."""
    prompt = build_prompt(_task(), tiny_llama.tokenizer)
    tok = tiny_llama.tokenizer
    raw = tok(prompt.prefix_text, add_special_tokens=False)["input_ids"]
    suffix = tok(prompt.suffix_text({"text": "refund my money"}), add_special_tokens=False)["input_ids"]
    full = tok(prompt.full_text({"text": "refund my money"}), add_special_tokens=False)["input_ids"]
    assert raw + suffix != full


def test_record_breaking_the_boundary_falls_back_to_full(tiny_llama):
    task = _task()
    classifier = Classifier(tiny_llama, task)
    # Pretend the stored prefix ends with a token no record would produce: every record must fall back.
    broken = classifier.prompt.prefix_ids[:-1] + (0,)
    object.__setattr__(classifier.prompt, "prefix_ids", broken)
    predictions = classifier.classify_all(records_from_texts(["refund please", "app crash"]), RunConfig("batched", 2))
    assert all(p.boundary_fallback for p in predictions)
    reference = classifier.classify_all(records_from_texts(["refund please", "app crash"]), RunConfig("full", 1))
    assert [p.label for p in predictions] == [p.label for p in reference]


# "Ticket: pass" ends mid-word for the tiny BPE: " pass" + "word" re-tokenizes as " password", which no
# healing probe foresees, so this record's whole prompt does not start with the stored prefix ids.
CROSSING = {"cross": "word reset mail never arrives", "cross-short": "words"}
PLAIN = {"plain": " reset mail never arrives", "plain-digits": "1234 failed twice"}


def _mid_word_task():
    """The task whose prefix ends in "Ticket: pass", mid-word for the records of ``CROSSING``."""
    return _task(**{'"Ticket: {text}"': '"Ticket: pass{text}"'})


def test_records_in_full_keep_their_flags_and_fallbacks_add_up_over_windows(tiny_llama):
    """A record cut to fit keeps its ``truncated`` flag whichever way it is fed in full (a full-mode run, a
    boundary fallback), and the fallbacks of one-record windows add up."""
    classifier = Classifier(tiny_llama, _mid_word_task())
    long_crossing = Record("cut", {"text": "word " + "refund " * 600})  # past the tiny models' 512-token context
    for mode in ("full", "cached"):
        (cut,) = classifier.classify_all([long_crossing], RunConfig(mode, overflow="truncate"))
        assert cut.truncated and cut.warning and cut.boundary_fallback == (mode == "cached"), mode
    stats = RunStats()
    records = [Record(key, {"text": text}) for key, text in {**CROSSING, **PLAIN}.items()]
    classifier.classify_all(records, RunConfig("cached", window=1), stats=stats)
    assert stats.boundary_fallbacks == len(CROSSING)


@pytest.mark.parametrize("method", ["first-token", "full"])
def test_record_crossing_the_boundary_naturally_falls_back_and_equals_full(tiny_llama, method):
    classifier = Classifier(tiny_llama, _mid_word_task(), method)
    prompt, encode = classifier.prompt, token_encoder(tiny_llama.tokenizer)
    n = len(prompt.prefix_ids)
    for text in CROSSING.values():
        whole = encode(prompt.full_text({"text": text}))
        assert whole[:n] != prompt.prefix_ids, f"{text!r} should merge with the prefix's ' pass' (heal {prompt.heal})"
        spanning = [tiny_llama.tokenizer.decode([t]) for t in whole[n - 1 : n + 2]]
        assert any("password" in piece for piece in spanning), f"no token spans the boundary: {spanning}"
    for text in PLAIN.values():
        whole = encode(prompt.full_text({"text": text}))
        assert whole[:n] == prompt.prefix_ids, f"{text!r} should not cross the boundary"
    suffixes = [prompt.suffix_text({"text": t}) for t in (*CROSSING.values(), *PLAIN.values())]
    assert [e.suffix_ids is None for e in prompt.encode(tiny_llama.tokenizer, suffixes)] == [True, True, False, False]

    records = [Record(key, {"text": text}) for key, text in {**CROSSING, **PLAIN}.items()]
    reference = classifier.classify_all(records, RunConfig("full", 1))
    for mode, batch in (("cached", 1), ("batched", 4)):
        stats = RunStats()
        predictions = classifier.classify_all(records, RunConfig(mode, batch), stats=stats)
        fell_back = {p.id for p in predictions if p.boundary_fallback}
        assert fell_back == set(CROSSING), f"{mode}: expected {sorted(CROSSING)} to fall back, got {sorted(fell_back)}"
        assert stats.boundary_fallbacks == len(CROSSING), f"{mode}: stats count {stats.boundary_fallbacks} fallbacks"
        assert_cached_path_ran(classifier, records, predictions, stats)
        agreement = compare(reference, predictions)
        assert agreement.ok, f"{mode}: labels differ from full re-encoding on {agreement.disagreeing_ids}"
        assert agreement.max_abs_logprob_diff < 1e-4, f"{mode}: log-probs drift by {agreement.max_abs_logprob_diff:.2e}"


def test_first_token_collision_names_both_labels(tokenizer):
    task = parse_task(
        "name: c\ninstruction: x\nlabels: {refund_request: a, refund_status: b, other: c}\n", "c.yaml"
    )
    prompt = build_prompt(task, tokenizer)
    assert prompt.first_token_collision() is not None
    with pytest.raises(LabelCollisionError) as info:
        prompt.resolve_method("first-token")
    assert "refund_request" in str(info.value) and "refund_status" in str(info.value)
    assert prompt.resolve_method("auto") == "full"


def test_full_method_separates_colliding_labels(tiny_llama, texts):
    task = parse_task("name: c\ninstruction: x\nlabels: {refund_request: a, refund_status: b, other: c}\n", "c.yaml")
    classifier = Classifier(tiny_llama, task, "auto")
    assert classifier.method == "full"
    records = records_from_texts(texts)
    stats = RunStats()
    candidate = classifier.classify_all(records, RunConfig("batched", 7), stats=stats)
    assert not any(p.boundary_fallback for p in candidate), "a record fell back to full re-encoding"
    assert_cached_path_ran(classifier, records, candidate, stats)
    agreement = compare(classifier.classify_all(records, RunConfig("full", 1)), candidate)
    assert agreement.ok and agreement.max_abs_logprob_diff < 1e-4, f"cached differs from full: {agreement}"


def test_no_chat_template_is_a_clear_error(task):
    from tests.support.models import make_tokenizer

    tok = make_tokenizer()
    tok.chat_template = None
    with pytest.raises(PromptError, match="chat template"):
        build_prompt(task, tok)


TURNS = ('{% for m in messages %}### {{ m.role | upper }}:\n{{ m.content }}\n\n{% endfor %}'
         '{% if add_generation_prompt %}### ASSISTANT:\n{% endif %}')


def test_a_tasks_chat_template_lays_out_the_prompt_for_a_tokenizer_without_one(tiny_llama, texts, monkeypatch):
    """A base model's tokenizer has no chat template; the task's gives the prompt its turns, and the cached path
    still equals re-encoding every whole prompt."""
    monkeypatch.setattr(tiny_llama.tokenizer, "chat_template", None)
    with pytest.raises(PromptError, match="chat_template:"):
        build_prompt(_task(), tiny_llama.tokenizer)
    task = parse_task(TASK_YAML + f"chat_template: {json.dumps(TURNS)}\n", "t.yaml")
    prompt = build_prompt(task, tiny_llama.tokenizer)
    assert prompt.prefix_text.startswith("### SYSTEM:\nClassify") and "<|im_start|>" not in prompt.prefix_text
    assert prompt.tail_text.endswith("### ASSISTANT:\n")
    classifier = Classifier(tiny_llama, task)
    records, stats = records_from_texts(texts), RunStats()
    candidate = classifier.classify_all(records, RunConfig("batched", 4), stats=stats)
    assert_cached_path_ran(classifier, records, candidate, stats)
    agreement = compare(classifier.classify_all(records, RunConfig("full", 1)), candidate)
    assert agreement.ok and agreement.max_abs_logprob_diff < 1e-4, f"cached differs from full: {agreement}"


def test_a_tasks_chat_template_replaces_the_tokenizers_and_its_failures_name_it(tiny_llama):
    own = build_prompt(_task(), tiny_llama.tokenizer)
    task = parse_task(TASK_YAML + f"chat_template: {json.dumps(TURNS)}\n", "t.yaml")
    assert build_prompt(task, tiny_llama.tokenizer).prefix_ids != own.prefix_ids
    refusing = parse_task(TASK_YAML + "chat_template: \"{{ raise_exception('no system turns here') }}\"\n", "t.yaml")
    with pytest.raises(PromptError, match="the task's chat template cannot render the prompt: no system turns here"):
        build_prompt(refusing, tiny_llama.tokenizer)


def test_template_lead_and_multi_field_templates(tiny_llama):
    task = _task(**{'input_template: "Ticket: {text}"': 'input_template: "Subject: {subject}\\nBody: {text}"'})
    prompt = build_prompt(task, tiny_llama.tokenizer)
    assert prompt.lead == "Subject: "
    suffix = prompt.suffix_text({"subject": "Refund", "text": "charged twice"})
    assert suffix.startswith("Refund\nBody: charged twice")
