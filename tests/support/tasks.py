"""The tiny tasks and records the tests share: a three-label ticket classifier (with and without an example
pool), a two-field extraction task, and ticket texts of every length (the empty one included)."""

TASK_YAML = """\
name: tiny-tickets
instruction: Classify the customer support ticket.
labels:
  billing: invoices, charges and refunds
  technical: bugs, errors and crashes
  account: login, password and profile
examples:
  - text: I was charged twice this month
    label: billing
  - text: The app crashes on start
    label: technical
  - text: I cannot reset my password
    label: account
input_template: "Ticket: {text}"
"""

LABELS = ["billing", "technical", "account"]

# TASK_YAML with a pool of nine more examples (three per label), for example selection
POOL_YAML = TASK_YAML + """\
example_pool:
  - text: Please refund the second charge
    label: billing
  - text: The invoice shows the wrong amount
    label: billing
  - text: My card was declined at checkout
    label: billing
  - text: Sync fails with a timeout error
    label: technical
  - text: The export button does nothing
    label: technical
  - text: Pages load very slowly today
    label: technical
  - text: I want to close my profile
    label: account
  - text: How do I turn on two-factor login
    label: account
  - text: Change the email on my login
    label: account
"""

# a tiny extraction task (kind: extract) over the same tickets
EXTRACT_YAML = """\
name: tiny-fields
kind: extract
instruction: Extract the fields from the support ticket.
fields:
  product: the product the ticket is about
  sentiment: positive, neutral or negative
examples:
  - text: I was charged twice this month
    fields: {product: null, sentiment: negative}
  - text: The app crashes on start
    fields: {product: app, sentiment: negative}
input_template: "Ticket: {text}"
max_new_tokens: 10
"""

TEXTS = [
    "refund my money now",
    "the export button throws error 500 when I click it twice",
    "hi",
    "I changed my email and now I cannot log in to my account at all, help",
    "crash",
    "Why was my card billed $49.99 on March 3rd?",
    "password",
    "Ticket stuck: sync fails with timeout after the latest update on iOS 17",
    "",
]
