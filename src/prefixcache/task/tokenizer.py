"""A model's tokenizer and chat template read from its files with ``tokenizers`` and jinja2, not transformers.

Importing transformers costs seconds; a tokenizer needs none of it. :func:`load_tokenizer` reads a model
folder's ``tokenizer.json`` (the ``tokenizers`` library's own serialization, which holds the normalizer,
pre-tokenizer, model, post-processor, decoder and added tokens), ``tokenizer_config.json`` (the special
tokens, added tokens missing from ``tokenizer.json``, the chat template), the older
``special_tokens_map.json``, ``chat_template.jinja`` (and ``chat_templates/*.jinja``) and
``generation_config.json`` (the end-of-sequence ids generation stops on). It prepares the backend as
``AutoTokenizer`` prepares it for a folder with a ``tokenizer.json``, call for call: truncation and padding
off, the declared added tokens added again (which can change an existing token's flags) with the special
tokens nobody holds, a post-processor that adds nothing when the file has none.

:class:`LeanTokenizer` answers the part of transformers' tokenizer interface this package uses:
``tokenizer(texts, add_special_tokens=...)["input_ids"]``, ``encode``, ``decode``, ``convert_ids_to_tokens``,
``apply_chat_template``, ``chat_template``, ``backend_tokenizer``, the special tokens and their ids,
``len()`` and ``vocab_size``. ``tests/task/test_tokenizer.py`` holds each equal to ``AutoTokenizer``'s on
the embedded model's tokenizer and on the test suite's tokenizers. Anything else (a slow, Python-only
tokenizer; a folder without ``tokenizer.json``; a model-specific tokenizer class: :func:`reads_verbatim`)
stays with transformers (``model/load.py`` decides).

This module knows nothing about models, tasks or prompts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer
from tokenizers.processors import TemplateProcessing

from .chat_template import render_chat

TOKENIZER_FILE = "tokenizer.json"
# the tokenizer classes that transformers 5 loads from tokenizer.json as it stands (a folder naming none gets
# its model type's class, often a model-specific one)
GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
MISTRAL_TYPES = ("mistral", "ministral", "mixtral", "pixtral", "voxtral", "devstral", "magistral")
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# what transformers' decode strips when ``clean_up_tokenization_spaces`` is on (WordPiece-era detokenization)
_CLEAN_UP = (" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"), (
    " 's", "'s"), (" 've", "'ve"), (" 're", "'re")


@dataclass(frozen=True)
class TokenizerSettings:
    """What a tokenizer folder says besides ``tokenizer.json``.

    ``special``: named special tokens (``bos_token`` ... and model-specific ``*_token`` names) to their text,
    in transformers' order; ``extra_special``: further special tokens; ``chat_template``: one template, a dict
    of named ones, or None; ``generation_eos_ids``: ``generation_config.json``'s ``eos_token_id`` (int or list).
    """

    special: dict[str, str] = field(default_factory=dict)
    extra_special: tuple[str, ...] = ()
    chat_template: str | dict[str, str] | None = None
    clean_up_tokenization_spaces: bool = False
    split_special_tokens: bool = False
    generation_eos_ids: tuple[int, ...] = ()
    name_or_path: str = ""


class LeanTokenizer:
    """A fast tokenizer over a ``tokenizers.Tokenizer`` (``backend_tokenizer``), with transformers' calling
    conventions for the methods this package uses. Thread-safe for encoding and decoding (the backend is);
    ``chat_template`` may be reassigned (tests do)."""

    is_fast = True

    def __init__(self, backend: Tokenizer, settings: TokenizerSettings):
        self._backend = backend
        self.settings = settings
        self.chat_template = settings.chat_template
        self.name_or_path = settings.name_or_path
        self.clean_up_tokenization_spaces = settings.clean_up_tokenization_spaces
        backend.encode_special_tokens = settings.split_special_tokens

    def __repr__(self) -> str:
        return f"LeanTokenizer({self.name_or_path!r}, vocabulary={len(self)})"

    @property
    def backend_tokenizer(self) -> Tokenizer:
        return self._backend

    # ---- the vocabulary and its special tokens

    def __len__(self) -> int:
        """Size of the whole vocabulary, added tokens included (ids run from 0 to ``len - 1``)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        """Size of the base vocabulary, without added tokens."""
        return self._backend.get_vocab_size(with_added_tokens=False)

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """Named special tokens to their text (the names a chat template sees: ``bos_token``, ``eos_token`` ...)."""
        return dict(self.settings.special)

    @property
    def all_special_tokens(self) -> list[str]:
        """Named, then extra special tokens, each once, in that order."""
        return list(dict.fromkeys([*self.settings.special.values(), *self.settings.extra_special]))

    @property
    def all_special_ids(self) -> list[int]:
        return [self.convert_tokens_to_ids(token) for token in self.all_special_tokens]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        """A token's id (the unknown token's for one outside the vocabulary, else None); a list for a list."""
        if isinstance(tokens, str):
            found = self._backend.token_to_id(tokens)
            return found if found is not None else self._special_id("unk_token")
        return [self.convert_tokens_to_ids(token) for token in tokens]

    def convert_ids_to_tokens(self, ids: int | Sequence[int], skip_special_tokens: bool = False) -> str | None | list:
        """A token id's vocabulary entry (a list for a list, special tokens dropped when asked)."""
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        skipped = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._backend.id_to_token(int(i)) for i in ids if int(i) not in skipped]

    def _special_id(self, name: str) -> int | None:
        token = self.settings.special.get(name)
        return None if token is None else self._backend.token_to_id(token)

    bos_token = property(lambda self: self.settings.special.get("bos_token"))
    eos_token = property(lambda self: self.settings.special.get("eos_token"))
    unk_token = property(lambda self: self.settings.special.get("unk_token"))
    pad_token = property(lambda self: self.settings.special.get("pad_token"))
    bos_token_id = property(lambda self: self._special_id("bos_token"))
    eos_token_id = property(lambda self: self._special_id("eos_token"))
    unk_token_id = property(lambda self: self._special_id("unk_token"))
    pad_token_id = property(lambda self: self._special_id("pad_token"))

    @property
    def generation_eos_ids(self) -> tuple[int, ...]:
        """``generation_config.json``'s end-of-sequence ids (empty when the folder has none)."""
        return self.settings.generation_eos_ids

    # ---- encoding and decoding

    def __call__(self, text: str | Sequence[str], add_special_tokens: bool = True) -> dict[str, list]:
        """``{"input_ids": ..., "attention_mask": ...}`` of one text (lists of ints) or of a list of texts
        (lists of lists), never padded or truncated."""
        if isinstance(text, str):
            ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
            return {"input_ids": ids, "attention_mask": [1] * len(ids)}
        encodings = self._backend.encode_batch(list(text), add_special_tokens=add_special_tokens)
        ids = [e.ids for e in encodings]
        return {"input_ids": ids, "attention_mask": [[1] * len(row) for row in ids]}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def add_tokens(self, tokens: Sequence[str | AddedToken], special_tokens: bool = False) -> int:
        """Add tokens to the vocabulary (as transformers' ``add_tokens``); returns how many were new."""
        tokens = [t if isinstance(t, AddedToken) else AddedToken(t, special=special_tokens) for t in tokens]
        if special_tokens:
            return self._backend.add_special_tokens(tokens)
        return self._backend.add_tokens(tokens)

    def decode(self, ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of ``ids``; transformers' space clean-up only where the folder asks for it and the
        model is not BPE (transformers skips it for BPE, where it would corrupt the text)."""
        ids = [ids] if isinstance(ids, int) else [int(i) for i in ids]
        text = self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        if self.clean_up_tokenization_spaces and type(self._backend.model).__name__ != "BPE":
            for spaced, tight in _CLEAN_UP:
                text = text.replace(spaced, tight)
        return text

    # ---- chat templates

    def apply_chat_template(
        self,
        conversation: Sequence[Any],
        tools: Sequence[Mapping] | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        chat_template: str | None = None,
        return_dict: bool = True,
        **kwargs,
    ):
        """``conversation`` rendered by the chat template, as ``AutoTokenizer.apply_chat_template`` renders it.

        The template sees the messages, ``tools``, ``add_generation_prompt``, the special tokens by name and
        ``kwargs`` (which win). Returns the text when ``tokenize`` is false; else its tokens, without special
        tokens added: ``{"input_ids", "attention_mask"}`` (``return_dict``) or the list of ids.

        Raises:
            ValueError: no chat template, an unnamed choice among several, or an empty conversation.
            jinja2.TemplateError: the template refuses the conversation.
        """
        if not conversation:
            raise ValueError("cannot apply a chat template to an empty conversation; give at least one message")
        source = self._template(chat_template, tools)
        text = render_chat(source, conversation, add_generation_prompt, tools, kwargs.pop("documents", None),
                           {**self.settings.special, **kwargs})
        if not tokenize:
            return text
        encoded = self(text, add_special_tokens=False)
        return encoded if return_dict else encoded["input_ids"]

    def _template(self, name_or_source: str | None, tools) -> str:
        templates = self.chat_template
        if isinstance(templates, dict):
            if name_or_source is not None:
                return templates.get(name_or_source, name_or_source)
            if tools is not None and "tool_use" in templates:
                return templates["tool_use"]
            if "default" in templates:
                return templates["default"]
            raise ValueError(f"this tokenizer has several chat templates and none is the default: name one of {sorted(templates)}")
        if name_or_source is not None:
            return name_or_source
        if not templates:
            raise ValueError("this tokenizer has no chat template")
        return templates


def reads_verbatim(folder: str | Path) -> bool:
    """Whether :func:`load_tokenizer` gives ``folder`` the tokenizer ``AutoTokenizer`` gives it.

    It does when the folder holds a ``tokenizer.json`` and its config names the generic tokenizer class
    (:data:`GENERIC_CLASSES`), with no tokenizer code of its own (``auto_map``), and the model is not of the
    Mistral family (whose loading transformers patches or reroutes to ``mistral-common``). Transformers 5
    rebuilds a model-specific class (``Qwen2Tokenizer``, ``LlamaTokenizer`` ...) from the file's vocabulary
    and merges with the class's own pipeline and default special tokens, so those folders stay with it.
    """
    folder = Path(folder)
    if not (folder / TOKENIZER_FILE).is_file():
        return False
    try:
        config = _read_json(folder / "tokenizer_config.json")
        model_type = str(_read_json(folder / "config.json").get("model_type", ""))
    except (OSError, ValueError):
        return False
    generic = config.get("tokenizer_class") in GENERIC_CLASSES and not config.get("auto_map")
    return generic and not model_type.startswith(MISTRAL_TYPES)


def load_tokenizer(folder: str | Path) -> LeanTokenizer:
    """The tokenizer of the model folder ``folder`` (see the module docstring for the files read).

    Raises:
        OSError: ``folder`` has no ``tokenizer.json``, or a file cannot be read.
        ValueError: a file is not valid JSON or not a tokenizer serialization.
    """
    folder = Path(folder)
    backend = Tokenizer.from_file(str(folder / TOKENIZER_FILE))
    config = _read_json(folder / "tokenizer_config.json")
    special, extra, declared = _special_tokens(config, folder, backend)
    settings = TokenizerSettings(
        special={name: _content(token) for name, token in special.items()},
        extra_special=tuple(_content(token) for token in extra),
        chat_template=_chat_template(folder, config),
        clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
        split_special_tokens=bool(config.get("split_special_tokens", False)),
        generation_eos_ids=_eos_ids(_read_json(folder / "generation_config.json").get("eos_token_id")),
        name_or_path=str(folder),
    )
    _prepare_backend(backend, declared, [*special.values(), *extra])
    return LeanTokenizer(backend, settings)


def _prepare_backend(backend: Tokenizer, declared: list[dict], special: list) -> None:
    """What transformers 5 does to a ``tokenizer.json`` backend on load, call for call: truncation and padding
    off; one ``add_tokens`` of every declared added token, in id order (the library may update an existing
    token's flags), then of each special token that neither the backend nor the declared ones hold, a special
    token's text marking its entry special; a post-processor that adds nothing when the file has none."""
    backend.no_truncation()
    backend.no_padding()
    known = {token.content for token in backend.get_added_tokens_decoder().values()} | {t["content"] for t in declared}
    queue = list(declared)
    for token in special:
        if _content(token) not in known and token not in queue:
            queue.append(token)
    special_texts = {_content(token) for token in special}
    if queue:
        backend.add_tokens([_added(t, special=True if _content(t) in special_texts else None) for t in queue])
    if backend.post_processor is None:  # transformers installs one that adds nothing (no bos/eos here)
        backend.post_processor = TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])


def _special_tokens(config: dict, folder: Path, backend: Tokenizer) -> tuple[dict[str, Any], list[Any], list[dict]]:
    """Named special tokens (standard names first, then model-specific ``*_token`` names), extra special
    tokens, and the declared added tokens (the config's ``added_tokens_decoder``; in the older layout without
    one, ``tokenizer.json``'s own, with the special tokens in ``special_tokens_map.json``), in id order.
    A token is its text or a dict of its ``AddedToken`` properties."""
    values = dict(config)
    if "added_tokens_decoder" in config:
        declared = [dict(token) for _, token in sorted(config["added_tokens_decoder"].items(), key=lambda p: int(p[0]))]
    else:
        for key, value in _read_json(folder / "special_tokens_map.json").items():
            values[key] = {**value, "special": True} if isinstance(value, dict) else value
        declared = [_properties(token) for _, token in sorted(backend.get_added_tokens_decoder().items())]
    extra = values.get("extra_special_tokens", values.get("additional_special_tokens")) or []
    named = {name: values[name] for name in SPECIAL_NAMES if values.get(name) is not None}
    model_specific = {
        key: value for key, value in values.items()
        if key.endswith("_token") and key not in SPECIAL_NAMES and isinstance(value, (str, dict)) and value
    }
    if isinstance(extra, dict):  # named extra tokens are model-specific names too
        model_specific.update(extra)
        extra = []
    return {**named, **model_specific}, list(extra), declared


def _chat_template(folder: Path, config: dict) -> str | dict[str, str] | None:
    """``chat_template.jinja`` and ``chat_templates/*.jinja`` when present, else the config's template(s)."""
    templates = {}
    if (folder / "chat_template.jinja").is_file():
        templates["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    for path in sorted((folder / "chat_templates").glob("*.jinja")):
        templates[path.stem] = path.read_text(encoding="utf-8")
    if templates:
        return templates["default"] if list(templates) == ["default"] else templates
    configured = config.get("chat_template")
    if isinstance(configured, (list, tuple)):
        return {entry["name"]: entry["template"] for entry in configured}
    return configured


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as fh:
        return json.load(fh)


def _content(token: str | dict) -> str:
    return token["content"] if isinstance(token, dict) else str(token)


_FLAGS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")


def _added(token: str | dict, special: bool | None = None) -> AddedToken:
    """An ``AddedToken`` from a config entry (text, or a dict of its properties); ``special``: force the flag."""
    if isinstance(token, str):
        return AddedToken(token, special=bool(special), normalized=not special)
    props = {k: v for k, v in token.items() if k in _FLAGS}
    if special is not None:
        props["special"] = special
    return AddedToken(**props)


def _properties(token: AddedToken) -> dict:
    return {k: getattr(token, k) for k in _FLAGS}


def _eos_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return (int(value),) if isinstance(value, int) else tuple(int(v) for v in value)
