"""Shared fixtures: a tiny BPE tokenizer with a chat template and tiny random Llama/Qwen2 models, all built in-process.

Nothing here touches the network or the disk outside pytest's tmp dirs, so these
tests run from a plain clone in seconds.
"""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, PreTrainedTokenizerFast, Qwen2Config

from prefixcache.model.load import LoadedModel, build_random_model
from prefixcache.task.definition import parse_task
from prefixcache.task.tokenizer import LeanTokenizer, load_tokenizer

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = [
    "Ticket: I was charged twice for my subscription, please refund the extra payment.",
    "Ticket: The app crashes every time I open the settings page on Android.",
    "Ticket: I cannot log in, the password reset email never arrives.",
    "Classify the customer support ticket into billing, technical or account.",
    "billing technical account invoice refund error crash login password email",
    "Categories: billing: money. technical: bugs. account: access.",
]

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


def make_tokenizer(vocab_size: int = 400) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained in-process, with ChatML special tokens and template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    return fast


def tiny_config(arch: str, vocab: int):
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,
        tie_word_embeddings=True,
    )
    if arch == "llama":
        return LlamaConfig(**common)
    return Qwen2Config(**common, rope_theta=1e6, use_sliding_window=False)


def tiny_loaded(arch: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> LoadedModel:
    tokenizer = make_tokenizer()
    model = build_random_model(tiny_config(arch, len(tokenizer)), dtype=dtype, seed=seed)
    return LoadedModel(model, tokenizer, f"tiny-{arch}", f"tiny-{arch}-seed{seed}", dtype, torch.device("cpu"))


def save_tiny_model(tmp_path_factory, arch: str = "qwen2", loaded: LoadedModel | None = None) -> str:
    """Save a tiny model and its tokenizer to a fresh folder, usable as ``--model``; returns the folder."""
    loaded = loaded or tiny_loaded(arch)
    folder = tmp_path_factory.mktemp(f"{loaded.spec}-model")
    loaded.model.save_pretrained(folder)
    loaded.tokenizer.save_pretrained(folder)
    return str(folder)


def lean_tokenizer(hf_tokenizer: PreTrainedTokenizerFast, folder) -> LeanTokenizer:
    """``hf_tokenizer`` saved to ``folder`` and read back by prefixcache's own loader (no transformers)."""
    hf_tokenizer.save_pretrained(folder)
    return load_tokenizer(folder)


@pytest.fixture(scope="session", params=["transformers", "lean"])
def tokenizer(request, tmp_path_factory):
    """The tiny tokenizer as transformers loads it, and as :mod:`prefixcache.task.tokenizer` reads it from
    its saved files: tests of tokenization and prompts run on both."""
    if request.param == "transformers":
        return make_tokenizer()
    return lean_tokenizer(make_tokenizer(), tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny(request) -> LoadedModel:
    return tiny_loaded(request.param)


@pytest.fixture(scope="session")
def tiny_llama() -> LoadedModel:
    return tiny_loaded("llama")


@pytest.fixture(scope="session")
def task():
    return parse_task(TASK_YAML, "tiny.yaml")


@pytest.fixture
def texts():
    return list(TEXTS)


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
