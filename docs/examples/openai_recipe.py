#!/usr/bin/env python3
"""The published recipe's prompt, sent as a vLLM user sends it: the official ``openai`` client and ``guided_choice``.

A system prompt, few-shot turns and one ticket per request, exactly the chat a hand-written classification
loop builds, to ``prefixcache serve``'s OpenAI-compatible route (started here in-process on a loopback
port, with the embedded model). Nothing in the prompt is a ``prefixcache`` task file: the server finds
the shared system prompt and few-shot turns in its prefix pool by itself. Prints each answer, its
per-choice log-probs and ``usage.prompt_tokens_details.cached_tokens``.

    python docs/examples/openai_recipe.py                 # embedded model, float32
    python docs/examples/openai_recipe.py --model PATH    # any chat model folder
"""

from __future__ import annotations

import argparse
import time

SYSTEM = (
    "You are a support-ticket router for a software company. Read the customer's ticket and answer with exactly "
    "one category name, nothing else.\n\nCategories:\n"
    "- billing: invoices, charges, refunds, payment methods, subscriptions and plans\n"
    "- technical: bugs, errors, crashes, slow pages, sync problems and anything that does not work as documented\n"
    "- account: login, passwords, two-factor authentication, profile details, email changes and closing an account\n\n"
    "Answer with exactly one category name: billing, technical, account."
)
SHOTS = [
    ("I was charged twice for my subscription this month, please refund one of the payments.", "billing"),
    ("The mobile app crashes every time I open the settings page on Android 14.", "technical"),
    ("I cannot log in: the password reset email never arrives in my inbox.", "account"),
    ("My invoice shows the annual plan but I am on the monthly one.", "billing"),
    ("Exports to CSV fail with error 500 since yesterday's update.", "technical"),
    ("Please change the email address on my profile to my new work address.", "account"),
]
TICKETS = [
    "Why was my card declined when I tried to upgrade my plan?",
    "The dashboard has been loading forever since this morning.",
    "How do I turn on two-factor authentication for my team?",
]


def messages_for(ticket: str) -> list[dict]:
    chat = [{"role": "system", "content": SYSTEM}]
    for text, label in SHOTS:
        chat += [{"role": "user", "content": text}, {"role": "assistant", "content": label}]
    return chat + [{"role": "user", "content": ticket}]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()

    import openai

    from prefixcache import load_model
    from prefixcache.server import ServerSettings, ServerThread, create_app

    loaded = load_model(args.model, args.dtype)
    with ServerThread(create_app(loaded, [], ServerSettings(api_key="recipe-key"))) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="recipe-key")
        model = client.models.list().data[0].id
        print(f"{'ticket':<62}{'answer':<11}{'prompt':>7}{'cached':>8}{'ms':>7}  log-probs")
        for ticket in TICKETS:
            started = time.perf_counter()
            response = client.chat.completions.create(
                model=model, messages=messages_for(ticket),
                extra_body={"guided_choice": ["billing", "technical", "account"]},  # as it would go to vLLM
            )
            ms = 1000 * (time.perf_counter() - started)
            usage, choice = response.usage, response.choices[0]
            scores = ", ".join(f"{k} {v:.2f}" for k, v in choice.model_extra["choice_logprobs"].items())
            print(f"{ticket:<62}{choice.message.content:<11}{usage.prompt_tokens:>7}"
                  f"{usage.prompt_tokens_details.cached_tokens:>8}{ms:>7.0f}  {scores}")


if __name__ == "__main__":
    main()
