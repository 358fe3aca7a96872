"""Restarting tokenization after the prefix's last added token (prefixcache.task.restart) is exact.

Invariant 3 rests on each record's tokens being exactly ``tokenize(prefix_text + suffix)``; the
restart skips re-tokenizing the prefix, so it must give those very ids for any suffix, and must
refuse a place where an added token could reach across.
"""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.task.prompt import build_prompt
from prefixcache.task.restart import Restart, tokenize_prompts

# Record text that probes the cut: ordinary text, whitespace, non-ASCII, and pieces of ChatML markup.
MARKUP = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_", "im_end|>", "|>", "<", "user", "assistant", "\n", " ", "  ", "\t"]
suffixes = st.lists(st.one_of(st.text(max_size=12), st.sampled_from(MARKUP)), max_size=8).map("".join)


def whole(tokenizer, prefix_text: str, suffix: str) -> tuple[int, ...]:
    return tuple(tokenizer(prefix_text + suffix, add_special_tokens=False)["input_ids"])


@pytest.fixture(scope="module")
def prompt(tokenizer, task):
    return build_prompt(task, tokenizer)


def test_the_prompt_restarts_after_its_last_added_token(prompt):
    assert prompt.restart is not None
    cut = prompt.restart.cut
    assert prompt.prefix_text[:cut].endswith("<|im_start|>"), "the last added token of a ChatML prompt"
    assert "<|" not in prompt.prefix_text[cut:]


@settings(max_examples=300, deadline=None)
@given(suffix=suffixes)
def test_restarted_tokens_equal_the_whole_prompts(tokenizer, prompt, suffix):
    (ids,) = tokenize_prompts(tokenizer, prompt.prefix_text, prompt.restart, [suffix])
    assert ids == whole(tokenizer, prompt.prefix_text, suffix)


@settings(max_examples=50, deadline=None)
@given(batch=st.lists(suffixes, min_size=1, max_size=6))
def test_encode_gives_the_whole_prompts_ids_and_checks_the_boundary(tokenizer, prompt, batch):
    n = len(prompt.prefix_ids)
    for text, encoded in zip(batch, prompt.encode(tokenizer, batch)):
        expected = whole(tokenizer, prompt.prefix_text, text)
        assert encoded.full_ids == expected
        assert encoded.suffix_ids == (expected[n:] if expected[:n] == prompt.prefix_ids else None)


def test_an_added_token_that_could_reach_across_is_refused(tokenizer, prompt):
    """With an added token starting where the restart would be and running into the record, no cut is safe
    there; encoding stays exact, and the refused cut would really have been wrong."""
    reaching = copy.deepcopy(tokenizer)
    reaching.add_tokens(["<|im_start|>user\nTicket: URGENT"], special_tokens=True)
    text = "URGENT: the app crashes"
    restart = Restart.find(reaching, prompt.prefix_text)
    assert restart is None or restart.cut < prompt.restart.cut
    (ids,) = tokenize_prompts(reaching, prompt.prefix_text, restart, [text])
    assert ids == whole(reaching, prompt.prefix_text, text)
    unsafe = Restart(prompt.restart.cut, whole(reaching, prompt.prefix_text[: prompt.restart.cut], ""))
    assert unsafe.tokenize(reaching, prompt.prefix_text, [text])[0] != ids, "the refused cut must matter"


def test_no_restart_without_a_fast_tokenizer_or_an_added_token(tokenizer):
    class Slow:  # no backend_tokenizer: a Python tokenizer
        def __call__(self, texts, add_special_tokens=False):
            return {"input_ids": [[ord(c) for c in t] for t in texts]}

    assert Restart.find(Slow(), "<|im_start|>user\n") is None
    assert Restart.find(tokenizer, "no added token here: ") is None
    assert tokenize_prompts(Slow(), "ab", None, ["c"]) == [(97, 98, 99)]


def test_a_word_boundary_token_disables_restarts(tokenizer, prompt):
    from tokenizers import AddedToken

    worded = copy.deepcopy(tokenizer)
    worded.add_tokens([AddedToken("Ticket", single_word=True)])
    assert Restart.find(worded, prompt.prefix_text) is None


@pytest.mark.embedded
@pytest.mark.parametrize("name", ["support-tickets", "natcs-intents", "tickets-compact", "ticket-fields"])
def test_bundled_tasks_restart_exactly_on_the_embedded_tokenizer(name):

    from prefixcache.model.load import load_model_tokenizer
    from prefixcache.task.definition import load_any_task

    tokenizer = load_model_tokenizer("smollm2-135m")
    task = load_any_task(name)
    if name == "ticket-fields":
        from prefixcache.task.extract_prompt import build_extract_prompt

        prompt = build_extract_prompt(task, tokenizer)
    else:
        prompt = build_prompt(task, tokenizer)
    assert prompt.restart is not None and len(prompt.prefix_text) - prompt.restart.cut < 40

    @settings(max_examples=150, deadline=None)
    @given(suffix=suffixes)
    def exact(suffix):
        (ids,) = tokenize_prompts(tokenizer, prompt.prefix_text, prompt.restart, [suffix])
        assert ids == whole(tokenizer, prompt.prefix_text, suffix)

    exact()


@pytest.fixture(scope="module", params=["transformers", "lean"])
def nfc(request, tmp_path_factory):
    """The tiny tokenizer with an NFC normalizer (as Qwen's has), and the task's prompt for it; as
    transformers loads it and as prefixcache's own loader reads it from its saved files."""
    from tokenizers import normalizers

    from tests.support.models import lean_tokenizer, make_tokenizer

    from tests.support.tasks import TASK_YAML
    from prefixcache.task.definition import parse_task

    tokenizer = make_tokenizer()
    tokenizer.backend_tokenizer.normalizer = normalizers.NFC()
    if request.param == "lean":
        tokenizer = lean_tokenizer(tokenizer, tmp_path_factory.mktemp("nfc"))
    return tokenizer, build_prompt(parse_task(TASK_YAML, "tiny.yaml"), tokenizer)


COMBINING = ["e\u0301", "\u0301", "caf\u00e9", "\u212b", "\ufb01", " ", "\n", "A", "<|im_end|>", "<|im_"]


@settings(max_examples=200, deadline=None)
@given(suffix=st.lists(st.sampled_from(COMBINING), max_size=6).map("".join))
def test_a_normalizing_tokenizer_restarts_exactly(nfc, suffix):
    """Combining marks and compatibility characters in the record still give the whole prompt's ids:
    normalization runs per piece, after the added-token split."""
    tokenizer, prompt = nfc
    assert prompt.restart is not None
    (ids,) = tokenize_prompts(tokenizer, prompt.prefix_text, prompt.restart, [suffix])
    assert ids == whole(tokenizer, prompt.prefix_text, suffix)
