"""Rebuild the bundled NatCS task data from the shared DSTC11 csv.

Reads ``../shared/datasets/natcs_dstc11_intent_utterances.csv`` (or ``--source``)
and writes, deterministically:

* ``src/prefixcache/datasets/natcs/utterances.csv`` -- the evaluation rows,
  columns ``id,text,label,intent,domain`` (``id`` is the original
  ``utterance_id``), ``PER_LABEL`` rows per coarse label;
* ``src/prefixcache/tasks/natcs-intents.yaml`` -- the task, whose few-shot
  examples are ``EXAMPLES_PER_LABEL`` rows per label that are *not* in the csv.

Selection, in order:

1. strip each utterance and collapse runs of whitespace to one space;
2. drop rows whose intent is not in ``MAPPING`` and the rows in ``MISLABELED``;
3. drop repeated texts (compared lowercased, without punctuation), keeping the
   first in source order;
4. per label, shuffle each intent's rows with ``random.Random(SEED)`` (labels
   and intents visited in sorted order), pick the examples (short, no digits,
   from different intents where the label has several), then fill the
   evaluation set round-robin over the label's intents so small intents are
   represented;
5. shuffle the evaluation rows with the same generator and write them.

Run from the project root: ``python tools/build_natcs.py`` (``--check``
only compares and exits 1 if a file would change). Standard library only.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import random
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT.parent / "shared" / "datasets" / "natcs_dstc11_intent_utterances.csv"
CSV_OUT = ROOT / "src" / "prefixcache" / "datasets" / "natcs" / "utterances.csv"
TASK_OUT = ROOT / "src" / "prefixcache" / "tasks" / "natcs-intents.yaml"

SEED = 20230
PER_LABEL = 100
EXAMPLES_PER_LABEL = 3

#: Fine intent -> coarse label. Intents not listed are dropped.
MAPPING: dict[str, str] = {
    # payment: pay something, or change how and when bills are paid
    "PayBill": "payment",
    "MakeCreditCardPayment": "payment",
    "PayLoan": "payment",
    "SetAutoPayment": "payment",
    "CancelAutomaticBilling": "payment",
    "UpdatePaymentPreference": "payment",
    "UpdateBillingFrequency": "payment",
    "CheckPaymentStatus": "payment",
    # claim: something happened and the customer wants cover for it
    "FileClaim": "claim",
    "ReportAutomobileAccident": "claim",
    # quote: price of a new insurance policy
    "GetQuote": "quote",
    # balance: how much is in an account or owed
    "CheckAccountBalance": "balance",
    "CheckCreditCardBalance": "balance",
    "CheckLoanBalance": "balance",
    # account: open, close or change an account and its sign-in or contact details
    "CreateAccount": "account",
    "OpenAccount": "account",
    "OpenBankingAccount": "account",
    "CloseAccount": "account",
    "CloseBankAccount": "account",
    "AddUserToAccount": "account",
    "ResetPassword": "account",
    "ChangeSecurityQuestion": "account",
    "UpdateEmail": "account",
    "UpdatePhoneNumber": "account",
    "UpdateStreetAddress": "account",
    "ChangeAddress": "account",
}

#: Rows whose gold intent plainly contradicts the text (left out of both files).
MISLABELED = {
    "insurance_0384": "CancelAutomaticBilling, text reports a car accident",
    "insurance_0385": "CancelAutomaticBilling, text reports a car accident",
    "finance_00690": "MakeCreditCardPayment, text asks for a debt-to-income ratio",
}

LABELS: dict[str, str] = {
    "payment": "Pay a bill, loan or credit card, or change how or when payments are made "
    "(automatic payments, billing frequency or method, payment status).",
    "claim": "File an insurance claim or report an accident, damage, theft, injury or death.",
    "quote": "Get a price quote for a new insurance policy (car, home, renters, life, pet, ...).",
    "balance": "Check how much money is in an account or how much is owed on a card or loan.",
    "account": "Open, create or close an account, add a user to it, or change its sign-in or "
    "contact details (password, security question, email, phone, address).",
}

INSTRUCTION = (  # one YAML line each
    "Classify the opening message a customer sent to their bank or insurance company",
    "into exactly one category, by what the customer wants done.",
    "Ignore names, account numbers and small talk.",
    "Answer with the category name only.",
)


def _norm(text: str) -> str:
    """Key for spotting repeated texts."""
    return re.sub(r"[^a-z0-9 ]", "", text.lower()).strip()


def _good_example(text: str) -> bool:
    """Short, self-contained texts without numbers, emails or names make better shots."""
    words = text.split()
    return (4 <= len(words) <= 18 and not re.search(r"[\d@]", text)
            and "name" not in text.lower() and "this is" not in text.lower())


def load(source: Path) -> list[dict]:
    """Mapped, cleaned, de-duplicated rows from the shared csv, in source order."""
    rows, seen = [], set()
    with open(source, newline="", encoding="utf-8") as fh:
        for r in csv.DictReader(fh):
            label = MAPPING.get(r["intent"])
            if label is None or r["utterance_id"] in MISLABELED:
                continue
            text = " ".join(r["utterance"].split())
            key = _norm(text)
            if not text or key in seen:
                continue
            seen.add(key)
            rows.append({"id": r["utterance_id"], "text": text, "label": label,
                         "intent": r["intent"], "domain": r["domain"]})
    return rows


def select(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """Split rows into (evaluation rows, few-shot examples); see the module docstring."""
    rng = random.Random(SEED)
    evaluation, examples = [], []
    for label in sorted(LABELS):
        by_intent = {}
        for intent in sorted({r["intent"] for r in rows if r["label"] == label}):
            pool = [r for r in rows if r["intent"] == intent and r["label"] == label]
            rng.shuffle(pool)
            by_intent[intent] = pool
        # Examples: biggest intents first, at most one per intent per pass.
        order = sorted(by_intent, key=lambda i: (-len(by_intent[i]), i))
        picked: list[dict] = []
        while len(picked) < EXAMPLES_PER_LABEL:
            before = len(picked)
            for intent in order:
                if len(picked) == EXAMPLES_PER_LABEL:
                    break
                shot = next((r for r in by_intent[intent] if _good_example(r["text"]) and r not in picked), None)
                if shot is not None:
                    picked.append(shot)
            if len(picked) == before:
                raise SystemExit(f"not enough example candidates for {label!r}")
        for shot in picked:
            by_intent[shot["intent"]].remove(shot)
        examples += picked
        # Evaluation rows: round-robin over intents.
        chosen: list[dict] = []
        queues = [list(by_intent[i]) for i in sorted(by_intent)]
        while len(chosen) < PER_LABEL and any(queues):
            for q in queues:
                if q and len(chosen) < PER_LABEL:
                    chosen.append(q.pop(0))
        if len(chosen) < PER_LABEL:
            raise SystemExit(f"only {len(chosen)} rows for {label!r}")
        evaluation += chosen
    rng.shuffle(evaluation)
    # Interleave the examples by label so no label sits last in the prompt by accident.
    shots = [examples[i::EXAMPLES_PER_LABEL] for i in range(EXAMPLES_PER_LABEL)]
    examples = [s for group in shots for s in group]
    return evaluation, examples


def render_csv(evaluation: list[dict]) -> str:
    """The evaluation rows as csv text (``\n`` line ends)."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=["id", "text", "label", "intent", "domain"], lineterminator="\n")
    writer.writeheader()
    writer.writerows(evaluation)
    return buf.getvalue()


def _quote(text: str) -> str:
    """A double-quoted scalar; a JSON string is valid YAML."""
    return json.dumps(text, ensure_ascii=False)


def render_task(examples: list[dict]) -> str:
    """The ``natcs-intents`` task file as YAML text."""
    q = _quote
    lines = [
        "# Generated by tools/build_natcs.py from the NatCS / DSTC11 Track 2 utterances",
        "# (CDLA-Permissive-2.0; see datasets/natcs/README.md). Do not edit by hand.",
        "# Evaluation rows: datasets/natcs/utterances.csv. The examples below are other",
        "# rows of the same source and are not in that csv.",
        "name: natcs-intents",
        "kind: classify",
        "instruction: |",
        *[f"  {line}" for line in INSTRUCTION],
        "labels:",
        *[f"  {name}: {q(desc)}" for name, desc in LABELS.items()],
        "examples:",
    ]
    for ex in examples:
        lines += [f"  - text: {q(ex['text'])}  # {ex['id']} {ex['intent']}", f"    label: {ex['label']}"]
    lines.append('input_template: "Customer: {text}"')
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=SOURCE, help="the shared NatCS csv")
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 if a file would change")
    args = parser.parse_args(argv)
    evaluation, examples = select(load(args.source))
    outputs = {CSV_OUT: render_csv(evaluation), TASK_OUT: render_task(examples)}
    stale = [p for p, text in outputs.items() if not p.exists() or p.read_text(encoding="utf-8") != text]
    if args.check:
        for p in stale:
            print(f"out of date: {p.relative_to(ROOT)}")
        return 1 if stale else 0
    for p, text in outputs.items():
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8", newline="")
    counts = {label: sum(r["label"] == label for r in evaluation) for label in LABELS}
    print(f"wrote {len(evaluation)} rows {counts} and {len(examples)} examples")
    return 0


if __name__ == "__main__":
    sys.exit(main())
