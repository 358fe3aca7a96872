"""llama.cpp sequence states written from torch's keys and values (model/llama_state.py, scheduler/torch_prefill.py),
on the embedded SmolLM2-135M: a state read back and written again is the same state, and a prefix placed from
torch's keys and values, a tuned one included, gives llama.cpp the logits torch gives over it, within the backend's
tolerance. Skipped, with the reason, where llama-cpp-python did not build.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prefixcache.cache.kv import PrefixKV
from prefixcache.engine.rows import forward_rows
from prefixcache.errors import BackendError
from prefixcache.model.llama_cpp import ContextShape, LlamaCpp, llama_cpp_problem
from prefixcache.model.llama_state import read_state, write_state
from prefixcache.model.load import embedded_gguf, load_model
from prefixcache.scheduler.torch_prefill import TorchPrefill

GGUF = str(embedded_gguf("smollm2-135m"))
PROBLEM = llama_cpp_problem(GGUF, 1)
pytestmark = [pytest.mark.embedded,
              pytest.mark.skipif(PROBLEM is not None, reason=f"llama.cpp cannot run here: {PROBLEM}")]
PROMPT = "<|im_start|>system\nRead the ticket and name its product.<|im_end|>\n<|im_start|>user\n"
SUFFIX = "My router drops the connection every night.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def loaded():
    return load_model("smollm2-135m", dtype="float32", threads=1)


@pytest.fixture()
def llama():
    context = LlamaCpp(GGUF, ContextShape(cells=1024, sequences=4, batch=256, threads=1))
    yield context
    context.close()


def _ids(loaded, text: str) -> list[int]:
    return loaded.tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_state_read_and_written_again_is_the_same_state_and_decodes_the_same(loaded, llama):
    ids = _ids(loaded, PROMPT)
    llama.decode(ids, list(range(len(ids))), [0] * len(ids), [])
    raw = llama.sequence_state(0)
    state = read_state(raw)
    assert list(state.positions) == list(range(len(ids))) and len(state.keys) == loaded.model.config.num_hidden_layers
    again = write_state(state.positions, state.keys, state.values, state.layout)
    assert again[8:] == raw[8:], "everything but the sequence id it was read from is written back as it was"
    llama.set_sequence_state(1, again)
    tail = _ids(loaded, SUFFIX)[:4]
    at = list(range(len(ids), len(ids) + len(tail)))
    first = llama.decode(tail, at, [0] * len(tail), [len(tail) - 1])
    second = llama.decode(tail, at, [1] * len(tail), [len(tail) - 1])
    np.testing.assert_array_equal(first, second)
    with pytest.raises(BackendError, match="cannot be read"):
        read_state(raw[: len(raw) // 2])
    with pytest.raises(BackendError, match="shape"):
        write_state(state.positions, [k[:-1] for k in state.keys], state.values, state.layout)


def _logits_after(loaded, llama, prefill: TorchPrefill, prefix: PrefixKV, tail: list[int]) -> torch.Tensor:
    """llama.cpp's next-token logits after ``prefix`` placed in holder 3 and ``tail`` decoded on row 0 ``[V]``."""
    prefill.place_prefix(3, prefix)
    llama.drop_sequence(0)
    llama.copy_sequence(3, 0)
    at = list(range(prefix.length, prefix.length + len(tail)))
    return torch.from_numpy(llama.decode(tail, at, [0] * len(tail), [len(tail) - 1])[0])


def _torch_logits(loaded, prefix: PrefixKV, tail: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        cache = prefix.fork(1)
        ids = torch.tensor([tail])
        hidden = forward_rows(loaded.model, cache, ids, torch.ones_like(ids, dtype=torch.bool),
                              torch.tensor([prefix.length]), torch.ones(1, prefix.length, dtype=torch.bool))
        return loaded.model.get_output_embeddings()(hidden[0, -1]).float()  # [V]


def _close(ours: torch.Tensor, reference: torch.Tensor) -> bool:
    vocab = min(len(ours), len(reference))
    ours, reference = ours[:vocab], reference[:vocab]
    return int(ours.argmax()) == int(reference.argmax()) and torch.corrcoef(torch.stack([ours, reference]))[0, 1] > 0.99


def test_a_prefix_placed_from_torchs_cells_gives_the_logits_llama_cpp_decodes_itself(loaded, llama):
    ids, tail = _ids(loaded, PROMPT), _ids(loaded, SUFFIX)
    prefill = TorchPrefill(loaded.model, llama, scratch=2)
    placed = _logits_after(loaded, llama, prefill, PrefixKV.build(loaded.model, ids), tail)
    llama.decode(ids, list(range(len(ids))), [1] * len(ids), [])  # llama.cpp's own prefix, on sequence 1
    at = list(range(len(ids), len(ids) + len(tail)))
    own = torch.from_numpy(llama.decode(tail, at, [1] * len(tail), [len(tail) - 1])[0])
    assert _close(placed, own) and _close(placed, _torch_logits(loaded, PrefixKV.build(loaded.model, ids), tail))


def test_a_tuned_prefix_runs_on_llama_cpp_with_torchs_logits_within_tolerance(loaded, llama):
    """A tuned prefix's keys and values are not its tokens': placed in a holder, llama.cpp follows them (its logits
    are torch's over the tuned prefix, and far from the untuned prompt's)."""
    ids, tail = _ids(loaded, PROMPT), _ids(loaded, SUFFIX)
    prompt = PrefixKV.build(loaded.model, ids)
    generator = torch.Generator().manual_seed(0)
    tuned = PrefixKV(prompt.token_ids, tuple(k + 0.5 * torch.randn(k.shape, generator=generator) for k in prompt.keys),
                     tuple(v * 2.0 for v in prompt.values))
    prefill = TorchPrefill(loaded.model, llama, scratch=2)
    ours = _logits_after(loaded, llama, prefill, tuned, tail)
    reference, untuned = _torch_logits(loaded, tuned, tail), _torch_logits(loaded, prompt, tail)
    vocab = min(len(ours), len(reference))
    assert _close(ours, reference)
    gap, error = (reference - untuned).abs().max(), (ours[:vocab] - reference[:vocab]).abs().max()
    assert error < gap / 4, f"llama.cpp's logits are {error:.2f} from torch's over the tuned prefix, which moved them {gap:.2f}"


def test_rows_prefilled_on_torch_carry_the_state_a_fitted_head_reads(loaded):
    """With ``states`` set (fitted field heads), a row's prompt runs on torch whatever its length: its output carries
    torch's final-layer state at the last prompt token, the one torch's own generation gives, and its logits."""
    from prefixcache.cache.slots import Feed
    from prefixcache.engine.generate import GenerationConfig
    from prefixcache.engine.rows import packed_last_states
    from prefixcache.scheduler.backend_choice import llama_generation
    from prefixcache.scheduler.sequence import Generate, Sequence

    backend = llama_generation(loaded, 2, cells=512)
    prefix, tail = PrefixKV.build(loaded.model, _ids(loaded, PROMPT)), _ids(loaded, SUFFIX)[:5]
    row = backend.take(Sequence(prefix, tail, Generate(GenerationConfig(4))))
    plain = backend.feed(prefix, [Feed(row, 0, tuple(tail))])[0]
    assert backend.state(plain) is None, "a short prompt decoded by llama.cpp has no state"
    backend.give(row)
    backend.states = True
    row = backend.take(Sequence(prefix, tail, Generate(GenerationConfig(4))))
    output = backend.feed(prefix, [Feed(row, 0, tuple(tail))])[0]
    with torch.inference_mode():
        expected = packed_last_states(loaded.model, prefix, [tail])[0]  # [H]
    torch.testing.assert_close(backend.state(output), expected, rtol=1e-5, atol=1e-5)
    assert _close(backend.logits([output])[0], _torch_logits(loaded, prefix, tail))
    assert backend.tokens_prefilled == len(tail)
    backend.give(row)


def test_a_requantized_gguf_is_made_once_and_its_type_is_the_one_asked_for(tmp_path):
    from prefixcache.model.requantize import FILE_TYPES, OWN, file_type, requantized

    source = embedded_gguf("smollm2-135m")
    assert requantized(source, OWN, tmp_path) == source and not list(tmp_path.iterdir())
    made = requantized(source, "q8_0", tmp_path)
    assert made.parent == tmp_path and file_type(made) == FILE_TYPES["q8_0"] != file_type(source)
    stamp = made.stat().st_mtime_ns
    assert requantized(source, "q8_0", tmp_path) == made and made.stat().st_mtime_ns == stamp, "made once, then kept"
    assert requantized(made, "q8_0", tmp_path) == made, "a file already of that type is used as it is"
    with pytest.raises(BackendError, match="must be 'own' or one of q4_0, q8_0"):
        requantized(source, "q2_k", tmp_path)
