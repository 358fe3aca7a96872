"""The OpenAI-compatible API (issue 17), through the official ``openai`` client, unmodified, against a real
uvicorn server on a loopback port with a tiny in-process model.

The oracle is independent of the engine: plain Hugging Face forward passes over the whole prompt
(``model(ids).logits``), a hand-written greedy loop, and the chat template applied by the tokenizer itself.
So "equals full re-encoding" (invariant 1) is checked against code that shares nothing with the cache path,
whatever the pool held before each request: nothing, the same prefix, or a prefix sharing a leading part.
"""

from __future__ import annotations

import json
import math
import threading
import time

import jsonschema
import openai
import pytest
import torch

from prefixcache.server import ServerSettings, ServerThread, create_app
from prefixcache.task.prompt import SENTINEL, input_lead, render_messages


from tests.support.tasks import TEXTS
from tests.server.live import call, metric, metric_samples, model_thread_held

KEY = "openai-test-key"
CHOICES = ["billing", "technical", "account"]
SYSTEM = "You route support tickets. Answer with one word: billing, technical or account. " * 6
FEW_SHOT = [
    {"role": "user", "content": "I was charged twice this month"}, {"role": "assistant", "content": "billing"},
    {"role": "user", "content": "The app crashes on start"}, {"role": "assistant", "content": "technical"},
]
OTHER_SHOT = [{"role": "user", "content": "I cannot reset my password"}, {"role": "assistant", "content": "account"}]
TOL = 1e-4


def chat(ticket: str, shots=FEW_SHOT) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, *shots, {"role": "user", "content": ticket}]


@pytest.fixture(scope="module")
def loaded(tiny_qwen2):
    return tiny_qwen2


@pytest.fixture(scope="module")
def server(loaded, task):
    with ServerThread(create_app(loaded, [task], ServerSettings(api_key=KEY, max_batch=8))) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


# --- the oracle: whole prompts through plain Hugging Face forward passes ------------------------------------------


def prompt_ids(loaded, messages) -> list[int]:
    text = loaded.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return loaded.tokenizer(text, add_special_tokens=False)["input_ids"]


@torch.inference_mode()
def next_logprobs(loaded, ids) -> torch.Tensor:
    return torch.log_softmax(loaded.model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)


def oracle_choice(loaded, messages, choices) -> dict[str, float]:
    """Each choice's label-normalized log-prob: first-token scoring (the choices' first tokens differ)."""
    tok = loaded.tokenizer
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = prompt_ids(loaded, messages)
    firsts = [tok(text + c, add_special_tokens=False)["input_ids"][len(ids)] for c in choices]
    assert len(set(firsts)) == len(firsts), "the oracle assumes first tokens that differ"
    picked = next_logprobs(loaded, ids)[firsts]
    return dict(zip(choices, (picked - torch.logsumexp(picked, 0)).tolist()))


def oracle_greedy(loaded, ids, max_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens after ``ids`` (stopping at the end-of-turn token, which is not returned) and each step's log-probs."""
    eos = loaded.tokenizer.eos_token_id
    out, steps = [], []
    for _ in range(max_tokens):
        logprobs = next_logprobs(loaded, list(ids) + out)
        steps.append(logprobs)
        token = int(logprobs.argmax())
        if token == eos:
            break
        out.append(token)
    return out, steps


def reusable_tokens(loaded, messages) -> int:
    earlier = loaded.tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=False)
    return len(loaded.tokenizer(earlier, add_special_tokens=False)["input_ids"])


def assert_choice(response, want: dict[str, float], context: str):
    got = response.choices[0].model_extra["choice_logprobs"]
    assert response.choices[0].message.content == max(want, key=want.get), context
    for label, value in want.items():
        assert abs(got[label] - value) < TOL, f"{context}: {label} {got[label]} != full re-encoding's {value}"
    confidence = response.choices[0].model_extra["confidence"]  # the chosen option's probability among the options
    assert abs(confidence - math.exp(max(got.values()))) < 1e-5, context


# --- guided choice -------------------------------------------------------------------------------------------------


def test_guided_choice_equals_full_reencoding_whatever_the_pool_held(client, loaded, server):
    """Cold (the pool holds only the task's prefix), warm (the same system prompt and shots), and extended (other
    shots after the same system prompt): the choice and every choice's log-prob equal the oracle's."""
    cases = [("cold", chat(TEXTS[0])), ("warm", chat(TEXTS[1])), ("extended", chat(TEXTS[2], OTHER_SHOT))]
    cached = {}
    for name, messages in cases:
        response = client.chat.completions.create(model=loaded.spec, messages=messages, extra_body={"guided_choice": CHOICES})
        assert_choice(response, oracle_choice(loaded, messages, CHOICES), name)
        assert response.usage.prompt_tokens == len(prompt_ids(loaded, messages))
        cached[name] = response.usage.prompt_tokens_details.cached_tokens
    shared_system = reusable_tokens(loaded, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "x"}])
    assert cached["cold"] < reusable_tokens(loaded, cases[0][1]), cached
    assert cached["warm"] == reusable_tokens(loaded, cases[1][1]), "the second request must hit the stored prompt"
    assert shared_system <= cached["extended"] < reusable_tokens(loaded, cases[2][1]), cached


def test_structured_outputs_choice_is_the_same_as_guided_choice(client, loaded):
    messages = chat(TEXTS[3])
    a = client.chat.completions.create(model=loaded.spec, messages=messages, extra_body={"guided_choice": CHOICES})
    b = client.chat.completions.create(model=loaded.spec, messages=messages, extra_body={"structured_outputs": {"choice": CHOICES}})
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.choices[0].model_extra["choice_logprobs"] == pytest.approx(b.choices[0].model_extra["choice_logprobs"], abs=TOL)


def test_guided_choice_answers_what_classify_answers_for_the_same_prompt(client, loaded, server, task):
    """A task file and the same prompt sent as chat messages: same label, same probabilities."""
    for text in TEXTS[:4]:
        messages = render_messages(task)
        messages[-1] = {"role": "user", "content": input_lead(task) + text}
        assert SENTINEL not in json.dumps(messages)
        response = client.chat.completions.create(model=loaded.spec, messages=messages, extra_body={"guided_choice": CHOICES})
        status, _, body = call(server, "POST", "/v1/classify", {"task": task.name, "items": [{"text": text}]},
                               headers={"Authorization": f"Bearer {KEY}"})
        assert status == 200, body
        result = body["results"][0]
        assert response.choices[0].message.content == result["label"], text
        for label, logprob in response.choices[0].model_extra["choice_logprobs"].items():
            assert abs(math.exp(logprob) - result["scores"][label]) < 1e-5, (text, label)


def test_concurrent_guided_choice_requests_share_passes_and_equal_sequential(client, loaded, server):
    messages = [chat(t) for t in TEXTS[:8]]
    sequential = [client.chat.completions.create(model=loaded.spec, messages=m, extra_body={"guided_choice": CHOICES})
                  for m in messages]
    before = metric(metric_samples(server, {"Authorization": f"Bearer {KEY}"}), "prefixcache_batch_size_count", task="openai")
    answers: list = [None] * len(messages)
    barrier = threading.Barrier(len(messages))

    def send(i):
        barrier.wait()
        answers[i] = client.chat.completions.create(model=loaded.spec, messages=messages[i], extra_body={"guided_choice": CHOICES})

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(messages))]
    with model_thread_held(server):  # they queue up, as under load, and meet in the engine loop's next step
        for t in threads:
            t.start()
        for _ in range(3000):  # a bound on a hang, not a timing assertion
            if call(server, "GET", "/v1/stats", headers={"Authorization": f"Bearer {KEY}"})[2]["in_progress"] >= len(messages):
                break
            time.sleep(0.01)
    for t in threads:
        t.join()
    passes = metric(metric_samples(server, {"Authorization": f"Bearer {KEY}"}), "prefixcache_batch_size_count", task="openai") - before
    assert passes < len(messages), f"{len(messages)} concurrent requests took {passes} passes: none were merged"
    for i, (got, want) in enumerate(zip(answers, sequential)):
        assert_choice(got, want.choices[0].model_extra["choice_logprobs"], f"request {i}")


# --- generation ----------------------------------------------------------------------------------------------------


def test_greedy_chat_equals_full_reencoding_whatever_the_pool_held(client, loaded):
    tok = loaded.tokenizer
    for name, messages in [("cold", chat(TEXTS[4], OTHER_SHOT + FEW_SHOT)), ("warm", chat(TEXTS[5], OTHER_SHOT + FEW_SHOT))]:
        response = client.chat.completions.create(model=loaded.spec, messages=messages, max_tokens=12, temperature=0)
        tokens, _ = oracle_greedy(loaded, prompt_ids(loaded, messages), 12)
        assert response.choices[0].message.content == tok.decode(tokens, skip_special_tokens=True), name
        assert response.choices[0].finish_reason == ("length" if len(tokens) == 12 else "stop"), name
        assert response.usage.completion_tokens in (len(tokens), len(tokens) + 1), name  # + the end-of-turn token


def test_chat_logprobs_are_the_models_own(client, loaded):
    messages = chat(TEXTS[6])
    response = client.chat.completions.create(model=loaded.spec, messages=messages, max_tokens=6, temperature=0,
                                              logprobs=True, top_logprobs=3)
    _, steps = oracle_greedy(loaded, prompt_ids(loaded, messages), 6)
    content = response.choices[0].logprobs.content
    assert len(content) == min(6, len(steps))
    for entry, logprobs in zip(content, steps):
        values, ids = logprobs.topk(3)
        assert abs(entry.logprob - float(values[0])) < TOL
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(values.tolist(), abs=TOL)
        assert [t.token for t in entry.top_logprobs] == [loaded.tokenizer.decode([i]) for i in ids.tolist()]


def test_streamed_pieces_add_up_to_the_whole_answer(client, loaded):
    messages = chat(TEXTS[7])
    whole = client.chat.completions.create(model=loaded.spec, messages=messages, max_tokens=16, temperature=0)
    stream = client.chat.completions.create(model=loaded.spec, messages=messages, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(pieces) == whole.choices[0].message.content
    assert sum(1 for p in pieces if p) >= 2, "the answer arrived in one piece: nothing was streamed"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_a_stop_string_cuts_the_answer_streamed_or_not(client, loaded):
    messages = chat(TEXTS[0])
    free = client.chat.completions.create(model=loaded.spec, messages=messages, max_tokens=16, temperature=0).choices[0].message.content
    stop = free[len(free) // 2: len(free) // 2 + 2]
    assert len(stop) == 2 and stop.strip(), f"no usable stop string in {free!r}"
    cut = client.chat.completions.create(model=loaded.spec, messages=messages, max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].message.content == free[: free.index(stop)] and cut.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model=loaded.spec, messages=messages, max_tokens=16, temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == cut.choices[0].message.content


def test_completions_from_text_or_token_ids_equal_full_reencoding(client, loaded):
    text = "Ticket: The invoice shows the wrong amount and I was charged twice for it. Category:"
    ids = loaded.tokenizer(text)["input_ids"]
    tokens, steps = oracle_greedy(loaded, ids, 8)
    for prompt in (text, ids):
        response = client.completions.create(model=loaded.spec, prompt=prompt, max_tokens=8, temperature=0, logprobs=2)
        assert response.choices[0].text == loaded.tokenizer.decode(tokens, skip_special_tokens=True)
        assert response.choices[0].logprobs.token_logprobs == pytest.approx([float(s.max()) for s in steps[: len(tokens)]], abs=TOL)


def test_seeded_sampling_repeats_alone_or_batched(client, loaded):
    messages = chat(TEXTS[1])
    ask = lambda: client.chat.completions.create(model=loaded.spec, messages=messages, max_tokens=10, temperature=1.0,
                                                 seed=7).choices[0].message.content
    first, second = ask(), ask()
    assert first == second
    together: list = [None] * 4
    barrier = threading.Barrier(4)

    def send(i):
        barrier.wait()
        together[i] = ask()

    threads = [threading.Thread(target=send, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == [first] * 4
    other = client.chat.completions.create(model=loaded.spec, messages=messages, max_tokens=10, temperature=1.0, seed=8)
    greedy = client.chat.completions.create(model=loaded.spec, messages=messages, max_tokens=10, temperature=0)
    assert len({first, other.choices[0].message.content, greedy.choices[0].message.content}) >= 2, "sampling changed nothing"


# --- response_format: JSON decoding constraints ---------------------------------------------------------------------

PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
TICKET_SCHEMA = {
    "type": "object",
    "properties": {"category": {"enum": CHOICES}, "urgent": {"type": "boolean"}},
    "required": ["category", "urgent"],
    "additionalProperties": False,
}


def json_schema_format(schema: dict, name: str = "answer") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def test_json_object_and_json_schema_answers_parse_and_validate(client, loaded):
    """A random model's free answer is not JSON; under response_format every answer is, streamed or not."""
    messages = chat(TEXTS[2])
    free = client.chat.completions.create(model=loaded.spec, messages=messages, max_tokens=48, temperature=0)
    with pytest.raises(ValueError):
        json.loads(free.choices[0].message.content)
    answer = client.chat.completions.create(model=loaded.spec, messages=messages, max_tokens=48, temperature=0,
                                            response_format={"type": "json_object"})
    assert isinstance(json.loads(answer.choices[0].message.content), dict)
    for schema in (PERSON_SCHEMA, TICKET_SCHEMA):
        for temperature in (0, 1.0):
            response = client.chat.completions.create(model=loaded.spec, messages=messages, max_tokens=64, temperature=temperature,
                                                      seed=5, response_format=json_schema_format(schema))
            jsonschema.validate(json.loads(response.choices[0].message.content), schema)
    stream = client.chat.completions.create(model=loaded.spec, messages=messages, max_tokens=64, temperature=0, stream=True,
                                            response_format=json_schema_format(PERSON_SCHEMA))
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in stream if c.choices)), PERSON_SCHEMA)


def test_requests_with_different_schemas_at_once_each_follow_their_own(client, loaded):
    """Concurrent requests with the same prompt and settings but two schemas: none may share the other's pass."""
    schemas = [PERSON_SCHEMA, TICKET_SCHEMA] * 3
    answers: list = [None] * len(schemas)
    barrier = threading.Barrier(len(schemas))

    def send(i):
        barrier.wait()
        answers[i] = client.chat.completions.create(model=loaded.spec, messages=chat(TEXTS[3]), max_tokens=64, temperature=0,
                                                    response_format=json_schema_format(schemas[i]))

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(schemas))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for schema, answer in zip(schemas, answers):
        jsonschema.validate(json.loads(answer.choices[0].message.content), schema)


@pytest.mark.parametrize("response_format, param", [
    (json_schema_format({"type": "strin"}), "response_format"),
    (json_schema_format({"type": "object", "required": ["a"], "additionalProperties": False}), "response_format"),
    ({"type": "json_schema"}, "response_format"),
    ({"type": "yaml"}, "response_format.type"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "colour": 1}}, "response_format.json_schema.colour"),
])
def test_a_bad_response_format_is_a_400_naming_it(client, loaded, response_format, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=loaded.spec, messages=chat("hi"), extra_body={"response_format": response_format})
    assert caught.value.body["param"] == param, caught.value.body


# --- refusals, in OpenAI's error shape -----------------------------------------------------------------------------


@pytest.mark.parametrize("extra, param", [
    ({"logit_bias": {"1": 2}}, "logit_bias"),
    ({"n": 2}, "n"),
    ({"max_tokens": 100_000}, "max_tokens"),
    ({"response_format": {"type": "json_object"}, "guided_choice": CHOICES}, "response_format"),
    ({"guided_choice": ["billing"]}, "guided_choice"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"tools": []}, "tools"),
])
def test_an_unsupported_or_bad_field_is_a_400_naming_it(client, loaded, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=loaded.spec, messages=chat("hi"), extra_body=extra)
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == param and caught.value.body["type"] == "invalid_request_error"


def test_wrong_model_bad_key_and_bad_bodies(client, loaded, server):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4o", messages=chat("hi"))
    assert loaded.spec in caught.value.body["message"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert [m.id for m in client.models.list().data] == [loaded.spec]
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    for raw, param in [
        (b'{"model": "tiny-qwen2", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', None),
        (b'{"model": "tiny-qwen2", "messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
        (b'{"model": "tiny-qwen2", "prompt": [1, 2, 999999]}', "prompt[2]"),
    ]:
        path = "/v1/completions" if b'"prompt"' in raw else "/v1/chat/completions"
        status, _, body = call(server, "POST", path, raw=raw, headers=auth)
        assert status == 400 and body["error"]["param"] == param, (raw, body)
