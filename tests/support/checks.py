"""Checks shared by the scheduler and task tests."""

from __future__ import annotations


def assert_cached_path_ran(classifier, records, predictions, stats) -> None:
    """Check that a cached/batched run fed each record after the stored prefix, unless its tokens really
    cross the boundary: which records cross is decided here by tokenizing each whole prompt (not by
    ``Prompt.encode`` or the runner), and ``stats.tokens_computed`` must be exactly the suffix tokens of
    the records that do not cross plus the whole prompts of those that do."""
    prompt, tokenizer = classifier.prompt, classifier.loaded.tokenizer
    prefix, n = prompt.prefix_ids, len(prompt.prefix_ids)
    crossing, expected_tokens = set(), 0
    for record in records:
        ids = tuple(tokenizer(prompt.full_text(record.fields, record.id), add_special_tokens=False)["input_ids"])
        if ids[:n] == prefix:
            expected_tokens += len(ids) - n
        else:
            crossing.add(record.id)
            expected_tokens += len(ids)
    fell_back = {p.id for p in predictions if p.boundary_fallback}
    assert fell_back == crossing, (
        f"records {sorted(fell_back, key=str)} fell back to full re-encoding, "
        f"but only {sorted(crossing, key=str)} cross the prefix boundary"
    )
    assert stats.boundary_fallbacks == len(crossing), (
        f"stats count {stats.boundary_fallbacks} boundary fallbacks, expected {len(crossing)}"
    )
    assert stats.tokens_computed == expected_tokens, (
        f"the run computed {stats.tokens_computed} tokens, but the records' suffixes "
        f"(whole prompts where they cross) have {expected_tokens}"
    )
