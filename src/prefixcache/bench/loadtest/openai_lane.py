"""The OpenAI-compatible lane of ``prefixcache loadtest --openai``: the official ``openai`` client, unmodified.

Each item becomes the chat a vLLM user would send for it: the task's own system prompt and few-shot turns
(``render_messages``) and the ticket as the last user message, with ``guided_choice`` over the task's labels.
The answers are reshaped as ``/v1/classify`` results (``id``, ``label``, ``scores`` as probabilities) so the
load test checks both lanes against the same sequential reference; each also carries the usage's
``cached_tokens`` and ``prompt_tokens``. ``openai`` is a test extra: imported only when this lane runs.
"""

from __future__ import annotations

import json
import math

from .clients import Send
from .served import HOST


def openai_sender(port: int, key: str, task_path: str) -> Send:
    """A ``send(items) -> (status, body bytes)`` for one client thread (its own ``openai.OpenAI`` client)."""
    import openai

    from ...task.definition import load_task
    from ...task.prompt import input_lead, render_messages

    task = load_task(task_path)
    head, lead, labels = render_messages(task)[:-1], input_lead(task), list(task.labels)
    client = openai.OpenAI(base_url=f"http://{HOST}:{port}/v1", api_key=key, max_retries=0, timeout=300)
    model = client.models.list().data[0].id

    def send(items: list[dict]) -> tuple[int, bytes]:
        results = []
        for item in items:
            messages = head + [{"role": "user", "content": lead + item["text"]}]
            try:
                response = client.chat.completions.create(model=model, messages=messages, extra_body={"guided_choice": labels})
            except openai.APIStatusError as exc:
                return exc.status_code, json.dumps(exc.body).encode()
            except openai.APIConnectionError as exc:
                return 0, str(exc).encode()
            choice = response.choices[0]
            results.append({
                "id": item["id"], "label": choice.message.content,
                "scores": {label: math.exp(lp) for label, lp in choice.model_extra["choice_logprobs"].items()},
                "cached_tokens": response.usage.prompt_tokens_details.cached_tokens,
                "prompt_tokens": response.usage.prompt_tokens,
            })
        return 200, json.dumps({"results": results}).encode()

    return send


def cached_share(outcomes) -> tuple[float, float]:
    """(smallest, mean) share of each answered item's prompt that was reused from the pool."""
    shares = []
    for _, status, data, _ in outcomes:
        if status == 200:
            shares += [r["cached_tokens"] / r["prompt_tokens"] for r in json.loads(data)["results"]]
    return (min(shares), sum(shares) / len(shares)) if shares else (float("nan"), float("nan"))
