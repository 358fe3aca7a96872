"""Seeded synthetic customer-support tickets for the ``support-tickets`` task.

Contract of :func:`generate_tickets`:

* **Deterministic.** The same ``(n, seed)`` always gives the same list, across
  runs and machines. All randomness comes from one ``random.Random(seed)``; nothing
  depends on hashing, set order or the clock. The bundled file
  ``datasets/support_tickets.jsonl`` is ``generate_tickets(600, seed=0)``,
  one ``json.dumps(ticket, ensure_ascii=False)`` per line (UTF-8, ``\n``).
* **Balanced labels.** Each of ``billing``, ``technical`` and ``account`` gets
  ``n // 3`` tickets; the ``n % 3`` left over go to the first labels of that
  list, one each. The order of the tickets is shuffled by the seed, and ids are
  ``t0000``, ``t0001``, ... in the returned order.
* **Length.** Every ticket is meant to be 20-35 tokens long under the SmolLM2
  tokenizer (no special tokens). The module does not load a tokenizer: each
  ticket is composed from parts (optional opener, a label-specific core, an
  optional label-specific detail, an optional closer) and redrawn until a cheap
  character-class estimate of its token count (:func:`approx_tokens`) lies in a
  band calibrated against the real tokenizer to sit safely inside 20-35.
  Checked with the real tokenizer: all of ``generate_tickets(600, 0)`` and of
  ``generate_tickets(2000, 1)`` are in range (mean about 26.6 tokens).
* **No duplicates.** Texts within one call are unique.

Gold labels: ``billing`` is about money (charges, refunds, invoices, payment
methods, prices); ``technical`` is about the product misbehaving (bugs, errors,
crashes, sync, speed, integrations, outages); ``account`` is about identity and
access (sign-in, password reset, 2FA, email or profile changes, closing an
account, seats and permissions). A few cores deliberately touch two topics
(an app crash during checkout that ends in a refund request, a broken login
page, a price question about extra seats); for those the label follows what the
customer asks us to do.

Pure standard library; no torch or tokenizer import.
"""

from __future__ import annotations

import random
import re

__all__ = ["LABELS", "approx_tokens", "generate_tickets"]

LABELS: tuple[str, ...] = ("billing", "technical", "account")

# Band for approx_tokens(); calibrated against the real SmolLM2 tokenizer so
# that accepted tickets land in 20..35 real tokens.
_BAND = (22, 31)
# Extra estimated tokens for a misspelt word (it splits into more pieces).
_TYPO_COST = 2

# --------------------------------------------------------------------------
# Slot fillers. A template names a slot as {slot}; every occurrence is drawn
# independently. A slot ending in 2 draws from the base slot's pool but never
# repeats the value the base slot got (``{plan}`` vs ``{plan2}``).
# --------------------------------------------------------------------------
_POOLS: dict[str, tuple[str, ...]] = {
    "amount": ("$9.99", "$12", "$14.99", "$19", "$24.50", "$29.99", "$49",
               "$79", "$99.99", "$120", "$249", "€15", "€39", "£20", "£64"),
    "date": ("March 3", "Jan 12", "the 1st", "the 15th", "Oct 2", "June 30",
             "May 14", "Feb 28", "Sept 9", "Dec 1", "April 21", "the 28th"),
    "when": ("yesterday", "last week", "this morning", "two days ago",
             "on Monday", "over the weekend", "last night", "on Friday",
             "a few days ago", "earlier today"),
    "month": ("January", "February", "March", "April", "May", "June", "July",
              "August", "September", "October", "November", "December"),
    "year": ("2022", "2023", "2024"),
    "plan": ("Basic", "Starter", "Plus", "Pro", "Team", "Business", "Premium",
             "Enterprise", "Family"),
    "product": ("the mobile app", "the iOS app", "the Android app",
                "the desktop app", "the web app", "the dashboard",
                "the browser extension", "the editor"),
    "device": ("iPhone 13", "iPhone 15", "Pixel 8", "Galaxy S22", "MacBook",
               "Windows laptop", "iPad", "Chromebook", "ThinkPad",
               "Surface Pro", "work PC", "Android tablet"),
    "os": ("iOS 17", "Android 14", "macOS Sonoma", "Windows 10", "Windows 11",
           "Ubuntu", "ChromeOS"),
    "desktop": ("Windows 10", "Windows 11", "macOS", "macOS Sonoma", "Ubuntu",
                "Linux"),
    "browser": ("Chrome", "Firefox", "Safari", "Edge", "Brave", "Opera"),
    "error": ("E1042", "ERR_TIMEOUT", "SYNC-204", "E-77", "0x8004",
              "NET_FAIL", "DB-13", "E503", "X-19", "UPL-9"),
    "http": ("500", "502", "503", "504", "404"),
    "integration": ("Slack", "Google Drive", "Outlook", "Salesforce", "Zapier",
                    "Dropbox", "Shopify", "HubSpot", "Jira", "Google Calendar",
                    "Teams", "Xero"),
    "feature": ("reports page", "calendar view", "settings screen",
                "search page", "comments panel", "inbox", "file browser",
                "analytics tab", "print view", "task board"),
    "button": ("Export", "Share", "Save", "Upload", "Print", "Submit",
               "Invite", "Download"),
    "method": ("Visa", "Mastercard", "Amex", "PayPal", "debit card",
               "credit card", "company card"),
    "name": ("Maria", "Tom", "Priya", "Ahmed", "Lena", "Carlos", "Yuki", "Sam",
             "Grace", "Daniel", "Olu", "Ines", "Mark", "Aisha", "Jonas"),
    "seats": ("two", "three", "four", "five", "six", "ten", "2", "3", "5", "8"),
    "role": ("admin", "editor", "manager", "owner"),
    "arole": ("an admin", "an editor", "a viewer", "a manager", "an owner"),
    "pct": ("10", "15", "20", "25", "30", "50"),
    "size": ("20", "50", "100", "200", "500"),
    "rows": ("500", "1000", "2000", "250", "5000"),
    "minutes": ("10", "20", "30", "45", "90"),
}


def _digits(rng: random.Random, k: int) -> str:
    return "".join(rng.choice("0123456789") for _ in range(k))


def _draw(slot: str, rng: random.Random) -> str:
    """Return a filler for ``slot`` (``plan2`` draws from ``plan``, etc.)."""
    base = slot[:-1] if slot.endswith("2") else slot
    if base == "card":
        return _digits(rng, 4)
    if base == "invoice":
        return rng.choice(("INV-", "#", "INV")) + _digits(rng, rng.choice((4, 5)))
    if base == "version":
        return f"{rng.randint(2, 9)}.{rng.randint(0, 19)}"
    if base == "user":
        return rng.choice(_POOLS["name"]).lower() + _digits(rng, 2)
    return rng.choice(_POOLS[base])


def _fill(template: str, rng: random.Random) -> str:
    """Fill every ``{slot}``; a slot and its ``2`` twin never get the same value."""
    chosen: dict[str, str] = {}

    def sub(match: re.Match) -> str:
        slot = match.group(1)
        base = slot[:-1] if slot.endswith("2") else slot
        for _ in range(20):
            value = _draw(slot, rng)
            if base == slot or value != chosen.get(base):
                break
        chosen.setdefault(base, value)
        return value

    return re.sub(r"\{(\w+)\}", sub, template)


# --------------------------------------------------------------------------
# Label-specific cores (the part that carries the label) and details.
# --------------------------------------------------------------------------
_CORES: dict[str, tuple[str, ...]] = {
    "billing": (
        "I was charged twice for my {plan} subscription on {date}. Please refund the duplicate {amount} charge.",
        "Why did my bill jump to {amount} this month? Nobody told me the {plan} plan price was changing.",
        "I cancelled on {date} but you still charged my {method} {amount}. I want that money back.",
        "Can you send an invoice for {month} with our company VAT number on it? Our finance team needs it.",
        "My {method} payment keeps getting declined even though the card is fine. How else can I pay the invoice?",
        "How do I replace the card you bill every month? The old one ending in {card} has expired.",
        "Sales promised us {pct}% off the annual plan, but invoice {invoice} shows the full price.",
        "What is the price difference between {plan} and {plan2} if we pay yearly instead of monthly?",
        "Refund request: I upgraded to {plan} by mistake on {date} and was billed {amount}. Please reverse it.",
        "There is a charge of {amount} from you on my bank statement that I do not recognize at all.",
        "Invoice {invoice} bills us for {seats} seats but we only have {seats2}. Please correct the total.",
        "Do you give refunds if I cancel the {plan} plan halfway through a yearly contract?",
        "Still waiting on the {amount} refund you approved {when}. When will it reach my account?",
        "Can we move from monthly to annual billing and get the yearly discount applied right away?",
        "The receipt for my last payment has no tax line on it. Could you resend a corrected receipt?",
        "Checkout charged me in euros instead of dollars, so my bank added a foreign transaction fee.",
        "Is there a nonprofit or student price for the {plan} plan? The current cost is too much for us.",
        "We would like to pay by bank transfer instead of card from next month. Is that possible?",
        "My free trial was supposed to end without a charge, but I got billed {amount} {when}.",
        "Please turn off auto-renewal and make sure I am not charged again after {date}.",
        "We were billed for the {plan} plan even though we downgraded to {plan2} last month.",
        "Where can I download old invoices? I need every receipt from {year} for my tax return.",
        "The app crashed during checkout and I was charged {amount} anyway with no order. I want a refund.",
        "A prorated charge of {amount} makes no sense, I only added one seat for a few days. Explain the math?",
        "PayPal says my payment to you failed, yet {amount} left my balance {when}. Where did it go?",
        "How much would it cost to add {seats} more users to our {plan} subscription each month?",
        "Can you split our invoice across two cost centers? Accounting rejected the last one.",
        "I keep getting overdue payment reminders although invoice {invoice} was paid on {date}.",
        "charged {amount} for a plan i never signed up for. refund it.",
        "Your pricing page says {amount} a month but my card was charged more. Which one is right?",
        "Please change the billing address on our invoices to our new office before the next cycle.",
        "I was billed {amount} for overage fees this month. What counts as overage on the {plan} plan?",
    ),
    "technical": (
        "The app crashes every time I open the {feature} on my {device}.",
        "I get error {error} whenever I try to save changes in {product}. It started {when}.",
        "Files are not syncing between my {device} and the web app. Changes from {when} are missing.",
        "The {integration} integration stopped working {when}. No new items come through anymore.",
        "The dashboard takes over 30 seconds to load in {browser}, while every other site is fast.",
        "Is there an outage right now? The site shows a {http} error for everyone in our office.",
        "After the latest update {product} will not start for me. It just shows a blank white screen.",
        "The {button} button does nothing when I click it in {browser}, and there is no error message.",
        "Our API calls have returned {http} on and off since {date}, which breaks our nightly import job.",
        "Push notifications stopped arriving on my {device} even though they are enabled in settings.",
        "The CSV export comes out with garbled characters whenever a name has an accent in it.",
        "Uploads larger than {size} MB fail at 99% with error {error}. Smaller files go through.",
        "The calendar view shows every event one hour off since the daylight saving change.",
        "The app drains the battery on my {device} and makes it hot, even in the background.",
        "Search returns nothing for documents I know are there. Reindexing did not help.",
        "Webhooks to our {integration} endpoint arrive hours late. Is something wrong on your side?",
        "The editor freezes when I paste a large table, so I have to reload and I lose my work.",
        "In dark mode most of the text on the {feature} is unreadable in {browser}.",
        "Two-way sync with {integration} creates duplicate records every time it runs.",
        "Shared report links open a blank page for our clients, in both {browser} and {browser2}.",
        "Bulk import stops after {rows} rows with error {error}. The same file worked {when}.",
        "Images will not load in {product} since {date}, just grey boxes everywhere.",
        "Your service has been down for us for {minutes} minutes. Is there a status page I can check?",
        "Autosave is not working. I lost two hours of edits when {browser} closed unexpectedly.",
        "The sign-in page itself throws error {error} in every browser, so nobody on our team can get in.",
        "The payment form never finishes loading in {browser}, the spinner just goes on forever.",
        "Charts on the analytics page show zero for every day since {date}, but the raw data is there.",
        "Keyboard shortcuts stopped working in the desktop app on {desktop} after the update.",
        "Everything is very slow since the last release, each click takes seconds on my {device}.",
        "The {integration} connector keeps timing out with {error} when it pulls more than {rows} records.",
        "app keeps freezing on {device}, have to force quit it like 5 times a day",
        "Scheduled reports have not been emailed out since {date}, though they still show as active.",
    ),
    "account": (
        "I forgot my password and the reset email never arrives. I have checked spam as well.",
        "How do I change the email on my account from my old work address to a personal one?",
        "I lost my phone and cannot get 2FA codes anymore. How do I get back into my account?",
        "Please delete my account and all of my personal data. I no longer use your service.",
        "Can you add {seats} user seats for our team and make {name} {arole} on the workspace?",
        "My account got locked after too many login attempts. Can you unlock it for me?",
        "I want to change my username, but the profile page says it cannot be edited.",
        "{name} has left the company. How do I remove their access and move their projects to me?",
        "How do I turn on two-factor authentication for everyone in our workspace?",
        "I accidentally made two accounts with the same email. Can you merge them into one?",
        "I would like to close my account at the end of the month. What happens to my saved files?",
        "Someone signed into my account from another country {when}. Please help me secure it.",
        "I cannot sign in with Google anymore, it says no account is linked to this address.",
        "Please update the name on my profile, I got married and my last name has changed.",
        "How do I give a colleague view-only access without making them an admin?",
        "The password reset link says it has expired the moment I click on it.",
        "I need to hand over ownership of the workspace to {name} before I leave next week.",
        "My authenticator app was wiped and now none of the codes work. I need help logging in.",
        "How do I change my profile photo? There is no upload option on my settings page.",
        "Why was my account suspended? I never got any explanation or warning email.",
        "We need to change the account owner email because the original {role} has left.",
        "Can my assistant get a separate login so {name} can manage my workspace for me?",
        "I never signed up, but I keep getting account confirmation emails. Please remove my address.",
        "The verification email link does not work, so I cannot activate my new account.",
        "Can you reset 2FA for our user {name}? They got a new phone and are locked out.",
        "I handle the billing here but cannot see the team settings page. Can I get {role} rights?",
        "How do I change my security questions and the recovery phone number on my account?",
        "Is there a way to sign out of all devices at once? I think I stayed logged in at a library.",
        "please deactivate the login for {name}, their last day was {date}.",
        "We want to switch our logins from email and password to single sign-on through our company directory.",
        "{name} is set up as {arole} but should be {arole2}. How do I change their role?",
        "I changed my email {when} and now I cannot log in with either the old or new one.",
    ),
}

_DETAILS: dict[str, tuple[str, ...]] = {
    "billing": (
        "My card ends in {card}.", "The invoice number is {invoice}.",
        "We are on the {plan} plan.", "This is the second month in a row.",
        "I can send the bank statement.", "We pay yearly.",
        "The charge was on {date}.",
    ),
    "technical": (
        "I am on {os}.", "I already cleared the cache and reinstalled.",
        "It happens on my {device} too.", "App version {version}.",
        "Restarting does not help.", "Screenshot available if needed.",
        "Two colleagues see it too.", "Same thing on my other laptop.",
    ),
    "account": (
        "My username is {user}.", "The account is in {name}'s name.",
        "I can verify my identity.", "We have {seats} people on the team.",
        "The email on file is my old one.", "I am the workspace owner.",
    ),
}

# Tone-specific openers and closers; label-neutral by design.
_OPENERS: dict[str, tuple[str, ...]] = {
    "polite": ("Hi there!", "Hello!", "Good morning.", "Hi support team.",
               "Hello, hope you are well.", "Hi, {signer} here."),
    "angry": ("Seriously?", "This is unacceptable.", "I am really fed up.",
              "Third email about this!", "Unbelievable."),
    "terse": ("", "hi.", "Hey."),
    "neutral": ("Hi.", "Hello.", "Quick question.", "Hi team!"),
}
_CLOSERS: dict[str, tuple[str, ...]] = {
    "polite": ("Thanks in advance.", "Thank you for your help!", "Thanks, {signer}",
               "Much appreciated.", "Kind regards, {signer}"),
    "angry": ("Get back to me ASAP.", "I expect an answer today!", "Sort it out or I am leaving.",
              "Really disappointed.", "NOT happy."),
    "terse": ("", "pls advise", "thx", "asap"),
    "neutral": ("Thanks.", "Thank you.", "Let me know.", "Regards, {signer}"),
}
_TONES = ("polite", "polite", "angry", "terse", "neutral", "neutral")

# Templates are written out in full; about half the tickets get contractions.
_CONTRACTIONS = (("cannot", "can't"), ("do not", "don't"), ("does not", "doesn't"),
                 ("did not", "didn't"), ("will not", "won't"), ("is not", "isn't"),
                 ("I am", "I'm"), ("I have", "I've"), ("I would", "I'd"),
                 ("We are", "We're"), ("we are", "we're"), ("There is", "There's"))


def approx_tokens(text: str) -> int:
    """Cheap estimate of the SmolLM2 token count of ``text``.

    Digits count one token each (plus one for a space before a number);
    words count one token, plus one each for being long, an all-caps code,
    CamelCase or a contraction; a run of other symbols counts one. On the texts this
    module builds it is within about 2 tokens of the real count.
    """
    count = 0
    for piece in re.findall(r" ?\d|[A-Za-z]+(?:'[A-Za-z]+)?|[^\sA-Za-z\d]+", text):
        if piece[0].isalpha():
            caps_inside = not piece.isupper() and piece[2:] != piece[2:].lower()
            count += (1 + (len(piece) > 9) + (len(piece) > 2 and piece.isupper())
                      + caps_inside + ("'" in piece))
        else:
            count += 1 + (piece[0] == " ")  # " 7" -> 2, "7" -> 1, "!!" -> 1
    return count


def _typo(text: str, rng: random.Random) -> str:
    """Introduce one small typo (swap, drop or double a letter) in a longer word."""
    words = text.split(" ")
    idx = [i for i, w in enumerate(words) if w.isalpha() and len(w) >= 5]
    if not idx:
        return text
    i = rng.choice(idx)
    w = words[i]
    j = rng.randrange(1, len(w) - 2)
    kind = rng.randrange(3)
    if kind == 0:
        w = w[:j] + w[j + 1] + w[j] + w[j + 2:]
    elif kind == 1:
        w = w[:j] + w[j + 1:]
    else:
        w = w[:j] + w[j] + w[j:]
    words[i] = w
    return " ".join(words)


def _compose(label: str, rng: random.Random) -> tuple[str, int]:
    """Draw one candidate ticket for ``label``.

    Returns the text and the extra tokens to add to :func:`approx_tokens`
    for the noise applied.
    """
    tone = rng.choice(_TONES)
    core = _fill(rng.choice(_CORES[label]), rng)
    if tone == "angry" and core.endswith((".", "?")) and rng.random() < 0.5:
        core = core[:-1] + ("!!" if core.endswith(".") else "??")
    elif core[-1].isalnum() and tone != "terse":
        core += "."
    detail = _fill(rng.choice(_DETAILS[label]), rng) if rng.random() < 0.35 else ""
    # One sender name per ticket, never a name the ticket talks about.
    signer = rng.choice([x for x in _POOLS["name"] if x not in core + detail])
    opener = rng.choice(_OPENERS[tone]) if rng.random() < 0.6 else ""
    closer = rng.choice(_CLOSERS[tone]) if rng.random() < 0.5 else ""
    parts = (opener.replace("{signer}", signer), core, detail,
             closer.replace("{signer}", signer))
    text = " ".join(p for p in parts if p)
    if rng.random() < 0.5:
        for full, short in _CONTRACTIONS:
            text = re.sub(rf"\b{full}\b", short, text)
    extra = 0
    if rng.random() < 0.08:
        text = _typo(text, rng)
        extra += _TYPO_COST
    lower_p = 0.5 if tone == "terse" else 0.06
    if rng.random() < lower_p:
        text = text.lower()
    return text, extra


def generate_tickets(n: int = 600, seed: int = 0) -> list[dict]:
    """Return ``n`` synthetic support tickets, deterministic for ``seed``.

    Each ticket is ``{"id": "t0000", "text": str, "label": str}`` with label in
    :data:`LABELS`. Labels are balanced (``n // 3`` each, the remainder going to
    the first labels of :data:`LABELS`), order is shuffled by the seed and texts
    are unique (short of an ``n`` far beyond the templates' variety). Each
    text is built to be 20-35 SmolLM2 tokens long.
    """
    if n < 0:
        raise ValueError("n must be >= 0")
    rng = random.Random(seed)
    labels = [lab for lab in LABELS for _ in range(n // len(LABELS))]
    labels += list(LABELS[: n % len(LABELS)])
    rng.shuffle(labels)
    lo, hi = _BAND
    seen: set[str] = set()
    tickets = []
    for i, label in enumerate(labels):
        best, best_gap = "", None
        for _ in range(500):
            text, extra = _compose(label, rng)
            if text in seen:
                best = best or text  # used only if every draw is a repeat
                continue
            est = approx_tokens(text) + extra
            gap = max(lo - est, est - hi, 0)
            if best_gap is None or gap < best_gap:
                best, best_gap = text, gap
            if gap == 0:
                break
        seen.add(best)
        tickets.append({"id": f"t{i:04d}", "text": best, "label": label})
    return tickets
