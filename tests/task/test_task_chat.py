"""Whole prompts from chat messages or completion prompts (``task/chat.py``): the reusable part is a token
prefix of the whole prompt, it is the same for every request that differs only in its last message, and a
choice's tokens are exactly what follows the prompt."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from prefixcache.errors import RequestFieldError
from prefixcache.task.chat import BLOCK, EarlierMessages, chat_prompt, choices_after, text_prompt

words = st.lists(st.sampled_from(["refund", "crash", "login", "the", "app", "I", "was", "charged", "twice", "!", "?", "é", "日本", " "]),
                 min_size=1, max_size=12).map(" ".join)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(system=words, shots=st.lists(st.tuples(words, words), max_size=3), last_a=words, last_b=words)
def test_the_reusable_part_is_shared_by_requests_that_differ_only_in_the_last_message(tokenizer, system, shots, last_a, last_b):
    head = [{"role": "system", "content": system}]
    for user, assistant in shots:
        head += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    earlier = EarlierMessages()  # the second and third prompts reuse the head's tokens (the third from its restart point)
    a = chat_prompt(tokenizer, head + [{"role": "user", "content": last_a}], earlier)
    b = chat_prompt(tokenizer, head + [{"role": "user", "content": last_b}], earlier)
    again = chat_prompt(tokenizer, head + [{"role": "user", "content": last_a + " again"}], earlier)
    for prompt, last in ((a, last_a), (b, last_b), (again, last_a + " again")):
        whole = tokenizer(tokenizer.apply_chat_template(head + [{"role": "user", "content": last}], tokenize=False,
                                                        add_generation_prompt=True), add_special_tokens=False)["input_ids"]
        assert list(prompt.ids) == whole, "ids are exactly what full re-encoding feeds"
        choices = choices_after(tokenizer, prompt, ["billing", "account"], "guided_choice")
        for choice, ids in choices.label_ids.items():
            assert tuple(tokenizer(prompt.text + choice, add_special_tokens=False)["input_ids"]) == prompt.ids + ids
    earlier = tokenizer(tokenizer.apply_chat_template(head, tokenize=False), add_special_tokens=False)["input_ids"]
    assert a.reusable == b.reusable == len(earlier) and a.ids[: a.reusable] == b.ids[: b.reusable] == tuple(earlier)
    assert 0 < a.reusable < len(a.ids)


@given(st.integers(1, 200))
def test_a_block_boundary_leaves_at_least_one_token(length):
    from prefixcache.task.chat import _block_boundary

    cut = _block_boundary(length)
    assert cut % BLOCK == 0 and 0 <= cut < length and length - cut <= BLOCK


def test_a_one_message_chat_reuses_whole_blocks(tokenizer):
    prompt = chat_prompt(tokenizer, [{"role": "user", "content": "refund the app charge " * 20}])
    assert prompt.reusable % BLOCK == 0 and len(prompt.ids) - BLOCK <= prompt.reusable < len(prompt.ids)


def test_choices_are_the_tokens_that_follow_the_prompt(tokenizer):
    prompt = chat_prompt(tokenizer, [{"role": "user", "content": "I was charged twice"}])
    choices = choices_after(tokenizer, prompt, ["billing", "technical", "account"], "guided_choice")
    for choice, ids in choices.label_ids.items():
        whole = tokenizer(prompt.text + choice, add_special_tokens=False)["input_ids"]
        assert tuple(whole) == prompt.ids + ids


def test_bad_choices_and_prompts_name_the_field(tokenizer):
    prompt = text_prompt(tokenizer, "Ticket: refun")
    with pytest.raises(RequestFieldError) as caught:
        choices_after(tokenizer, prompt, ["d", "x"], "guided_choice")  # "refun" + "d" merge into one token
    assert caught.value.param.startswith("guided_choice[")
    with pytest.raises(RequestFieldError) as caught:
        choices_after(tokenizer, prompt, ["a", "a"], "guided_choice")
    assert caught.value.param == "guided_choice"
    with pytest.raises(RequestFieldError) as caught:
        text_prompt(tokenizer, [1, 2, len(tokenizer)])
    assert caught.value.param == "prompt[2]"
