"""Independent-chunk prompts: block attention over reusable, position-independent chunks.

A :class:`ChunkedPrompt` ``[prefix][chunk 1]...[chunk n][suffix]`` (a system prompt, retrieved
documents, a question) is prefilled under *block attention*: the prefix is causal; each chunk
attends to the prefix and to itself only; the suffix, and every token decoded after it, attends
to everything before it. A chunk's K/V then depends only on the prefix and the chunk, not on
where the chunk sits or what precedes it, so it is computed once and reused by any later prompt
with the same prefix, at any offset.

Position independence comes from a pre-RoPE cache (``PagedKVCache(..., pre_rope=True)``): keys
are stored before rotary embedding and :func:`fastllm.ops.paged_attention` rotates key ``j`` of a
sequence by position ``j`` as it reads it. Each chunk is *encoded* as if it came right after the
prefix (positions ``len(prefix) + i``) and is *read* at the positions it occupies in the prompt,
so the cached rows are copied into a new prompt's blocks as they are, whatever their offset.

What is exact and what is not:

- exact: the result equals a reference with the same semantics computed independently (HF
  transformers: each ``prefix + chunk`` run causally, its chunk K/V re-rotated to the chunk's
  offset, the suffix run over that cache; see ``tests/engine/test_chunk_prefill.py``), and a
  prompt with one chunk equals an ordinary causal prefill;
- approximate: with several chunks this is *not* causal attention over the whole prompt: a
  chunk does not see the chunks before it, and chunk ``i > 1`` is encoded at positions other
  than the ones it is read at. How far the logits move on a real model is measured by
  ``benchmarks/bench_kv_cache.py`` (stories260K).

The engine runs such a prompt as a request like any other (``LLM.generate`` takes a
``ChunkedPrompt``), batched with ordinary ones; its scheduler encodes the chunks the
:class:`~fastllm.kv_cache.ChunkIndex` lacks and has the workers load every chunk's K/V into the
request's blocks.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from fastllm.tokenizer.token_ids import as_token_ids

__all__ = ["ChunkedPrompt"]


@dataclass(frozen=True)
class ChunkedPrompt:
    """A prompt under block attention: token ids of the prefix, each chunk and the suffix.

    The suffix must hold at least one token: its last one yields the next-token logits.
    """

    prefix: tuple[int, ...]
    chunks: tuple[tuple[int, ...], ...]
    suffix: tuple[int, ...]

    def __init__(self, prefix: Sequence[int], chunks: Sequence[Sequence[int]],
                 suffix: Sequence[int]) -> None:
        object.__setattr__(self, "prefix", tuple(as_token_ids(prefix, what="prefix")))
        object.__setattr__(self, "chunks", tuple(
            tuple(as_token_ids(chunk, what=f"chunks[{i}]")) for i, chunk in enumerate(chunks)))
        object.__setattr__(self, "suffix", tuple(as_token_ids(suffix, what="suffix")))
        if not self.suffix:
            raise ValueError("ChunkedPrompt needs a non-empty suffix (its last token gives the "
                             "logits)")
        for i, chunk in enumerate(self.chunks):
            if not chunk:
                raise ValueError(f"ChunkedPrompt chunk {i} is empty")

    @property
    def token_ids(self) -> list[int]:
        """The whole prompt, in order."""
        return [*self.prefix, *itertools.chain.from_iterable(self.chunks), *self.suffix]
