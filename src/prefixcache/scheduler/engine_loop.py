"""The engine loop: every sequence (a record, a request) goes through one scheduler and one :meth:`EngineLoop.step`.

``step()`` is three named stages:

1. :meth:`~EngineLoop.schedule`: drop cancelled sequences, then pick what this step feeds, within
   ``max_step_tokens`` and ``max_seqs``: every running generating sequence's next token (or the next chunk of
   a prompt too long for one step), then waiting sequences round-robin by client (a generating one needs a
   free slot). A scoring sequence is fed whole (alone when it is longer than the budget);
2. :meth:`~EngineLoop.run`: per prefix, the scoring sequences in one scorer call, and the generating ones in
   one pass of the loop's generation backend (:mod:`prefixcache.scheduler.generation`: torch's slot store and
   :func:`~prefixcache.engine.slot_pass.forward_slots`, or llama.cpp): new sequences' tokens and running
   sequences' next tokens packed together;
3. :meth:`~EngineLoop.postprocess`: a scoring sequence finishes with its output; a generating sequence whose
   prompt is all fed picks its next token (its own sampling, constraint and stop strings) and finishes or
   stays running. A finished sequence gives its slot back at once.

Fast-forward (``LoopConfig.fast_forward``, on by default): after a row picks a token, every token its grammar then
forces (keys, separators, the rest of an enum value, the end token once its answer is complete:
:meth:`~prefixcache.engine.constraint.ConstrainedRows.next_forced`) is appended at once and fed with its next
step, so a step is taken only for a token the model chooses. A greedy row's answer is the one it gets a token a
step (the forced token is the only one its masked logits allow); a sampling row draws only for the tokens it picks.
Rows that record top log-probs take a step for every token (each step's alternatives are part of their answer).

A sequence added between steps joins at the next one; one cancelled leaves at the next one, and its slot is
freed. A waiting sequence is checked for cancellation again at the moment a step admits it (its admission is the
start of its first step), so one cancelled from another thread while a step is being scheduled never takes a step. What a sequence gets does not depend on what shares its steps (invariant 5): rows never see each
other, sampling is per row (seeded rows draw from their own generator), and a constraint that fails fails
only its own row.

With the torch backend, the slot store's bytes are bounded by ``LoopConfig.slot_bytes``, or, for a loop given the
prefix pool, by the pool's budget together with the prefixes (:mod:`prefixcache.scheduler.slot_budget`): the
store is sized from what the budget leaves, reserved in the pool, and given back by :meth:`~EngineLoop.close`. A sequence for
which not even one slot fits fails alone before it is fed (SequenceTooLongError; with a pool, one that names the
pool's PoolReservationError), kept as its ``failure``.

Not thread-safe: one thread (the CLI's, or the server's model thread) calls ``add`` and ``step``; only
:meth:`Sequence.cancel` may be called from elsewhere.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field, replace
from typing import Callable, Hashable, Iterable

import torch

from ..cache.kv import PrefixKV
from ..cache.pool import PrefixPool
from ..cache.slots import Feed, SlotStore
from ..engine.generate import RowOutput
from ..engine.sampling import TokenLogprob, TokenPicker, pick_each
from ..errors import BackendError, ConstraintError, PoolBudgetError, PrefixCacheError, SequenceTooLongError
from .generation import GenerationBackend, TorchGeneration
from .sequence import Generate, Sequence, Status, scorer_group


@dataclass(frozen=True)
class LoopConfig:
    """Bounds of one step. ``slot_bytes``: the byte budget of the own-token store (it sets the slot count) when the
    loop has no prefix pool; with one, the pool's budget bounds the store instead (see :class:`EngineLoop`)."""

    max_step_tokens: int = 2048
    max_seqs: int = 32
    slot_bytes: int = 512 * 2**20
    fast_forward: bool = True  # append the tokens a row's grammar forces without a step of their own

    def __post_init__(self):
        if self.max_step_tokens < 1 or self.max_seqs < 1:
            raise ValueError("max_step_tokens and max_seqs must be at least 1")


@dataclass
class Scheduled:
    """What one step feeds: each sequence and how many of its pending tokens."""

    items: list[tuple[Sequence, int]] = field(default_factory=list)
    tokens: int = 0

    def add(self, seq: Sequence, count: int) -> None:
        self.items.append((seq, count))
        self.tokens += count


@dataclass(frozen=True)
class _Failed:
    """The output of a sequence whose group's engine call raised ``error``."""

    error: Exception


@dataclass
class LoopStats:
    """Counters of a loop's life: steps taken, forward passes (scorer calls and slot passes), tokens fed."""

    steps: int = 0
    passes: int = 0
    tokens_fed: int = 0
    tokens_generated: int = 0
    tokens_forced: int = 0  # of those generated, appended by fast-forward (no step picked them)


class EngineLoop:
    """The scheduler and its step over one model. See the module docstring for the contract.

    ``pool``: the prefix pool whose byte budget also bounds the slot store (its bytes reserved there, given back
    by :meth:`close`); None: ``config.slot_bytes`` bounds it. ``generation``: where generating sequences run
    (default: torch's :class:`~prefixcache.scheduler.generation.TorchGeneration` over ``model``).
    """

    def __init__(self, model: torch.nn.Module, tokenizer, config: LoopConfig = LoopConfig(),
                 pool: PrefixPool | None = None, generation: GenerationBackend | None = None):
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.generation = generation or TorchGeneration(model, config.slot_bytes, config.max_seqs, pool)
        self.waiting: OrderedDict[Hashable, deque[Sequence]] = OrderedDict()  # client -> its sequences, in turn order
        self.running: deque[Sequence] = deque()
        self.stats = LoopStats()
        self.last_plan = Scheduled()  # what the last step fed (read after it by whoever drives the loop)
        self._left: list[Sequence] = []  # sequences that left the queues while this step was scheduled
        self.on_schedule: Callable[[Scheduled], None] | None = None  # told what a step feeds, before it runs

    # --- what callers use ---------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue ``seq``; it joins at the next step."""
        self.waiting.setdefault(seq.client, deque()).append(seq)

    def cancel(self, seq: Sequence) -> None:
        """Drop ``seq`` at the next step (its slot is freed then)."""
        seq.cancel()

    @property
    def has_work(self) -> bool:
        return bool(self.running) or any(self.waiting.values())

    def run_until_done(self, seqs: Iterable[Sequence] = ()) -> None:
        """Add ``seqs`` and step until nothing is waiting or running."""
        for seq in seqs:
            self.add(seq)
        while self.has_work:
            self.step()

    def step(self) -> list[Sequence]:
        """One step: schedule, run, postprocess. Returns the sequences that finished (or left) in it."""
        left = self._drop_cancelled()
        plan = self.last_plan = self.schedule()
        left, self._left = left + self._left, []
        if not plan.items:
            return left
        if self.on_schedule is not None:
            self.on_schedule(plan)
        outputs = self.run(plan)
        self.stats.steps += 1
        return left + self.postprocess(plan, outputs)

    # --- 1. schedule --------------------------------------------------------------------------------

    def schedule(self) -> Scheduled:
        """Running sequences' next tokens first, then waiting ones round-robin by client, within the budget."""
        plan, budget = Scheduled(), self.config.max_step_tokens
        for seq in list(self.running):
            if len(plan.items) >= self.config.max_seqs or plan.tokens >= budget:
                break
            plan.add(seq, min(len(seq.pending()), budget - plan.tokens))
        self.running.rotate(-len(plan.items))  # who did not fit goes first next step
        while len(plan.items) < self.config.max_seqs and plan.tokens < budget and self.waiting:
            client, queue = next(iter(self.waiting.items()))
            count = self._admit(queue[0], plan, budget)
            if count is None:
                break
            if count:  # 0: it failed at admission (and left its queue)
                plan.add(queue.popleft(), count)
            if not queue:
                del self.waiting[client]
            else:
                self.waiting.move_to_end(client)  # the next client's turn
        return plan

    def _admit(self, seq: Sequence, plan: Scheduled, budget: int) -> int | None:
        """How many tokens of waiting ``seq`` this step feeds (taking its slot), or None: it waits."""
        if seq.cancelled:  # cancelled (another thread) since this step dropped the cancelled: it never takes a step
            self._leave(seq, Status.CANCELLED, "cancelled")
            return 0
        room = budget - plan.tokens
        if not seq.generates:  # fed whole: alone when longer than the budget
            return len(seq.ids) if len(seq.ids) <= room or not plan.items else None
        try:
            slot = self.generation.take(seq)
        except (SequenceTooLongError, PoolBudgetError) as exc:  # not even one slot for it: it fails alone
            self._leave(seq, Status.FAILED, failure=_too_long(seq, exc))
            return 0
        except BackendError as exc:  # the backend cannot run it (llama.cpp and a prefix it cannot hold, say)
            self._leave(seq, Status.FAILED, failure=exc)
            return 0
        if slot is None:
            return None
        seq.slot, seq.status, seq.admitted_at = slot, Status.RUNNING, time.perf_counter()
        want: Generate = seq.want
        seq.output, seq.picker = RowOutput(self.tokenizer), TokenPicker(want.sampling, 1, seq.prefix.keys[0].device)
        self.running.append(seq)
        return min(len(seq.ids), room)

    def _leave(self, seq: Sequence, status: Status, error: str | None = None, failure: Exception | None = None) -> None:
        """Waiting ``seq``, first in its client's queue, leaves it unfed (cancelled, or failed at admission)."""
        self.waiting[seq.client].popleft()
        self._finish(seq, status, error=error if failure is None else str(failure), failure=failure)
        self._left.append(seq)

    @property
    def store(self) -> SlotStore | None:
        """The torch backend's slot store (None: none is held, or another backend runs the generating rows)."""
        return getattr(self.generation, "store", None)

    def close(self) -> None:
        """Give the generating rows' memory back (the slot store's bytes to the pool's budget, when the loop has a
        pool). Call it when the loop is done: it takes no step after (a sequence still running would have no slot)."""
        self.generation.close()

    def trim(self) -> bool:
        """Give back idle memory made for one long sequence (torch: a store of fewer than ``max_seqs`` slots); the
        next generating sequence makes its own. Returns whether it did."""
        return self.generation.trim(bool(self.running))

    def _drop_cancelled(self) -> list[Sequence]:
        """Take cancelled sequences out of the queues, free their slots, and tell their callers."""
        gone = [s for s in self.running if s.cancelled]
        for client, queue in list(self.waiting.items()):
            gone += [s for s in queue if s.cancelled]
            kept = deque(s for s in queue if not s.cancelled)
            if kept:
                self.waiting[client] = kept
            else:
                del self.waiting[client]
        for seq in gone:
            self._finish(seq, Status.CANCELLED, error="cancelled")
        return gone

    # --- 2. run -------------------------------------------------------------------------------------

    def run(self, plan: Scheduled) -> dict[int, object]:
        """Per prefix: one scorer call per scorer, one slot pass for the generating rows. ``id(seq)`` -> its output
        (a scorer's output, or the backend's output at its last fed token), or an exception for a failed call."""
        outputs: dict[int, object] = {}
        groups: dict[tuple, list[tuple[Sequence, int]]] = {}
        for seq, count in plan.items:
            key = (id(seq.prefix), None if seq.generates else scorer_group(seq.want.scorer))
            groups.setdefault(key, []).append((seq, count))
        for (_, scorer), group in groups.items():
            seqs = [seq for seq, _ in group]
            prefix: PrefixKV = seqs[0].prefix
            self.stats.passes += 1
            self.stats.tokens_fed += sum(count for _, count in group)
            try:
                if scorer is not None:
                    outputs.update(zip(map(id, seqs), seqs[0].want.scorer.score(prefix, seqs)))
                    continue
                feeds = [Feed(seq.slot, seq.fed, seq.pending()[:count]) for seq, count in group]
                rows = self.generation.feed(prefix, feeds)  # one output per feed
            except Exception as exc:  # this group's call failed: its sequences fail, the step's others go on
                outputs.update((id(seq), _Failed(exc)) for seq in seqs)
                continue
            for (seq, count), row in zip(group, rows):
                seq.fed += count
                outputs[id(seq)] = row
        return outputs

    # --- 3. postprocess -----------------------------------------------------------------------------

    def postprocess(self, plan: Scheduled, outputs: dict[int, object]) -> list[Sequence]:
        """Finish scoring sequences; let each generating one whose prompt is fed pick its next token."""
        finished: list[Sequence] = []
        for seq, _ in plan.items:
            failure = outputs.get(id(seq))
            if isinstance(failure, _Failed):
                self._finish(seq, Status.FAILED, error=f"{type(failure.error).__name__}: {failure.error}")
                finished.append(seq)
        plan.items = [(seq, count) for seq, count in plan.items if not seq.status.done]
        sampling = [seq for seq, _ in plan.items if seq.generates and not seq.pending()]
        logits = self.generation.logits([outputs[id(seq)] for seq in sampling])  # [b, V]
        for seq, _ in plan.items:
            seq.steps += 1
            if not seq.generates:
                self._finish(seq, Status.FINISHED, result=outputs[id(seq)])
                finished.append(seq)
        for seq in sampling:
            if not seq.generated:  # the step that fed its last prompt token: what a fitted head reads
                seq.prompt_state = self.generation.state(outputs[id(seq)])
        with torch.inference_mode():  # the logits are an inference tensor: masks write them in place
            return finished + self._next_tokens(sampling, logits)

    def _next_tokens(self, seqs: list[Sequence], logits: torch.Tensor) -> list[Sequence]:
        """Each of ``seqs`` picks its next token from its row of ``logits`` ``[b, V]``: masked by its own constraint
        (in place), then picked (:func:`~prefixcache.engine.sampling.pick_each`: greedy rows together). Returns
        those that finished (a row whose constraint fails fails alone)."""
        finished, picking = [], []
        for i, seq in enumerate(seqs):
            want: Generate = seq.want
            try:
                if want.constraint is not None and seq.rules is None:  # a schema, or one bound to the row's own text
                    seq.rules = want.constraint.start(self.tokenizer, 1, want.config.eos_ids, want.config.max_new_tokens)
                if seq.rules is not None:
                    seq.rules.mask_(logits[i : i + 1], [0])
                    if not torch.isfinite(logits[i]).any():  # a dead end: no token may follow (see the docs)
                        raise ConstraintError("the constraint allows no next token here")
            except ConstraintError as exc:
                self._finish(seq, Status.FAILED, error=str(exc))
                finished.append(seq)
                continue
            picking.append(i)
        if not picking:
            return finished
        rows = logits if len(picking) == len(seqs) else logits.index_select(0, torch.tensor(picking, device=logits.device))
        for i, (token, logprob) in zip(picking, pick_each(rows, [seqs[i].picker for i in picking])):
            if self._take_token(seqs[i], token, logprob):
                finished.append(seqs[i])
        return finished

    def _take_token(self, seq: Sequence, token: int, logprob) -> bool:
        """Append ``token`` to ``seq`` (its stop strings, constraint and budget checked), then every token its grammar
        forces after it (fast-forward, see :meth:`_forced_next`); True when it finished."""
        want: Generate = seq.want
        on_token = None if seq.on_token is None else (lambda _row, tok: seq.on_token(seq, tok))
        while token is not None:
            try:
                done = seq.output.add(token, logprob, self.tokenizer, want.config, on_token, 0, seq.rules)
            except ConstraintError as exc:  # this row's grammar failed: it alone fails
                self._finish(seq, Status.FAILED, error=str(exc))
                return True
            self.stats.tokens_generated += 1
            if not seq.generated:
                seq.first_token_at = time.perf_counter()
            seq.generated.append(token)
            if done:  # the generation carries the state at its last prompt token, as generate_rows' does
                self._finish(seq, Status.FINISHED, result=replace(seq.output.generation, state=seq.prompt_state))
                return True
            token = self._forced_next(seq)
            self.stats.tokens_forced += token is not None
            logprob = None if token is None or seq.picker.sampling.top_logprobs is None else TokenLogprob(token, 0.0)
        return False

    def _forced_next(self, seq: Sequence) -> int | None:
        """The token ``seq``'s grammar forces next (fast-forward: it is fed with the row's next step instead of
        taking one), or None. Rows that record top log-probs (``top_logprobs`` above 0) are not fast-forwarded:
        their steps' alternatives are part of their answer."""
        if seq.rules is None or not self.config.fast_forward or seq.picker.sampling.top_logprobs:
            return None
        return seq.rules.next_forced(0)

    def _finish(self, seq: Sequence, status: Status, result=None, error: str | None = None,
                failure: Exception | None = None) -> None:
        """Record how ``seq`` ended, give its slot back, take it off the running queue, tell its caller."""
        seq.status, seq.result, seq.error, seq.failure = status, result, error, failure
        if seq.slot is not None:
            self.generation.give(seq.slot)
            seq.slot = None
        if seq in self.running:
            self.running.remove(seq)
        if seq.on_finish is not None:
            seq.on_finish(seq)


def _too_long(seq: Sequence, exc: PrefixCacheError) -> SequenceTooLongError:
    """The error of ``seq`` for which not even one slot fits (``exc``: the bound's own words, its markers kept)."""
    if isinstance(exc, SequenceTooLongError):
        return exc
    generated = seq.own_tokens - len(seq.ids)
    return SequenceTooLongError(f"{len(seq.ids)} tokens of its own and up to {generated} generated do not fit: "
                                f"{exc.args[0]}")
