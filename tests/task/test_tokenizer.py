"""prefixcache's own tokenizer (``task/tokenizer.py``, ``task/chat_template.py``) gives exactly what
``AutoTokenizer`` gives for the same folder: the backend it prepares, the special tokens, encoding with and
without special tokens, decoding, ``convert_ids_to_tokens`` and chat templates, on random text and random
conversations. The folders are the test suite's tokenizers (saved as transformers saves them, some with
configs edited to exercise added tokens, older files and named templates) and the embedded model's."""

from __future__ import annotations

import json
import logging

import jinja2
import pytest
from hypothesis import given, settings, strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from tests.support.models import CHATML, CORPUS, make_tokenizer
from tests.support.tasks import TASK_YAML
from prefixcache.task.prompt import build_prompt
from prefixcache.task.tokenizer import LeanTokenizer, load_tokenizer, reads_verbatim

MARKUP = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_", "im_end|>", "<tool>", "<img>", "word", " word",
          "Ticket", "URGENT", "\n", " ", "  ", "\t", "\r\n", "\u00a0", "e\u0301", "\ufb01", "日本", "🙂", "<b>", "&amp;"]
texts = st.lists(st.one_of(st.text(max_size=10), st.sampled_from(MARKUP)), max_size=10).map("".join)
ROLES = ["system", "user", "assistant"]
conversations = st.lists(st.tuples(st.sampled_from(ROLES), texts), min_size=1, max_size=5).map(
    lambda turns: [{"role": role, "content": content} for role, content in turns])


def _reaching(tok):
    tok.add_tokens(["<|im_start|>user\nTicket: URGENT"], special_tokens=True)


def _word(tok):
    tok.add_tokens([AddedToken("Ticket", single_word=True)])


def _nfc(tok):
    tok.backend_tokenizer.normalizer = normalizers.NFC()


def _configured(folder):
    """Added tokens only the config declares, extra and model-specific special tokens, a bos token written
    as an AddedToken dict, and two named chat templates in the config."""
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"] = {
        "400": {"content": "<tool>", "lstrip": False, "rstrip": False, "normalized": False, "single_word": False, "special": True},
        "401": {"content": "word", "lstrip": True, "rstrip": False, "normalized": True, "single_word": False, "special": False},
    }
    config["additional_special_tokens"] = ["<tool>", "<extra>"]
    config["bos_token"] = {"__type": "AddedToken", "content": "<s>", "lstrip": False, "rstrip": False,
                           "normalized": False, "single_word": False, "special": True}
    config["image_token"] = "<img>"
    config["chat_template"] = [{"name": "default", "template": CHATML},
                               {"name": "tool_use", "template": "{{ bos_token }}{{ tools | tojson }}" + CHATML}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink()  # the file would take priority over the config's templates


def _legacy(folder):
    """Special tokens in ``special_tokens_map.json`` (no ``added_tokens_decoder`` in the config)."""
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("eos_token")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "special_tokens_map.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "additional_special_tokens": ["<x1>"],
        "eos_token": {"content": "<|im_end|>", "lstrip": False, "rstrip": False, "normalized": False, "single_word": False}}))


def _reflagged(folder):
    """The config declares tokenizer.json's added tokens again with other flags (transformers re-adds them)."""
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"] = {
        "2": {"content": "<|im_end|>", "lstrip": False, "rstrip": True, "normalized": False, "single_word": False, "special": True},
        "0": {"content": "<|endoftext|>", "lstrip": False, "rstrip": False, "normalized": False, "single_word": False, "special": False},
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def _plain_eos(folder, legacy: bool = False):
    """tokenizer.json holds the eos token as a plain (not special) added token that strips on its left."""
    serialized = json.loads((folder / "tokenizer.json").read_text())
    for token in serialized["added_tokens"]:
        if token["content"] == "<|im_end|>":
            token.update(special=False, lstrip=True)
    (folder / "tokenizer.json").write_text(json.dumps(serialized))
    if legacy:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config.pop("added_tokens_decoder", None)
        (folder / "tokenizer_config.json").write_text(json.dumps(config))


def _no_post_processor(folder):
    serialized = json.loads((folder / "tokenizer.json").read_text())
    serialized["post_processor"] = None
    (folder / "tokenizer.json").write_text(json.dumps(serialized))


def make_wordpiece() -> PreTrainedTokenizerFast:
    """A WordPiece tokenizer that asks for transformers' space clean-up when decoding (which BPE never gets)."""
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(CORPUS * 20, trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]", "[SEP]", "[CLS]"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]", cls_token="[CLS]",
                                   clean_up_tokenization_spaces=True)
    fast.chat_template = CHATML
    return fast


# name -> (a change to the tokenizer before saving, a change to the saved folder)
VARIANTS = {
    "tiny": (None, None),
    "reaching": (_reaching, None),
    "single-word": (_word, None),
    "nfc": (_nfc, None),
    "configured": (None, _configured),
    "legacy": (None, _legacy),
    "reflagged": (None, _reflagged),
    "plain-eos": (None, _plain_eos),
    "plain-eos-legacy": (None, lambda folder: _plain_eos(folder, legacy=True)),
    "no-post-processor": (None, _no_post_processor),
    "wordpiece": (None, None),
}


def embedded_folder():
    from prefixcache.model.load import local_source

    return local_source("smollm2-135m")[0]


@pytest.fixture(scope="module", params=[*VARIANTS, pytest.param("embedded", marks=pytest.mark.embedded)])
def pair(request, tmp_path_factory) -> tuple[PreTrainedTokenizerFast, LeanTokenizer]:
    """(AutoTokenizer's tokenizer, prefixcache's) of one folder."""
    if request.param == "embedded":
        folder = embedded_folder()
    else:
        before, after = VARIANTS[request.param]
        tok = make_wordpiece() if request.param == "wordpiece" else make_tokenizer()
        if before:
            before(tok)
        folder = tmp_path_factory.mktemp(request.param)
        tok.save_pretrained(folder)
        if after:
            after(folder)
    return AutoTokenizer.from_pretrained(folder), load_tokenizer(folder)


def test_the_backend_and_special_tokens_are_autotokenizers(pair):
    hf, lean = pair
    assert json.loads(lean.backend_tokenizer.to_str()) == json.loads(hf.backend_tokenizer.to_str())
    for name in ("special_tokens_map", "all_special_tokens", "all_special_ids", "bos_token_id", "eos_token_id",
                 "pad_token_id", "unk_token_id", "vocab_size", "chat_template", "is_fast"):
        assert getattr(lean, name) == getattr(hf, name), name
    assert len(lean) == len(hf)


@settings(max_examples=250, deadline=None)
@given(text=texts, other=texts)
def test_encoding_is_autotokenizers(pair, text, other):
    hf, lean = pair
    for special in (True, False):
        assert lean(text, add_special_tokens=special)["input_ids"] == hf(text, add_special_tokens=special)["input_ids"]
        assert lean([text, other], add_special_tokens=special)["input_ids"] == hf([text, other], add_special_tokens=special)["input_ids"]
    assert lean.encode(text) == hf.encode(text)
    ids = hf.encode(text)
    assert lean.decode(ids) == hf.decode(ids)
    assert lean.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


@settings(max_examples=250, deadline=None)
@given(data=st.data())
def test_decoding_any_ids_is_autotokenizers(pair, data):
    hf, lean = pair
    ids = data.draw(st.lists(st.integers(0, len(hf) - 1), max_size=12))
    for skip in (False, True):
        assert lean.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
        assert lean.convert_ids_to_tokens(ids, skip_special_tokens=skip) == hf.convert_ids_to_tokens(ids, skip_special_tokens=skip)
    if ids:
        assert lean.convert_ids_to_tokens(ids[0]) == hf.convert_ids_to_tokens(ids[0])
        assert lean.decode(ids[0]) == hf.decode(ids[0])


@settings(max_examples=150, deadline=None)
@given(conversation=conversations)
def test_chat_templates_render_as_autotokenizers(pair, conversation):
    hf, lean = pair
    for generation in (False, True):
        ours = lean.apply_chat_template(conversation, tokenize=False, add_generation_prompt=generation)
        assert ours == hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=generation)
        ids = lean.apply_chat_template(conversation, add_generation_prompt=generation)["input_ids"]
        assert ids == hf.apply_chat_template(conversation, add_generation_prompt=generation)["input_ids"]
        assert lean.apply_chat_template(conversation, return_dict=False) == hf.apply_chat_template(conversation, return_dict=False)


def test_the_task_prompt_is_the_same_with_either_tokenizer(pair):
    """The prefix, its healed boundary, its restart point and the label tokens: all of invariant 3's inputs."""
    from prefixcache.errors import PromptError
    from prefixcache.task.definition import parse_task

    hf, lean = pair
    task = parse_task(TASK_YAML, "tiny.yaml")
    outcomes = []
    for tok in (hf, lean):
        try:
            outcomes.append(build_prompt(task, tok))
        except PromptError as exc:  # the WordPiece variant lowercases and splits the template's markup
            outcomes.append(str(exc))
    assert outcomes[0] == outcomes[1]


# Every feature transformers gives templates: namespaces, loop controls, the generation block, tojson's
# options, dict(), strftime_now, the special tokens by name, tools, caller variables, reasoning names.
FEATURES = """{%- set ns = namespace(n=0, last='') -%}
{{ bos_token }}{{ eos_token }}[{{ strftime_now('%Y') | length }}]{{ tools | tojson(indent=2) }}
{%- for m in messages %}{% if loop.index > 3 %}{% break %}{% endif %}{% set ns.n = ns.n + 1 %}
<{{ m.role }}>{% generation %}{{ m.content | tojson }}{% endgeneration %}{{ m.reasoning_content | default('') }}
{%- if m.thinking is defined %}/{{ m.thinking }}{% endif %}{{ dict(a=1, b=[m.role]) | tojson(sort_keys=True) }}
{%- endfor %}{{ ns.n }} {{ extra_flag }} {{ add_generation_prompt }}"""


@settings(max_examples=60, deadline=None)
@given(conversation=conversations, reasoning=st.one_of(st.none(), texts))
def test_template_features_render_as_autotokenizers(pair, conversation, reasoning):
    hf, lean = pair
    conversation = [dict(m) for m in conversation]
    conversation[-1]["reasoning"] = reasoning  # None is dropped; text is offered as reasoning_content and thinking
    tools = [{"type": "function", "function": {"name": "refund", "parameters": {"amount": "<€ & \"x\">"}}}]
    args = dict(chat_template=FEATURES, tools=tools, tokenize=False, extra_flag="on", add_generation_prompt=True)
    assert lean.apply_chat_template(conversation, **args) == hf.apply_chat_template(conversation, **args)


@pytest.mark.parametrize("template", [
    "{{ raise_exception('only user and assistant roles are supported') }}",
    "{% set ns = namespace(_secret=1) %}",
    "{{ messages.append(1) }}",
    "{{ messages.__class__ }}{{ ''.__class__.__mro__ }}",
])
def test_templates_fail_as_under_autotokenizer(pair, template):
    """What a template may not do (raise, store underscore names, change its inputs, reach internals)
    fails the same way under both (the same error type; the template's own message unchanged)."""
    hf, lean = pair
    conversation = [{"role": "user", "content": "hi"}]
    outcomes = []
    for tok in (hf, lean):
        try:
            outcomes.append(("ok", tok.apply_chat_template(conversation, chat_template=template, tokenize=False)))
        except jinja2.TemplateError as exc:
            outcomes.append((type(exc).__name__, str(exc)))
    assert outcomes[0][0] == outcomes[1][0]
    if "raise_exception" in template or outcomes[0][0] == "ok":
        assert outcomes[0] == outcomes[1], "the template's own message (or output) comes through unchanged"
    assert template.startswith("{{ messages.__") or outcomes[0][0] != "ok", "each of these must be refused"


def test_named_templates_are_chosen_as_autotokenizer_chooses(tmp_path):
    """A config with a ``default`` and a ``tool_use`` template: tools pick ``tool_use``."""
    make_tokenizer().save_pretrained(tmp_path)
    _configured(tmp_path)
    hf, lean = AutoTokenizer.from_pretrained(tmp_path), load_tokenizer(tmp_path)
    conversation = [{"role": "user", "content": "refund"}]
    for tools in (None, [{"name": "refund"}]):
        ours = lean.apply_chat_template(conversation, tools=tools, tokenize=False)
        assert ours == hf.apply_chat_template(conversation, tools=tools, tokenize=False)
    assert ours.startswith('<s>[{"name"')
    with pytest.raises(ValueError, match="empty conversation"):
        lean.apply_chat_template([], tokenize=False)


def test_grammar_engine_sees_the_same_tokenizer(pair):
    """Constrained decoding reads the tokenizer's serialization: the lean tokenizer's view tokenizes as the
    view llguidance builds through transformers."""
    import llguidance.hf

    from prefixcache.engine.constraint import grammar_tokenizer
    from prefixcache.errors import ConstraintError

    hf, lean = pair
    eos = hf.eos_token_id or 0
    try:
        theirs = llguidance.hf.from_tokenizer(hf, eos_token=[eos])
    except ValueError:  # the WordPiece decoder: neither view can be built, and ours says so as a domain error
        with pytest.raises(ConstraintError, match="cannot be constrained"):
            grammar_tokenizer(lean, frozenset({eos}))
        return
    ours = grammar_tokenizer(lean, frozenset({eos}))
    assert ours.vocab_size == theirs.vocab_size and ours.eos_tokens == theirs.eos_tokens
    for text in ["Ticket: refund", " {\"a\": 1}", "日本 🙂", "<|im_end|>", ""]:
        assert ours.tokenize_str(text) == theirs.tokenize_str(text)


def test_the_model_loader_reads_generic_folders_itself_and_leaves_the_rest_to_transformers(tmp_path, caplog):
    from prefixcache.model.load import tokenizer_of

    generic = tmp_path / "generic"
    make_tokenizer().save_pretrained(generic)
    with caplog.at_level(logging.INFO, logger="prefixcache.model.load"):
        assert isinstance(tokenizer_of(str(generic)), LeanTokenizer)
    assert "without transformers" in caplog.text
    for name, change in [("gpt2", {"tokenizer_class": "GPT2Tokenizer"}), ("remote", {"auto_map": {"AutoTokenizer": ["x.Y", None]}})]:
        folder = tmp_path / name
        make_tokenizer().save_pretrained(folder)
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, **change}))
        assert not reads_verbatim(folder), name
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="prefixcache.model.load"):
        assert not isinstance(tokenizer_of(str(tmp_path / "gpt2")), LeanTokenizer)
    assert "AutoTokenizer" in caplog.text
    (generic / "config.json").write_text(json.dumps({"model_type": "mistral"}))
    assert not reads_verbatim(generic), "a Mistral model's tokenizer is patched by transformers"
    (generic / "tokenizer.json").unlink()
    assert not reads_verbatim(generic)


@pytest.mark.embedded
def test_the_embedded_model_loads_the_lean_tokenizer_and_its_generation_ends():
    from prefixcache.model.load import load_model_tokenizer

    tokenizer = load_model_tokenizer("smollm2-135m")
    assert isinstance(tokenizer, LeanTokenizer)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
