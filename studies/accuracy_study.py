# Study behind docs/accuracy.md, "What a fitted head buys: measurements" (its tables and curves).
"""What a fitted label head buys over the prompt alone (issue 15): the measurements behind docs/accuracy.md.

Three steps, each a subcommand:

* ``tasks``: write the study's task files under docs/tasks/ (banking77, banking77-short, natcs-71,
  natcs-intents-short, support-tickets-short). Each few-shot example is a row of the data set; that
  row (and any row with the same normalized text) is left out of every evaluation here.
* ``collect``: run the embedded model once per (data set, task prompt) over every row the experiments
  need and cache the features in ``--cache`` (default /tmp/accuracy_cache), one ``.npz`` per job and
  chunk, so a rerun or a killed run costs nothing it already paid for. One pass keeps several feature
  specs at once (``last+mean+last@15+mean@15+last@22+mean@22``); the experiments slice the columns.
* ``run``: the experiments, on the cached arrays only: (a) feature choice, (b) the issue's targets,
  (c) accuracy against rows per label, (d) short vs full prompt, (e) fit time and fit vs classify.
  Prints markdown tables, writes the curve PNGs and ``results.json`` in the cache folder.

``--quick`` shrinks every data set (a few rows per label) so that ``collect`` and ``run`` finish in
a couple of minutes; its numbers only show that the pipeline works.

    .venv/bin/python studies/accuracy_study.py tasks
    nice -n 5 .venv/bin/python studies/accuracy_study.py collect            # hours on 2 cores, resumable
    .venv/bin/python studies/accuracy_study.py run --plots docs/img
    .venv/bin/python studies/accuracy_study.py --quick collect && .venv/bin/python studies/accuracy_study.py --quick run

The heads are fitted and scored by the package itself (:func:`prefixcache.eval.fit_head.fit_head`, and
:func:`prefixcache.eval.holdout.fit_then_score` for the held-out figures), so the numbers are what
``prefixcache fit`` gives; leaks are found with the package's :func:`~prefixcache.task.selection.normalize_text`.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from prefixcache.eval.holdout import fit_then_score
from prefixcache.task.selection import normalize_text

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "datasets"
TASK_DIR = ROOT / "docs" / "tasks"
BANKING77_CSV = SHARED / "banking77_train.csv"
NATCS_CSV = SHARED / "natcs_dstc11_intent_utterances.csv"
BUNDLED_NATCS = ROOT / "src" / "prefixcache" / "datasets" / "natcs" / "utterances.csv"
BUNDLED_TICKETS = ROOT / "src" / "prefixcache" / "datasets" / "support_tickets.jsonl"
HANDWRITTEN = ROOT / "tests" / "data" / "handwritten_tickets.jsonl"

# One forward pass keeps all of these; each experiment reads a slice. The model has 30 decoder layers:
# 15 is the middle, 22 two thirds of the way up.
COLLECT_SPEC = "last+mean+last@15+mean@15+last@22+mean@22"
SPEC_PARTS = COLLECT_SPEC.split("+")
FEATURE_CHOICES = ("last", "mean", "last@15", "mean@15", "last@22", "mean@22", "last+mean@15", "last+mean", "last+mean@22")
SEED = 0


# ---------------------------------------------------------------------------------------------
# Data sets: rows are dicts {id, text, label}.
# ---------------------------------------------------------------------------------------------
def banking77_rows() -> list[dict]:
    with open(BANKING77_CSV, newline="", encoding="utf-8") as fh:
        return [{"id": f"b{i:05d}", "text": r["text"].strip(), "label": r["category"]} for i, r in enumerate(csv.DictReader(fh))]


def natcs71_rows() -> list[dict]:
    with open(NATCS_CSV, newline="", encoding="utf-8") as fh:
        return [{"id": r["utterance_id"], "text": " ".join(r["utterance"].split()), "label": r["intent"]} for r in csv.DictReader(fh)]


def natcs5_rows() -> list[dict]:
    with open(BUNDLED_NATCS, newline="", encoding="utf-8") as fh:
        return [{"id": r["id"], "text": r["text"], "label": r["label"]} for r in csv.DictReader(fh)]


def jsonl_rows(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def pick_examples(rows: list[dict], seed: int, min_chars: int = 20, max_chars: int = 100) -> dict[str, dict]:
    """One row per label, drawn with ``seed`` among rows of a typical length (any length if none is)."""
    rng = random.Random(seed)
    by_label: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        by_label[row["label"]].append(row)
    picked = {}
    for label in sorted(by_label):
        pool = [r for r in by_label[label] if min_chars <= len(r["text"]) <= max_chars] or by_label[label]
        picked[label] = rng.choice(pool)
    return picked


def without_examples(rows: list[dict], examples) -> list[dict]:
    """``rows`` minus every row whose normalized text is one of the examples' (so no leak by duplicates)."""
    shown = {normalize_text(e["text"]) for e in examples}
    return [r for r in rows if normalize_text(r["text"]) not in shown]


# ---------------------------------------------------------------------------------------------
# Task files (subcommand ``tasks``). Descriptions are short and written for this study.
# ---------------------------------------------------------------------------------------------
BANKING77_LABELS = {
    "activate_my_card": "how to activate a card",
    "age_limit": "minimum age for an account",
    "apple_pay_or_google_pay": "paying with Apple Pay or Google Pay",
    "atm_support": "which cash machines take the card",
    "automatic_top_up": "setting up automatic top-ups",
    "balance_not_updated_after_bank_transfer": "balance unchanged after a bank transfer came in",
    "balance_not_updated_after_cheque_or_cash_deposit": "balance unchanged after depositing cash or a cheque",
    "beneficiary_not_allowed": "a payee cannot be added or paid",
    "cancel_transfer": "stop or undo a transfer just made",
    "card_about_to_expire": "the card expires soon",
    "card_acceptance": "where the card can be used",
    "card_arrival": "a new card has not arrived",
    "card_delivery_estimate": "how long card delivery takes",
    "card_linking": "adding a card to the app",
    "card_not_working": "the card does not work",
    "card_payment_fee_charged": "an unexpected fee on a card payment",
    "card_payment_not_recognised": "a card payment the customer did not make",
    "card_payment_wrong_exchange_rate": "a bad exchange rate on a card payment",
    "card_swallowed": "a cash machine kept the card",
    "cash_withdrawal_charge": "a fee for taking out cash",
    "cash_withdrawal_not_recognised": "a cash withdrawal the customer did not make",
    "change_pin": "changing the PIN",
    "compromised_card": "card details may have been stolen",
    "contactless_not_working": "contactless payments fail",
    "country_support": "which countries are served",
    "declined_card_payment": "a card payment was declined",
    "declined_cash_withdrawal": "a cash withdrawal was refused",
    "declined_transfer": "a transfer was declined",
    "direct_debit_payment_not_recognised": "an unknown direct debit",
    "disposable_card_limits": "limits of single-use virtual cards",
    "edit_personal_details": "changing name, address or other details",
    "exchange_charge": "fees for changing currency",
    "exchange_rate": "which exchange rate is used",
    "exchange_via_app": "changing currency in the app",
    "extra_charge_on_statement": "an unexplained extra charge on the statement",
    "failed_transfer": "a transfer failed",
    "fiat_currency_support": "which currencies can be held",
    "get_disposable_virtual_card": "getting a single-use virtual card",
    "get_physical_card": "the PIN or set-up of a new physical card",
    "getting_spare_card": "ordering an extra card",
    "getting_virtual_card": "getting a virtual card",
    "lost_or_stolen_card": "the card was lost or stolen",
    "lost_or_stolen_phone": "the phone with the app was lost or stolen",
    "order_physical_card": "ordering a physical card",
    "passcode_forgotten": "forgot the app passcode",
    "pending_card_payment": "a card payment is still pending",
    "pending_cash_withdrawal": "a cash withdrawal is still pending",
    "pending_top_up": "a top-up is still pending",
    "pending_transfer": "a transfer is still pending",
    "pin_blocked": "the PIN is blocked",
    "receiving_money": "receiving money from someone",
    "Refund_not_showing_up": "a refund has not reached the account",
    "request_refund": "asking for a refund of a purchase",
    "reverted_card_payment?": "a card payment was reversed",
    "supported_cards_and_currencies": "which cards and currencies are supported",
    "terminate_account": "closing the account",
    "top_up_by_bank_transfer_charge": "a fee for topping up by bank transfer",
    "top_up_by_card_charge": "a fee for topping up by card",
    "top_up_by_cash_or_cheque": "topping up with cash or a cheque",
    "top_up_failed": "a top-up failed",
    "top_up_limits": "limits on top-ups",
    "top_up_reverted": "a top-up was reversed",
    "topping_up_by_card": "how to top up with a card",
    "transaction_charged_twice": "the same payment taken twice",
    "transfer_fee_charged": "a fee on a transfer",
    "transfer_into_account": "how to move money into the account",
    "transfer_not_received_by_recipient": "the recipient has not got a transfer",
    "transfer_timing": "how long transfers take",
    "unable_to_verify_identity": "identity verification fails",
    "verify_my_identity": "how to verify identity",
    "verify_source_of_funds": "proving where money comes from",
    "verify_top_up": "verifying a top-up",
    "virtual_card_not_working": "a virtual card does not work",
    "visa_or_mastercard": "whether the card is Visa or Mastercard",
    "why_verify_identity": "why identity checks are needed",
    "wrong_amount_of_cash_received": "a cash machine gave the wrong amount",
    "wrong_exchange_rate_for_cash_withdrawal": "a bad exchange rate on a cash withdrawal",
}

NATCS71_LABELS = {
    "AddDependent": "add a dependent to an insurance policy",
    "AddUserToAccount": "add another person as a user of an account",
    "ApplyCreditCard": "apply for a credit card",
    "ApplyLoan": "apply for a loan or mortgage",
    "AskAboutCashDeposits": "depositing cash, for example at a cash machine",
    "AskAboutTransferTime": "how long a transfer takes",
    "AskConsumerPriceIndex": "the consumer price index or inflation",
    "AskLiquidityRatio": "a business's liquidity ratio",
    "CancelAutomaticBilling": "stop automatic billing of a policy",
    "CancelCheck": "cancel or stop a cheque",
    "CancelPlan": "cancel an insurance plan",
    "ChangeAddress": "change the address on an insurance policy",
    "ChangePin": "change a card or account PIN",
    "ChangePlan": "switch to another insurance plan",
    "ChangeSecurityQuestion": "change a security question",
    "ChangeStatementDelivery": "paper or electronic statements",
    "CheckAccountBalance": "how much is in an account",
    "CheckCreditCardBalance": "how much is owed on a credit card",
    "CheckLoanBalance": "how much is left on a loan",
    "CheckPaymentStatus": "whether a payment went through",
    "CheckTransactionHistory": "recent transactions on an account",
    "CloseAccount": "close a financial account",
    "CloseBankAccount": "close a bank account and move the funds",
    "CreateAccount": "create an online insurance account",
    "DisputeCharge": "dispute a charge",
    "EnrollInPlan": "enroll in an insurance plan",
    "ExternalWireTransfer": "wire money to another bank",
    "FileClaim": "file an insurance claim",
    "FindATM": "find a cash machine",
    "FindAgent": "find an insurance agent",
    "FindBranch": "find a branch",
    "GetBankStatement": "get a bank statement",
    "GetBranchHours": "a branch's opening hours",
    "GetCreditCardInfo": "terms, rates or limits of a credit card",
    "GetCreditReport": "a credit report or score",
    "GetDebtIncomeRatio": "a debt-to-income ratio",
    "GetExchangeRate": "a currency exchange rate",
    "GetInvestmentReport": "a report on investments",
    "GetLoanInfo": "terms or rates of a loan",
    "GetPolicyNumber": "look up a policy number",
    "GetQuote": "a price for new insurance",
    "GetStockQuote": "the price of a stock",
    "GetTreasuryBondYield": "treasury bond yields",
    "GetWithdrawalLimit": "how much cash can be withdrawn",
    "InternalFundsTransfer": "move money between one's own accounts",
    "MakeCreditCardPayment": "pay a credit card",
    "MakeTransfer": "make a transfer",
    "NetIncome": "a business's net income",
    "OnlineBankingInfo": "how to bank online",
    "OpenAccount": "open a financial account",
    "OpenBankingAccount": "open a bank account",
    "OrderCheck": "order new cheques",
    "PayBill": "pay an insurance bill",
    "PayLoan": "make a loan payment",
    "PurchaseStocks": "buy stocks",
    "RemoveDependent": "remove a dependent from a policy",
    "ReportAutomobileAccident": "report a car accident",
    "ReportBillingIssue": "a problem with a bill",
    "ReportLostStolenCard": "a card was lost or stolen",
    "RequestEmail": "ask for a confirmation email",
    "RequestNewCard": "ask for a replacement card",
    "RequestProofOfInsurance": "proof of insurance",
    "ResetPassword": "reset a password",
    "ScheduleAppointment": "book an appointment",
    "SetAutoPayment": "set up automatic payments",
    "SetUpOnlineBanking": "sign up for online banking",
    "UpdateBillingFrequency": "change how often bills come",
    "UpdateEmail": "change the email address",
    "UpdatePaymentPreference": "change how bills are paid",
    "UpdatePhoneNumber": "change the phone number",
    "UpdateStreetAddress": "change the street address",
}

BANKING77_INSTRUCTION = (
    "Classify the message a customer sent to their online bank into exactly one intent,\n"
    "by what the customer wants to know or have done.\n"
    "Answer with the intent name only.\n"
)
NATCS71_INSTRUCTION = (
    "Classify the opening message a customer sent to their bank, finance or insurance company\n"
    "into exactly one intent, by what the customer wants done. Ignore names, account numbers and small talk.\n"
    "Answer with the intent name only.\n"
)


def _yaml_str(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # a JSON string is a valid YAML double-quoted scalar


def write_task(path: Path, header: list[str], name: str, instruction: str, labels: dict[str, str],
               examples: list[tuple[dict, str]], template: str) -> None:
    lines = [f"# {h}" if h else "#" for h in header]
    lines += [f"name: {name}", "kind: classify", "instruction: |"]
    lines += [f"  {line}" for line in instruction.rstrip("\n").split("\n")]
    lines.append("labels:")
    lines += [f"  {_yaml_str(label)}: {_yaml_str(desc)}" for label, desc in labels.items()]
    if examples:
        lines.append("examples:")
        for row, comment in examples:
            lines.append(f"  - text: {_yaml_str(row['text'])}  # {comment}")
            lines.append(f"    label: {_yaml_str(row['label'])}")
    lines.append(f"input_template: {_yaml_str(template)}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {path.relative_to(ROOT)}")


def write_tasks() -> None:
    TASK_DIR.mkdir(parents=True, exist_ok=True)
    rows = banking77_rows()
    assert set(r["label"] for r in rows) == set(BANKING77_LABELS), "banking77 labels changed"
    picked = pick_examples(rows, seed=77)
    src = "../shared/datasets/banking77_train.csv"
    write_task(
        TASK_DIR / "banking77.yaml",
        [f"banking77: 77 intents of {src} (text,category), for studies/accuracy_study.py.",
         "Each example is one row of that file; the comment is its id in the study (b + its 0-based data row);",
         "the study leaves every row with the same normalized text out of every evaluation."],
        "banking77", BANKING77_INSTRUCTION, BANKING77_LABELS,
        [(picked[label], picked[label]["id"]) for label in BANKING77_LABELS], "Message: {text}",
    )
    write_task(
        TASK_DIR / "banking77-short.yaml",
        ["banking77 with the instruction and the label list only (no descriptions, no examples):",
         "the short prompt that a fitted head may make enough. See docs/accuracy.md."],
        "banking77-short", BANKING77_INSTRUCTION, {label: "" for label in BANKING77_LABELS}, [], "Message: {text}",
    )
    rows = natcs71_rows()
    assert set(r["label"] for r in rows) == set(NATCS71_LABELS), "NatCS intents changed"
    picked = pick_examples(rows, seed=71)
    write_task(
        TASK_DIR / "natcs-71.yaml",
        ["NatCS / DSTC11 Track 2: all 71 intents of ../shared/datasets/natcs_dstc11_intent_utterances.csv",
         "(CDLA-Permissive-2.0, see src/prefixcache/datasets/natcs/README.md), for studies/accuracy_study.py.",
         "Each example is one row of that file (its utterance_id is in the comment); the study leaves",
         "every row with the same normalized text out of every evaluation."],
        "natcs-71", NATCS71_INSTRUCTION, NATCS71_LABELS,
        [(picked[label], picked[label]["id"]) for label in NATCS71_LABELS], "Customer: {text}",
    )
    # The bundled tasks with instruction and taxonomy only (their examples dropped).
    from prefixcache.task.definition import load_task

    for bundled, short in (("support-tickets", "support-tickets-short"), ("natcs-intents", "natcs-intents-short")):
        task = load_task(bundled)
        write_task(
            TASK_DIR / f"{short}.yaml",
            [f"The bundled '{bundled}' task with its instruction and taxonomy only (no few-shot examples):",
             "with a fitted head the examples may not earn their tokens. See docs/accuracy.md."],
            short, task.instruction, dict(task.labels), [], task.input_template,
        )


# ---------------------------------------------------------------------------------------------
# Splits: which rows each experiment fits on and scores.
# ---------------------------------------------------------------------------------------------
def load_task_file(name: str):
    from prefixcache.task.definition import load_task

    path = TASK_DIR / f"{name}.yaml"
    return load_task(path if path.exists() else name)


def stratified_take(rows: list[dict], per_label: int, seed: int, exclude: set = frozenset()) -> list[dict]:
    rng = random.Random(seed)
    by_label: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        if row["id"] not in exclude:
            by_label[row["label"]].append(row)
    out = []
    for label in sorted(by_label):
        pool = list(by_label[label])
        rng.shuffle(pool)
        out += pool[:per_label]
    return out


def interleave(rows: list[dict], seed: int) -> list[dict]:
    """Rows in label round-robin (each label's rows shuffled by ``seed``), so any prefix of the list is
    close to balanced: a collection stopped early still covers every label."""
    rng = random.Random(seed)
    by_label: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        by_label[row["label"]].append(row)
    for pool in by_label.values():
        rng.shuffle(pool)
    out, depth = [], 0
    while len(out) < len(rows):
        out += [pool[depth] for _, pool in sorted(by_label.items()) if depth < len(pool)]
        depth += 1
    return out


def alternate(fit: list[dict], test: list[dict], seed: int) -> list[dict]:
    """One round of ``fit`` rows (one per label), then one of ``test`` rows, and so on: a collection
    stopped early holds k fitting and about k scoring rows of every label."""
    n_labels = len({r["label"] for r in fit})
    a, b = interleave(fit, seed), interleave(test, seed)
    out = []
    for i in range(0, max(len(a), len(b)), n_labels):
        out += a[i:i + n_labels] + b[i:i + n_labels]
    return out


class Splits:
    """Every row set the experiments use, fixed by seeds, and the rows each feature job must cover."""

    def __init__(self, quick: bool):
        self.quick = quick
        b77 = self._without_task_examples(banking77_rows(), "banking77")
        per = 1 if quick else 10
        self.b77_fit = stratified_take(b77, per, SEED)
        self.b77_test = stratified_take(b77, per, SEED + 1, exclude={r["id"] for r in self.b77_fit})
        # The subset first, so that its features are cached early when the whole split is collected.
        first = {r["id"] for r in self.b77_fit + self.b77_test}
        rest = interleave([r for r in b77 if r["id"] not in first], SEED + 3)
        self.b77_all = self.b77_fit + self.b77_test + ([] if quick else rest)
        n71 = self._without_task_examples(natcs71_rows(), "natcs-71")
        # Label round-robin order: a collection stopped early still covers every intent evenly.
        self.n71_all = stratified_take(n71, 2, SEED) if quick else interleave(n71, SEED)
        n5 = natcs5_rows()
        self.n5_all = stratified_take(n5, 8, SEED) if quick else n5
        fit5 = stratified_take(self.n5_all, len(self.n5_all) // 10, SEED)  # half of each label (balanced data)
        fit_ids = {r["id"] for r in fit5}
        self.n5_fit, self.n5_test = fit5, [r for r in self.n5_all if r["id"] not in fit_ids]
        tickets = jsonl_rows(BUNDLED_TICKETS)
        self.tickets_fit = stratified_take(tickets, 10, SEED) if quick else tickets
        hand = jsonl_rows(HANDWRITTEN)
        self.tickets_hand = stratified_take(hand, 4, SEED) if quick else hand

    @staticmethod
    def _without_task_examples(rows, task_name):
        task = load_task_file(task_name)
        return without_examples(rows, [{"text": e.text} for e in task.examples])

    def jobs(self) -> dict[str, tuple[str, list[dict]]]:
        """job name -> (task, rows). Each job is one features pass, cached."""
        tickets = self.tickets_fit + self.tickets_hand
        return {
            "tickets.support-tickets": ("support-tickets", tickets),
            "tickets.support-tickets-short": ("support-tickets-short", tickets),
            "tickets.tickets-compact": ("tickets-compact", tickets),
            "natcs5.natcs-intents": ("natcs-intents", self.n5_all),
            "natcs5.natcs-intents-short": ("natcs-intents-short", self.n5_all),
            "b77sub.banking77-short": ("banking77-short", alternate(self.b77_fit, self.b77_test, SEED)),
            "natcs71.natcs-71": ("natcs-71", self.n71_all),
            "b77.banking77": ("banking77", self.b77_all),  # the expensive one: ~9,900 rows behind a long prefix
        }


# ---------------------------------------------------------------------------------------------
# Feature collection (subcommand ``collect``): one pass per job, cached by chunk.
# ---------------------------------------------------------------------------------------------
CHUNK = 256


def job_key(task_name: str, rows: list[dict]) -> str:
    """A digest of what the cached features depend on: the task file's text, the spec and the rows."""
    path = TASK_DIR / f"{task_name}.yaml"
    task_text = path.read_text(encoding="utf-8") if path.exists() else task_name
    h = hashlib.sha256(json.dumps([task_text, COLLECT_SPEC, [(r["id"], r["text"]) for r in rows]]).encode())
    return h.hexdigest()[:12]


def chunk_path(cache: Path, job: str, task_name: str, rows: list[dict], k: int) -> Path:
    return cache / f"{job}.{job_key(task_name, rows)}.{k:03d}.npz"


def load_model_for_study():
    import torch

    torch.set_num_threads(2)
    from prefixcache.model.load import load_model

    return load_model("smollm2-135m", dtype="auto")


def collect(args) -> None:
    from prefixcache.cache.pool import PrefixPool
    from prefixcache.scheduler.feature_pass import collect_features

    try:
        from prefixcache.types import Record, RunConfig
    except ImportError:  # before the value types moved
        from prefixcache.scheduler.classify import Record, RunConfig

    splits = Splits(args.quick)
    args.cache.mkdir(parents=True, exist_ok=True)
    jobs = splits.jobs()
    names = args.jobs or list(jobs)
    loaded = None
    for job in names:
        task_name, rows = jobs[job]
        chunks = [rows[i:i + CHUNK] for i in range(0, len(rows), CHUNK)]
        todo = [k for k in range(len(chunks)) if not chunk_path(args.cache, job, task_name, rows, k).exists()]
        print(f"{job}: {len(rows)} rows, {len(chunks)} chunks, {len(todo)} to collect", flush=True)
        if not todo:
            continue
        if loaded is None:
            loaded = load_model_for_study()
        task = load_task_file(task_name)
        pool = PrefixPool()
        started = time.perf_counter()
        warm = [Record("warm-up", {"text": "hello"})]
        collect_features(loaded, task, warm, feature=COLLECT_SPEC, config=RunConfig(batch_size=32), pool=pool)  # prefix build + warm-up
        print(f"  {job}: prefix built and warmed up in {time.perf_counter() - started:.0f} s", flush=True)
        for k in todo[: args.max_chunks]:
            chunk = chunks[k]
            records = [Record(r["id"], {"text": r["text"]}) for r in chunk]
            start = time.perf_counter()
            fs = collect_features(loaded, task, records, feature=COLLECT_SPEC, config=RunConfig(batch_size=32), pool=pool)
            seconds = time.perf_counter() - start
            if fs.errors:
                print(f"  {len(fs.errors)} errors, e.g. {next(iter(fs.errors.items()))}", flush=True)
            gold = {r["id"]: r["label"] for r in chunk}
            np.savez(
                chunk_path(args.cache, job, task_name, rows, k),
                ids=np.array([str(i) for i in fs.ids]),
                gold=np.array([gold[i] for i in fs.ids]),
                features=fs.features.astype(np.float32),
                prompt_logprobs=fs.prompt_logprobs.astype(np.float32),
                labels=np.array(fs.labels),
                feature=np.array(fs.feature),
                seconds=np.array(seconds),
                errors=np.array(json.dumps({str(a): b for a, b in fs.errors.items()})),
            )
            print(f"  {job} chunk {k + 1}/{len(chunks)}: {len(chunk)} rows in {seconds:.0f} s "
                  f"({1000 * seconds / len(chunk):.0f} ms/row) "
                  f"{time.strftime('%H:%M:%S')}", flush=True)


class NotCollected(Exception):
    """A job's features are not in the cache."""


class Cached:
    """A job's cached features (the chunks present so far, in row order), with column slicing by spec."""

    def __init__(self, cache: Path, job: str, task_name: str, rows: list[dict], allow_partial: bool = False):
        n = (len(rows) + CHUNK - 1) // CHUNK
        parts = []
        for k in range(n):
            path = chunk_path(cache, job, task_name, rows, k)
            if not path.exists():
                if allow_partial:
                    break
                raise NotCollected(f"{path} is missing: run `collect {job}` first")
            parts.append(np.load(path))
        if not parts:
            raise NotCollected(f"no features cached for {job}: run `collect {job}` first")
        self.ids = np.concatenate([p["ids"] for p in parts])
        self.gold = np.concatenate([p["gold"] for p in parts])
        self.features = np.concatenate([p["features"] for p in parts])
        self.prompt_logprobs = np.concatenate([p["prompt_logprobs"] for p in parts])
        self.labels = [str(x) for x in parts[0]["labels"]]
        self.seconds = float(sum(p["seconds"] for p in parts))
        self.complete = len(parts) == n
        self.index = {i: k for k, i in enumerate(self.ids)}

    def take(self, rows: list[dict], spec: str = "last"):
        """(X, y, prompt log-probs) for ``rows`` (those present), features of ``task``."""
        idx = [self.index[r["id"]] for r in rows if r["id"] in self.index]
        width = self.features.shape[1] // len(SPEC_PARTS)
        cols = np.concatenate([np.arange(SPEC_PARTS.index(p) * width, (SPEC_PARTS.index(p) + 1) * width)
                               for p in spec.split("+")])
        return self.features[idx][:, cols], self.gold[idx], self.prompt_logprobs[idx]


# ---------------------------------------------------------------------------------------------
# Experiments (subcommand ``run``): cached arrays only, no model.
# ---------------------------------------------------------------------------------------------
def feature_set(cached: Cached, rows: list[dict], spec: str):
    """A :class:`~prefixcache.scheduler.feature_pass.FeatureSet` of ``rows`` (those cached) and their gold labels."""
    from prefixcache.scheduler.feature_pass import FeatureSet

    present = [r for r in rows if r["id"] in cached.index]
    x, gold, prompt = cached.take(present, spec)
    fs = FeatureSet(ids=[r["id"] for r in present], features=x, prompt_logprobs=prompt, labels=tuple(cached.labels),
                    feature=spec, prefix_hash="", model_identity="smollm2-135m", dtype="float32")
    return fs, [str(g) for g in gold]


def prompt_accuracy(prompt_logprobs: np.ndarray, gold, labels) -> float:
    """The prompt alone, first-token scores, ties shared: a row whose gold label ties with k-1 others
    for the best score counts 1/k (the expected accuracy of breaking ties at random)."""
    position = {label: j for j, label in enumerate(labels)}
    best = prompt_logprobs.max(axis=1, keepdims=True)
    top = prompt_logprobs >= best - 1e-6  # [N, L]
    credit = [top[i, position[g]] / top[i].sum() for i, g in enumerate(gold)]
    return float(np.mean(credit))


def distinct_first_tokens(prompt_logprobs: np.ndarray) -> int:
    """How many label columns the prompt can tell apart (columns that tie on every row count once)."""
    return len({tuple(np.round(col, 5)) for col in prompt_logprobs[: min(64, len(prompt_logprobs))].T})


def pct(x) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


class Study:
    def __init__(self, args):
        self.args = args
        self.splits = Splits(args.quick)
        self.jobs = self.splits.jobs()
        self.results: dict = {"quick": args.quick}
        self._cached: dict[str, Cached] = {}

    def cached(self, job: str, partial: bool = False) -> Cached:
        if job not in self._cached:
            task_name, rows = self.jobs[job]
            self._cached[job] = Cached(self.args.cache, job, task_name, rows, allow_partial=partial)
        return self._cached[job]

    def held_out(self, job, fit_rows, test_rows, spec, on_prompt=False):
        c = self.cached(job, partial=True)
        train, train_gold = feature_set(c, fit_rows, spec)
        test, test_gold = feature_set(c, test_rows, spec)
        head, result = fit_then_score(train, train_gold, test, test_gold, on_prompt=on_prompt, seed=SEED)
        return {"accuracy": head.accuracy, "C": result.C, "fit_rows": len(train_gold), "test_rows": len(test_gold),
                "prompt": prompt_accuracy(test.prompt_logprobs, test_gold, c.labels),
                "cv_accuracy": result.cv_metrics.accuracy if result.cv_metrics else None,
                "fit_seconds": result.seconds}

    # (a) -------------------------------------------------------------------------------------
    def features(self) -> str:
        s = self.splits
        settings = [
            ("banking77 (10/intent -> held-out)", "b77.banking77", s.b77_fit, s.b77_test),
            ("natcs-intents (250 -> 250)", "natcs5.natcs-intents", s.n5_fit, s.n5_test),
            ("support-tickets (600 synthetic -> 75 hand-written)", "tickets.support-tickets", s.tickets_fit, s.tickets_hand),
        ]
        out, rows = {}, []
        for spec in FEATURE_CHOICES:
            row = [f"`{spec}`"]
            for name, job, fit, test in settings:
                started = time.perf_counter()
                r = self.held_out(job, fit, test, spec)
                out.setdefault(spec, {})[name] = r
                row.append(pct(r["accuracy"]))
                print(f"  (a) {spec:14s} {name}: {pct(r['accuracy'])} C={r['C']} "
                      f"({r['fit_rows']} -> {r['test_rows']} rows, {time.perf_counter() - started:.0f} s)", flush=True)
            rows.append(row + [pct(np.mean([out[spec][n]["accuracy"] for n, *_ in settings]))])
        self.results["features"] = out
        return table(["feature"] + [n for n, *_ in settings] + ["mean"], rows)

    # (b) -------------------------------------------------------------------------------------
    def targets(self, spec: str) -> str:
        from prefixcache.eval.fit_head import fit_head

        s, out, rows = self.splits, {}, []
        r = self.held_out("b77.banking77", s.b77_fit, s.b77_test, spec)
        out["b77_10"] = r
        rows.append(["banking77, 10 rows/intent -> held-out rows", f"{r['fit_rows']} -> {r['test_rows']}",
                     pct(r["prompt"]), pct(r["accuracy"]), ">= 85%", "yes" if r["accuracy"] >= 0.85 else "**no**"])
        r = self.held_out("tickets.support-tickets", s.tickets_fit, s.tickets_hand, spec)
        out["tickets_hand"] = r
        rows.append(["support-tickets, 600 synthetic -> 75 hand-written", f"{r['fit_rows']} -> {r['test_rows']}",
                     pct(r["prompt"]), pct(r["accuracy"]), ">= 95%", "yes" if r["accuracy"] >= 0.95 else "**no**"])
        r = self.held_out("natcs5.natcs-intents", s.n5_fit, s.n5_test, spec)
        out["natcs5"] = r
        rows.append(["natcs-intents (5 labels), 250 -> other 250", f"{r['fit_rows']} -> {r['test_rows']}",
                     pct(r["prompt"]), pct(r["accuracy"]), "(none)", ""])
        for key, job, rows_all, target, label in (
            ("b77_cv", "b77.banking77", s.b77_all, 0.92, "banking77, whole training split, 5-fold CV"),
            ("n71_cv", "natcs71.natcs-71", s.n71_all, None, "NatCS, all 71 intents, 5-fold CV"),
        ):
            c = self.cached(job, partial=True)
            fs, gold = feature_set(c, rows_all, spec)
            started = time.perf_counter()
            result = fit_head(fs, gold, folds=5, seed=SEED)
            prompt = prompt_accuracy(fs.prompt_logprobs, gold, c.labels)
            acc = result.cv_metrics.accuracy
            out[key] = {"rows": len(gold), "of_rows": len(rows_all), "accuracy": acc, "macro_f1": result.cv_metrics.macro_f1,
                        "prompt": prompt, "C": result.C, "accuracy_by_C": {repr(k): v for k, v in result.accuracy_by_C.items()},
                        "seconds": time.perf_counter() - started, "distinct_first_tokens": distinct_first_tokens(fs.prompt_logprobs)}
            print(f"  (b) {label}: {pct(acc)} on {len(gold)} rows (prompt {pct(prompt)}), C={result.C}, "
                  f"{time.perf_counter() - started:.0f} s", flush=True)
            goal = ">= 92%" if target else ">= prompt + 30 points"
            met = acc >= target if target else acc >= prompt + 0.30
            note = "" if len(gold) == len(rows_all) else f" (features of {len(gold)} of {len(rows_all)} rows)"
            rows.append([label + note, f"{len(gold)} (CV)", pct(prompt), pct(acc), goal, "yes" if met else "**no**"])
        self.results["targets"] = out
        return table(["data", "rows (fit -> scored)", "prompt alone", f"fitted head (`{spec}`)", "target", "met"], rows)

    # (c) -------------------------------------------------------------------------------------
    def curves(self, spec: str, plots: Path | None) -> str:
        from prefixcache.eval.fit_curve import fit_curve

        s, out, rows = self.splits, {}, []
        b77_cached = self.cached("b77.banking77", partial=True).index
        b77_rows = stratified_take([r for r in s.b77_all if r["id"] in b77_cached], self.args.curve_b77, SEED + 2)
        for name, job, data in (("NatCS-71", "natcs71.natcs-71", s.n71_all),
                                ("natcs-intents", "natcs5.natcs-intents", s.n5_all),
                                ("banking77", "b77.banking77", b77_rows)):
            if self.args.curves and name not in self.args.curves:
                continue
            c = self.cached(job, partial=True)
            fs, gold = feature_set(c, data, spec)
            started = time.perf_counter()
            points = fit_curve(fs, gold, seed=SEED)
            # The same split as fit_curve's, for the tie-aware prompt score.
            from sklearn.model_selection import train_test_split

            _, test = train_test_split(np.arange(len(gold)), test_size=0.5, stratify=gold, random_state=SEED)
            tied = prompt_accuracy(fs.prompt_logprobs[test], [gold[i] for i in test], c.labels)
            out[name] = {"points": [p.to_json() for p in points], "prompt_ties_shared": tied, "rows": len(gold)}
            print(f"  (c) {name}: {len(gold)} rows, {time.perf_counter() - started:.0f} s", flush=True)
            for p in points:
                rows.append([name, "all" if p.shots is None else p.shots, p.rows, pct(tied), pct(p.scratch), pct(p.on_prompt)])
            if plots is not None:
                plot_curve(plots / f"accuracy-curve-{name.lower()}.png", name, points, tied, len(gold))
        self.results["curves"] = out
        return table(["data", "rows per label", "rows fitted", "prompt alone", "head from scratch", "head on the prompt"], rows)

    # (d) -------------------------------------------------------------------------------------
    def short_prompts(self, spec: str, timing: dict) -> str:
        s, out, rows = self.splits, {}, []
        for data, jobs, fit, test in (
            ("support-tickets (600 -> 75 hand-written)",
             ["tickets.support-tickets", "tickets.support-tickets-short", "tickets.tickets-compact"], s.tickets_fit, s.tickets_hand),
            ("natcs-intents (250 -> 250)", ["natcs5.natcs-intents", "natcs5.natcs-intents-short"], s.n5_fit, s.n5_test),
            ("banking77 (10/intent -> held-out)", ["b77.banking77", "b77sub.banking77-short"], s.b77_fit, s.b77_test),
        ):
            present = []
            for job in jobs:
                try:
                    present.append(job)
                    self.cached(job, partial=True)
                except NotCollected as exc:
                    present.pop()
                    print(f"  (d) skipped: {exc}", flush=True)
            # The same rows for every prompt of a setting: those whose features every prompt has.
            fit = [r for r in fit if all(r["id"] in self.cached(j).index for j in present)]
            test = [r for r in test if all(r["id"] in self.cached(j).index for j in present)]
            for job in present:
                task_name = self.jobs[job][0]
                r = self.held_out(job, fit, test, spec)
                t = timing.get(task_name) or self.collection_timing(job, task_name)
                out[job] = r | {"timing": t}
                rows.append([data, f"{r['fit_rows']} -> {r['test_rows']}", f"`{task_name}`", t.get("prefix_tokens", "?"),
                             pct(r["prompt"]), pct(r["accuracy"]),
                             f"{t['ms_per_record']:.1f}" if t else "—"])
        self.results["short"] = out
        return table(["data", "rows (fit -> scored)", "prompt", "prefix tokens", "prompt alone", f"fitted head (`{spec}`)", "ms/record (features pass)"], rows)

    def collection_timing(self, job: str, task_name: str) -> dict:
        """ms/record of the collection pass itself (all six feature parts kept; prefix build excluded)."""
        from prefixcache.task.prompt import build_prompt

        if not hasattr(self, "_tokenizer"):
            self._tokenizer = load_model_for_study().tokenizer
        c = self.cached(job, partial=True)
        return {"ms_per_record": 1000 * c.seconds / len(c.ids), "rows": len(c.ids), "source": "collection",
                "prefix_tokens": len(build_prompt(load_task_file(task_name), self._tokenizer).prefix_ids)}

    # (e) -------------------------------------------------------------------------------------
    def fit_times(self, spec: str, timing: dict) -> str:
        from prefixcache.eval.fit_head import fit_head

        s, out, rows = self.splits, {}, []
        for name, job, data in (("NatCS-71 (71 labels)", "natcs71.natcs-71", s.n71_all),
                                ("banking77 (77 labels)", "b77.banking77", s.b77_all),
                                ("support-tickets (3 labels)", "tickets.support-tickets", s.tickets_fit + s.tickets_hand)):
            c = self.cached(job, partial=True)
            fs, gold = feature_set(c, data, spec)
            n = min(1000, len(gold))
            from prefixcache.eval.fit_curve import subset

            part = subset(fs, list(range(n)))
            for on_prompt in (False, True):
                cpu = time.process_time()
                result = fit_head(part, gold[:n], folds=5, on_prompt=on_prompt, seed=SEED)
                cpu = time.process_time() - cpu
                out[f"{name} {on_prompt}"] = {"rows": n, "seconds": result.seconds, "cpu_seconds": cpu,
                                              "cv_accuracy": result.cv_metrics.accuracy if result.cv_metrics else None}
                rows.append([name, n, "on the prompt" if on_prompt else "from scratch", f"{result.seconds:.1f}", f"{cpu:.1f}"])
                print(f"  (e) {name} {n} rows on_prompt={on_prompt}: {result.seconds:.1f} s wall, {cpu:.1f} s CPU", flush=True)
        self.results["fit_times"] = out
        return table(["data", "rows", "head", "fit wall seconds (5 values of C x 5 folds, then the final fit)",
                      "fit CPU seconds"], rows)


def plot_curve(path: Path, name: str, points, prompt: float, n_rows: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [str(p.shots) if p.shots is not None else "all" for p in points]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=110)
    ax.plot(xs, [100 * p.scratch for p in points], "o-", label="head from scratch")
    ax.plot(xs, [100 * p.on_prompt for p in points], "s-", label="head on the prompt")
    ax.plot(xs, [100 * prompt] * len(points), "--", color="grey", label="prompt alone (first token, ties shared)")
    ax.set_xlabel("training rows per label")
    ax.set_ylabel("held-out accuracy (%)")
    ax.set_ylim(0, 100)
    ax.set_title(f"{name}: {points[0].scored} held-out rows of {n_rows}, smollm2-135m float32")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    print(f"  wrote {path}", flush=True)


def run(args) -> None:
    study = Study(args)
    timing_path = args.cache / "timing.json"
    timing = json.loads(timing_path.read_text()) if timing_path.exists() else {}
    sections = []
    wanted = args.only or ["a", "b", "c", "d", "e"]
    spec = args.spec
    if "a" in wanted:
        sections.append(("(a) feature choice: held-out accuracy", study.features()))
        if args.spec == "auto":
            feats = study.results["features"]
            spec = max(feats, key=lambda k: np.mean([v["accuracy"] for v in feats[k].values()]))
    if spec == "auto":
        spec = "last"
    study.results["spec"] = spec
    if "b" in wanted:
        sections.append((f"(b) targets, feature `{spec}`", study.targets(spec)))
    if "c" in wanted:
        sections.append((f"(c) accuracy against rows per label, feature `{spec}`", study.curves(spec, args.plots)))
    if "d" in wanted:
        sections.append((f"(d) short prompt vs full prompt, feature `{spec}`", study.short_prompts(spec, timing)))
    if "e" in wanted:
        sections.append((f"(e) fit time on 1,000 rows, feature `{spec}`", study.fit_times(spec, timing)))
    report = "\n\n".join(f"### {title}\n\n{body}" for title, body in sections)
    print(report)
    name = ("results-quick" if args.quick else "results") + "-" + "".join(wanted)
    (args.cache / f"{name}.json").write_text(json.dumps(study.results, indent=1, default=str))
    (args.cache / f"{name}.md").write_text(report + "\n")


# ---------------------------------------------------------------------------------------------
# Timing (subcommand ``timing``): ms/record of the features pass per prompt, and fit vs classify.
# ---------------------------------------------------------------------------------------------
TIMED_PROMPTS = (("support-tickets", "tickets"), ("support-tickets-short", "tickets"), ("tickets-compact", "tickets"),
                 ("natcs-intents", "natcs5"), ("natcs-intents-short", "natcs5"),
                 ("banking77", "b77"), ("banking77-short", "b77"))


def timing(args) -> None:
    """Wall-clock ms/record of the batched features pass (batch 32, after the prefix is built and one
    warm-up batch ran), each prompt in ``--rounds`` interleaved rounds, the fastest kept; then features +
    fit against classification on the same 1,000 synthetic tickets."""
    from prefixcache.cache.pool import PrefixPool
    from prefixcache.datasets.tickets import generate_tickets
    from prefixcache.eval.fit_head import fit_head
    from prefixcache.scheduler.classify import Classifier, warmup
    from prefixcache.scheduler.feature_pass import collect_features
    from prefixcache.task.prompt import build_prompt
    from prefixcache.types import Record, RunConfig

    loaded = load_model_for_study()
    s = Splits(args.quick)
    data = {"tickets": s.tickets_hand + s.tickets_fit, "natcs5": s.n5_all, "b77": s.b77_test}
    n = 16 if args.quick else args.rows
    out_path = args.cache / "timing.json"
    out = json.loads(out_path.read_text()) if out_path.exists() else {}
    pools = {}
    if not args.skip_prompts:
        for round_ in range(args.rounds):
            for task_name, key in TIMED_PROMPTS:
                if args.prompts and task_name not in args.prompts:
                    continue
                task = load_task_file(task_name)
                records = [Record(r["id"], {"text": r["text"]}) for r in data[key][:n]]
                pool = pools.setdefault(task_name, PrefixPool())
                collect_features(loaded, task, records[:4], feature=args.spec, pool=pool)  # prefix + warm-up
                started = time.perf_counter()
                collect_features(loaded, task, records, feature=args.spec, config=RunConfig(batch_size=32), pool=pool)
                ms = 1000 * (time.perf_counter() - started) / len(records)
                prev = out.get(task_name, {}).get("ms_per_record")
                best = ms if round_ == 0 or prev is None else min(prev, ms)
                out[task_name] = {"ms_per_record": best, "rows": len(records), "feature": args.spec,
                                  "prefix_tokens": len(build_prompt(task, loaded.tokenizer).prefix_ids)}
                print(f"  {task_name}: {ms:.1f} ms/record (round {round_ + 1})", flush=True)
                out_path.write_text(json.dumps(out, indent=1))
    # features + fit against classify, same rows, same prompt (support-tickets), batch 32.
    rows = 60 if args.quick else args.compare_rows
    if rows == 0:
        return
    tickets = generate_tickets(rows, seed=11)
    records = [Record(t["id"], {"text": t["text"]}) for t in tickets]
    task = load_task_file("support-tickets")
    clf = Classifier(loaded, task)
    warmup(clf)
    pool = PrefixPool()
    collect_features(loaded, task, records[:4], feature=args.spec, pool=pool)
    started = time.perf_counter()
    clf.classify_all(records, RunConfig("batched", 32))
    classify_s = time.perf_counter() - started
    started = time.perf_counter()
    fs = collect_features(loaded, task, records, feature=args.spec, config=RunConfig(batch_size=32), pool=pool)
    features_s = time.perf_counter() - started
    result = fit_head(fs, {t["id"]: t["label"] for t in tickets}, folds=5, seed=SEED)
    out["fit_vs_classify"] = {"rows": rows, "task": "support-tickets", "feature": args.spec, "classify_s": classify_s,
                              "features_s": features_s, "fit_s": result.seconds,
                              "ratio": (features_s + result.seconds) / classify_s}
    print(f"  fit vs classify on {rows} tickets: classify {classify_s:.1f} s, features {features_s:.1f} s + fit "
          f"{result.seconds:.1f} s = {(features_s + result.seconds) / classify_s:.2f}x", flush=True)
    out_path.write_text(json.dumps(out, indent=1))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few rows per label: checks the pipeline in minutes")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/accuracy_cache"))
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("tasks", help="write the study's task files under docs/tasks/")
    p = sub.add_parser("collect", help="features for every job (or the named ones), cached")
    p.add_argument("jobs", nargs="*", help="job names (default: all, cheapest first)")
    p.add_argument("--max-chunks", type=int, help=f"collect at most this many {CHUNK}-row chunks per job in this call")
    p = sub.add_parser("timing", help="ms/record per prompt and features+fit vs classify (loads the model)")
    p.add_argument("--spec", default="last", help="the feature the timed passes keep")
    p.add_argument("--rows", type=int, default=96, help="rows per timed prompt")
    p.add_argument("--skip-prompts", action="store_true", help="only features + fit vs classify")
    p.add_argument("--prompts", nargs="*", help="time only these prompts (default: all of TIMED_PROMPTS)")
    p.add_argument("--compare-rows", type=int, default=1000, help="synthetic tickets for features + fit vs classify (0: skip)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved timing rounds per prompt (the fastest is kept)")
    p = sub.add_parser("run", help="the experiments on the cached features")
    p.add_argument("--only", nargs="*", choices=["a", "b", "c", "d", "e"], help="experiments to run (default: all)")
    p.add_argument("--spec", default="auto", help="feature for (b)-(e); auto: the best mean of (a)")
    p.add_argument("--plots", type=Path, help="folder for the curve PNGs (docs/img)")
    p.add_argument("--curves", nargs="*", choices=["NatCS-71", "natcs-intents", "banking77"], help="curves to draw (default: all)")
    p.add_argument("--curve-b77", type=int, default=40, help="banking77 rows per intent for the curve (half fit, half scored)")
    args = parser.parse_args(argv)
    if args.command == "tasks":
        write_tasks()
    elif args.command == "collect":
        collect(args)
    elif args.command == "timing":
        timing(args)
    elif args.command == "run":
        run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
