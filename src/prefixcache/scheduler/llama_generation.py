"""The engine loop's generating rows on llama.cpp: a :class:`~prefixcache.scheduler.generation.GenerationBackend`.

llama.cpp decodes from the ``.gguf``'s own quantized blocks (:class:`~prefixcache.model.llama_cpp.LlamaCpp`), so a
step reads a quarter of the bytes torch's float32 weights take; the engine loop keeps everything else: the
schedule, cancellation, fairness, sampling, the answer schema, copy fields and stop strings run on the logits this
backend returns, exactly as on torch's.

Sequence ids of the one context:

* ``0 .. rows-1`` are rows: a generating sequence's slot is its row's sequence id;
* ``rows .. sequences-1`` are holders: a prefix is decoded once into a holder (keyed by its token ids), and a row
  admitted onto it is copied from it (:meth:`LlamaCpp.copy_sequence`: its cells are shared, not copied). A holder
  no row reads is dropped, oldest first, when a new prefix needs its id or its cells.

Cells: a row reserves its ``own_tokens`` (its ids and every generated token but the last) when it is admitted, a
holder its prefix's length, and the total never passes the context's cells; a row that cannot fit waits, and one
that could never fit beside its prefix fails alone (:class:`~prefixcache.errors.SequenceTooLongError`).

With a :class:`~prefixcache.scheduler.torch_prefill.TorchPrefill` (``prefill``: the default where the model's
cells can be written), a holder is not decoded: the torch prefix's own keys and values are placed in it, so a tuned
prefix (keys and values that are not its tokens') runs here as it does on torch, and a holder is found by its
prefix's tensors, not only its tokens. With ``prompts_on_torch`` new rows' prompt tokens are computed on torch too
(see :meth:`LlamaGeneration.feed`).

A row's final-layer state at its last prompt token (what a fitted field head reads) exists where torch computed its
prompt; a caller that needs every row's sets ``states`` (:meth:`~prefixcache.scheduler.extract.Extractor.use_backend`
does, for fitted field heads). Without a prefill there is none (:meth:`LlamaGeneration.state` is None). Results are not batch-invariant
(llama.cpp's kernels quantize activations per block): its agreement with torch is measured, not proved.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Sequence as Seq

import numpy as np
import torch

from ..cache.kv import PrefixKV
from ..cache.slots import Feed
from ..errors import SequenceTooLongError
from ..model.llama_cpp import LlamaCpp
from .sequence import Sequence
from .torch_prefill import Prefilled, TorchPrefill

HolderKey = tuple  # (prefix token ids, the prefix's identity or None): see LlamaGeneration._key
PREFILL_TOKENS = 16  # new rows' tokens in one step from which they run on torch (with a prefill; see feed)


class LlamaGeneration:
    """Generating rows in one llama.cpp context (see the module docstring): ``rows`` row ids, the rest holders."""

    name = "llama.cpp"

    def __init__(self, llama: LlamaCpp, rows: int, prefill: TorchPrefill | None = None, prompts_on_torch: bool = False):
        if not 0 < rows < llama.shape.sequences:
            raise ValueError(f"rows must leave at least one holder id of {llama.shape.sequences}: {rows}")
        self.llama, self.rows, self.prefill = llama, rows, prefill
        self.prompts_on_torch = prompts_on_torch and prefill is not None
        self.states = False  # every row's prompt on torch, whatever its length, for its state (set by a caller)
        self.holders: OrderedDict[HolderKey, int] = OrderedDict()  # a prefix's key -> its holder id, oldest first
        self._alive: dict[HolderKey, weakref.ref] = {}  # (with a prefill) the held prefix's first key tensor
        self.readers: dict[int, int] = {}  # holder id -> rows reading it
        self.reserved: dict[int, tuple[int, int | None]] = {}  # row id -> (cells it reserved, its holder or None)
        self.tokens_decoded = 0  # every token llama.cpp decoded (prefixes and rows)
        self.tokens_prefilled = 0  # rows' prompt tokens computed on torch instead (``prefill``)

    @property
    def cells_used(self) -> int:
        """Cells reserved: every holder's prefix and every row's own tokens."""
        return sum(len(key[0]) for key in self.holders) + sum(cells for cells, _ in self.reserved.values())

    def take(self, seq: Sequence) -> int | None:
        """A row for ``seq``, copied from its prefix's holder (decoded now if it is not held), or None: it waits.

        Raises:
            SequenceTooLongError: ``seq``'s own tokens and its prefix can never fit in the context's cells.
        """
        tokens, need, cells = seq.prefix.token_ids, seq.own_tokens, self.llama.shape.cells
        if need + len(tokens) > cells:
            raise SequenceTooLongError(
                f"{len(seq.ids)} tokens of its own and up to {need - len(seq.ids)} generated, after a {len(tokens)}-"
                f"token prefix, do not fit llama.cpp's {cells}-cell context; shorten it or lower max_new_tokens")
        free = [row for row in range(self.rows) if row not in self.reserved]
        key = self._key(seq.prefix)
        holder = self.holders.get(key) if tokens else None
        if not free or not self._room(need + (0 if holder is not None or not tokens else len(tokens)), key):
            return None
        if tokens and holder is None:
            holder = self._hold(seq.prefix)
            if holder is None:
                return None
        row = free[0]
        if holder is not None:
            self.holders.move_to_end(key)
            self.readers[holder] = self.readers.get(holder, 0) + 1
            self.llama.copy_sequence(holder, row)
        self.reserved[row] = (need, holder)
        return row

    def _key(self, prefix: PrefixKV) -> HolderKey:
        """What a holder of ``prefix`` is found by. Decoded from its tokens (no prefill), a holder serves any prefix of
        those tokens; placed from its keys and values, it serves that prefix alone (a tuned prefix shares its
        prompt's tokens, not its cells), so it is found by the prefix's tensors as well. A holder whose prefix's
        tensors were freed (a pool's eviction) is dropped, so a new tensor at the same address never finds it."""
        if self.prefill is None:
            return prefix.token_ids, None
        key = (prefix.token_ids, id(prefix.keys[0]))
        alive = self._alive.get(key)
        if alive is not None and alive() is None:  # the held prefix was freed; this is another at its address
            self._drop_holder(key)
        return key

    def _room(self, cells: int, keep: HolderKey) -> bool:
        """Whether ``cells`` more fit, dropping holders no row reads (oldest first, never ``keep``) to make room."""
        limit = self.llama.shape.cells
        for key in list(self.holders):
            if self.cells_used + cells <= limit:
                break
            if key != keep and not self.readers.get(self.holders[key]):
                self._drop_holder(key)
        return self.cells_used + cells <= limit

    def _hold(self, prefix: PrefixKV) -> int | None:
        """``prefix`` in a free holder id (dropping an unread holder for one): its keys and values placed there with a
        ``prefill``, else its tokens decoded; None: every id is read."""
        tokens = prefix.token_ids
        ids = set(range(self.rows, self.llama.shape.sequences)) - set(self.holders.values())
        if not ids:
            idle = next((t for t, h in self.holders.items() if not self.readers.get(h)), None)
            if idle is None:
                return None
            self._drop_holder(idle)
            ids = set(range(self.rows, self.llama.shape.sequences)) - set(self.holders.values())
        holder, key = min(ids), self._key(prefix)
        if self.prefill is not None:
            self.prefill.place_prefix(holder, prefix)
            self._alive[key] = weakref.ref(prefix.keys[0])
        else:
            self._decode(list(tokens), list(range(len(tokens))), [holder] * len(tokens), [])
        self.holders[key] = holder
        return holder

    def _drop_holder(self, key: HolderKey) -> None:
        self._alive.pop(key, None)
        holder = self.holders.pop(key)
        self.readers.pop(holder, None)
        self.llama.drop_sequence(holder)

    def feed(self, prefix: PrefixKV, feeds: Seq[Feed]) -> list[torch.Tensor]:
        """One step's feeds: each feed's tokens at positions after the prefix in its row. Returns each feed's
        next-token logits ``[V]`` (float32).

        With ``prompts_on_torch``, new rows' first tokens (feeds from a row's start), when they are at least
        :data:`PREFILL_TOKENS` together, run on torch in one packed pass and are placed in their rows; every other
        feed is decoded by llama.cpp, packed (in batches of the context's size when they are more)."""
        for feed in feeds:
            if feed.slot not in self.reserved:
                raise ValueError(f"row {feed.slot} is not taken")
        torch_prompts = self.prefill is not None and (self.prompts_on_torch or self.states)
        first = [i for i, feed in enumerate(feeds) if feed.start == 0] if torch_prompts else []
        if sum(len(feeds[i].ids) for i in first) < PREFILL_TOKENS and not self.states:
            first = []
        out: dict[int, torch.Tensor | Prefilled] = {}
        if first:
            slots = [feeds[i].slot for i in first]
            logits = self.prefill.rows(prefix, slots, [feeds[i].ids for i in first], self.llama.vocab)
            for i, slot, row in zip(first, slots, logits):
                holder = self.reserved[slot][1]
                if holder is not None:  # placing the row's cells freed its copy of the prefix's: copy it again
                    self.llama.copy_sequence(holder, slot)
                out[i] = row
                self.tokens_prefilled += len(feeds[i].ids)
        rest = [i for i in range(len(feeds)) if i not in out]
        out.update(zip(rest, self._feed_decoded(prefix, [feeds[i] for i in rest])))
        return [out[i] for i in range(len(feeds))]

    def _feed_decoded(self, prefix: PrefixKV, feeds: Seq[Feed]) -> list[torch.Tensor]:
        """``feeds`` decoded by llama.cpp; each one's logits ``[V]``."""
        if not feeds:
            return []
        tokens, positions, seqs, lasts = [], [], [], []
        for feed in feeds:
            start = prefix.length + feed.start
            tokens += feed.ids
            positions += range(start, start + len(feed.ids))
            seqs += [feed.slot] * len(feed.ids)
            lasts.append(len(tokens) - 1)
        return list(torch.from_numpy(self._decode(tokens, positions, seqs, lasts)))  # B x [V]

    def _decode(self, tokens: list[int], positions: list[int], seqs: list[int], outputs: list[int]) -> np.ndarray:
        """Decode in batches of at most the context's batch size; the logits at ``outputs``, ``[len(outputs), V]``."""
        size, parts = self.llama.shape.batch, []
        for lo in range(0, len(tokens), size):
            hi = lo + size
            here = [i - lo for i in outputs if lo <= i < hi]
            parts.append(self.llama.decode(tokens[lo:hi], positions[lo:hi], seqs[lo:hi], here))
        self.tokens_decoded += len(tokens)
        return np.concatenate(parts) if parts else np.zeros((0, self.llama.vocab), dtype=np.float32)

    def logits(self, outputs: list) -> torch.Tensor:
        """The rows' logits ``[b, V]`` (already computed by :meth:`feed`)."""
        rows = [out.logits if isinstance(out, Prefilled) else out for out in outputs]
        return torch.stack(rows) if rows else torch.empty(0)

    def state(self, output) -> torch.Tensor | None:
        """The final layer's state ``[H]`` at a row's last prompt token where torch computed its prompt, else None."""
        return output.state if isinstance(output, Prefilled) else None

    def give(self, slot: int) -> None:
        """Row ``slot`` back: its cells freed (its prefix's stay with the holder), its reservation dropped."""
        _, holder = self.reserved.pop(slot)
        if holder is not None and holder in self.readers:
            self.readers[holder] -= 1
        self.llama.drop_sequence(slot)

    def trim(self, running: bool) -> bool:
        return False  # one context of fixed cells: nothing grows, so nothing is given back

    def close(self) -> None:
        """Every row back (holders stay decoded for the next run over the same prefix)."""
        for row in list(self.reserved):
            self.give(row)
