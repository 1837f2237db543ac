"""Reranking throughput: ``fastllm.Reranker`` against the Qwen3-Reranker model card's HF recipe
on the same weights, in pairs/s on TREC DL19 queries with their BM25 top passages, and what
each of fastllm's techniques gave.

The model is bench_generate's random-weight Qwen3-0.6B shape (28 layers, hidden 1024, MLP
3072, 16 query and 8 KV heads of 128, vocabulary 151,936, tied embeddings), saved once with the
real Qwen3 tokenizer files (``--models-dir``). The full depth is the default, on a small
workload instead: ``--queries`` (2) DL19 queries with their ``--top-k`` (16) BM25 hits each, the
real passage texts (pairs of about 100 to 380 tokens, of which the chat prefix, instruction and
query, about 60 to 75 tokens, are the same for all of a query's pairs). Fewer layers would not
do as a scaled-down model: the recipe computes the 151,936-row LM head at every position, a
quarter of the 0.6B model's work but most of a shallow one's, so the speedup would be inflated.

Each competitor's call scores every pair, query by query (the recipe's per-query batches;
``Reranker.score`` per query), tokenization included; interleaved in one process, per dtype
(float32 by default: the scores must agree within 1e-5):

- HF, the model card's recipe (:mod:`fastllm.bench.rerank_recipe`):
  ``AutoModelForCausalLM.from_pretrained(folder, dtype=..., attn_implementation="sdpa")`` and
  ``AutoTokenizer(padding_side="left")``; each query's pairs in left-padded batches of
  ``--hf-batch-size`` (0, the default: all of a query's passages in one batch, as the card's
  example scores all its pairs at once), the full logits at every position, the last
  position's yes/no log-softmax;
- fastllm, the techniques of ``fastllm.Reranker`` added one at a time (a ladder; every rung
  keeps the ones above it). A Reranker scores pairs as prompt-only requests of its engine, so
  the rungs differ in what they ask of it and in the model its runner calls:

  1. none: one pair at a time (``Reranker.score(query, [document])`` per passage, so every
     forward step runs one pair), nothing shared (a ``block_size`` above the longest pair, so
     no KV block is ever full, none is reused), and the full LM head at every position as the
     recipe computes it (the runner's model wrapped so that each step also computes, and
     drops, the logits of all its tokens);
  2. + the LM head at each pair's last position only (full vocabulary, then the two rows
     picked);
  3. + the 2-row head: only the "no" and "yes" rows of the LM head;
  4. + packing: a query's pairs in one ``Reranker.score`` call, run as packed
     variable-length batches under the token budget (``max_num_batched_tokens=4096``);
  5. + the shared prefix (``block_size=16``): the tokens a query's pairs share computed once
     and reused through the paged KV cache's prefix caching. This is ``fastllm.Reranker`` with
     its defaults.

  Rungs 1 to 4 are one Reranker (the big blocks), rung 5 another; both load the same model
  through the pool and keep their KV pools' default size. ``--rungs`` times some of them only
  (by name: fastllm_none, fastllm_last_head, fastllm_2row_head, fastllm_packed, fastllm).

Every fastllm call starts from an empty KV pool (a fresh block manager over the same pool: the
Reranker's pool keeps cached blocks from one call to the next, and a repeated call would find
every pair's KV already computed), so within a call only what one real pass over these queries
would share is shared. Before timing, each model scores one pair once (the first forward pages
the weights in); then each competitor's calls are timed until ``--repeats`` or ``--budget``
seconds.

Per rung: pairs/s (pairs over the median call time), speedup against HF, gain over the rung
above, tokens run through the model per call (HF: padded), and the largest absolute difference
of its scores from HF's. Goal, at the Qwen3-0.6B shape in float32: fastllm (rung 5) >= 3x the
recipe's pairs/s, with scores within 1e-5 of the recipe's. The recipe pads each batch to its
longest pair and shares nothing, so fastllm's lead grows with the passages per query
(``--top-k``): 16, a shallow rerank, keeps the default run within minutes.

    python benchmarks/bench_rerank.py --out results
    python benchmarks/bench_rerank.py --queries 1 --top-k 20  # a deeper rerank
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from torch import Tensor
from transformers import AutoModelForCausalLM, AutoTokenizer

import fastllm
from fastllm.bench.report import format_cell, markdown_table, publish
from fastllm.bench.rerank_recipe import RECIPE_MAX_LENGTH, recipe_ids, recipe_scores
from fastllm.bench.timer import TimerConfig, compare
from fastllm.bench.workloads import MODEL_SHAPES, parse_model_bench_args
from fastllm.kv_cache import BlockManager
from fastllm.models.pool import model_pool

# The random model is bench_generate's; the DL19 run is eval_rerank_dl19's.
from bench_generate import DEFAULT_MODELS_DIR, MODEL, random_model_folder
from eval_rerank_dl19 import load_dl19

GOAL_SPEEDUP = 3.0  # fastllm pairs/s over the recipe's, at least
GOAL_SCORE_DIFF = 1e-5  # largest absolute score difference from the recipe, at most


@dataclass(frozen=True)
class Rung:
    """One fastllm configuration of the ladder: which of the Reranker's techniques it uses."""

    label: str
    head: str  # "every": full head at every position; "last": full, last position; "two"
    packing: bool
    shared_prefix: bool


# The ladder, each rung adding one technique to the one before; the last is the Reranker as is.
RUNGS: dict[str, Rung] = {
    "fastllm_none": Rung("fastllm, no technique", "every", False, False),
    "fastllm_last_head": Rung("+ head at the last position", "last", False, False),
    "fastllm_2row_head": Rung("+ 2-row head", "two", False, False),
    "fastllm_packed": Rung("+ packing", "two", True, False),
    "fastllm": Rung("+ shared prefix (fastllm.Reranker)", "two", True, True),
}
HF_LABEL = "HF recipe"


@dataclass(frozen=True)
class RerankBenchConfig:
    """What the rerank benchmark measures. ``layers``, ``hidden_size`` and ``intermediate_size``
    scale the model down (the goal holds at Qwen3-0.6B's own)."""

    layers: int = MODEL_SHAPES[MODEL].num_layers
    hidden_size: int = MODEL_SHAPES[MODEL].hidden_size
    intermediate_size: int = MODEL_SHAPES[MODEL].intermediate_size
    queries: int = 2  # the first DL19 queries
    top_k: int = 16  # BM25 hits per query
    hf_batch_size: int = 0  # pairs per recipe batch; 0: all of a query's
    max_length: int = RECIPE_MAX_LENGTH
    max_num_batched_tokens: int = 4096  # the Reranker's default
    block_size: int = 16  # the Reranker's default
    dtypes: tuple[str, ...] = ("float32",)
    rungs: tuple[str, ...] = tuple(RUNGS)  # of the ladder, timed beside the recipe
    device: str = "cpu"
    seed: int = 0
    models_dir: str = str(DEFAULT_MODELS_DIR)
    # On two cores a call at the default size is long against the budget: the recipe and the
    # slower rungs are timed once, the Reranker and the rungs near it twice, after the one-pair
    # warm-up per model (see the module docstring); at tiny sizes three times each.
    timer: TimerConfig = field(default_factory=lambda: TimerConfig(warmup=0, repeats=3,
                                                                   budget_s=20.0))

    def __post_init__(self) -> None:
        if not 1 <= self.queries <= 43 or self.top_k < 1 or self.hf_batch_size < 0:
            raise ValueError(f"need 1 <= queries <= 43, top_k >= 1 and hf_batch_size >= 0, "
                             f"got {self}")
        if not self.rungs or any(rung not in RUNGS for rung in self.rungs):
            raise ValueError(f"rungs must be some of {', '.join(RUNGS)}, got {self.rungs}")

    @property
    def at_goal_size(self) -> bool:
        """Whether this run measures the model the goal is set for."""
        shape = MODEL_SHAPES[MODEL]
        return ((self.layers, self.hidden_size, self.intermediate_size)
                == (shape.num_layers, shape.hidden_size, shape.intermediate_size))



def workload(config: RerankBenchConfig) -> list[tuple[str, list[str]]]:
    """(query, its ``top_k`` BM25 passages in rank order) for the first ``queries`` queries."""
    return [(item["query"], [hit["content"] for hit in item["hits"][:config.top_k]])
            for item in load_dl19(config.models_dir)[:config.queries]]


class RungModel:
    """The model as a rung's Reranker runs it (installed in its engine's model runner): counts
    the tokens each forward step runs, and computes the LM head the rung's way (``head``; the
    runner asks for the two rows at the pairs' last positions)."""

    def __init__(self, model: torch.nn.Module, head: str) -> None:
        self.model = model
        self.head = head
        self.tokens = 0

    def __call__(self, input_ids: Tensor, *args: object) -> Tensor:
        self.tokens += input_ids.numel()
        hidden = self.model(input_ids, *args)  # [T, hidden]
        if self.head == "every":  # the recipe's logits at every position, dropped
            self.model.compute_logits(hidden)  # [T, vocab]
        return hidden

    def compute_logits(self, hidden: Tensor, token_ids: Tensor | None = None) -> Tensor:
        if self.head == "two" or token_ids is None:
            return self.model.compute_logits(hidden, token_ids)  # [B, 2]
        return self.model.compute_logits(hidden)[:, token_ids]  # [B, vocab] -> [B, 2]

    def __getattr__(self, name: str) -> object:  # config, kv_cache_spec, ...
        return getattr(self.model, name)

    @classmethod
    def install(cls, reranker: fastllm.Reranker) -> RungModel:
        """Wraps the model ``reranker``'s engine runs (the head is set per call)."""
        runner = reranker.client.engine.executor.worker.runner
        runner.model = cls(runner.model, "two")
        return runner.model


def empty_kv_pool(reranker: fastllm.Reranker) -> None:
    """Gives ``reranker``'s KV pool a fresh block manager: no block, none cached."""
    cache, scheduler = reranker.client.kv_cache, reranker.client.engine.scheduler
    old = cache.block_manager
    if scheduler.block_manager is not old or scheduler.has_unfinished():
        raise RuntimeError("the reranker's scheduler holds another block manager, or requests")
    cache.block_manager = BlockManager(old.num_blocks, old.block_size, old.enable_prefix_caching)
    scheduler.block_manager = cache.block_manager


@dataclass
class CallSample:
    """One call over the workload: every pair's score in workload order, tokens computed."""

    scores: list[float]
    tokens: int


def fastllm_call(reranker: fastllm.Reranker, rung: Rung, work: list[tuple[str, list[str]]],
                 samples: list[CallSample]) -> Callable[[], None]:
    """Scores every query's passages the rung's way with ``reranker`` (its model installed as
    a :class:`RungModel`) from an empty KV pool, appending the call's sample."""
    counter = reranker.client.engine.executor.worker.runner.model
    if not isinstance(counter, RungModel):
        raise TypeError("install a RungModel in the reranker first")

    def call() -> None:
        empty_kv_pool(reranker)  # no KV left from the previous call (see the docstring)
        counter.head, counter.tokens = rung.head, 0
        if rung.packing:
            scores = [score for query, documents in work
                      for score in reranker.score(query, documents)]
        else:  # one pair per call, hence per forward step
            scores = [reranker.score(query, [document])[0] for query, documents in work
                      for document in documents]
        samples.append(CallSample(scores, counter.tokens))

    return call


def hf_batches(items: list, batch_size: int) -> list[list]:
    """The recipe's batches of a query's documents: all of them (``batch_size`` 0) or runs of
    ``batch_size``."""
    size = batch_size or len(items)
    return [items[i:i + size] for i in range(0, len(items), size)]


def hf_call(model: torch.nn.Module, tokenizer, work: list[tuple[str, list[str]]],
            config: RerankBenchConfig, samples: list[CallSample]) -> Callable[[], None]:
    """Scores every query's passages with the model card's recipe, appending the call's
    sample (tokens: the padded batches', counted beforehand)."""
    lengths = {query: [len(ids) for ids in recipe_ids(tokenizer, query, documents,
                                                      max_length=config.max_length)]
               for query, documents in work}
    tokens = sum(len(batch) * max(batch) for query, _ in work
                 for batch in hf_batches(lengths[query], config.hf_batch_size))

    def call() -> None:
        scores = []
        for query, documents in work:
            for batch in hf_batches(documents, config.hf_batch_size):
                scores += recipe_scores(model, tokenizer, query, batch,
                                        max_length=config.max_length)
        samples.append(CallSample(scores, tokens))

    return call


def pair_lengths(tokenizer, work: list[tuple[str, list[str]]],
                 config: RerankBenchConfig) -> list[int]:
    """Every pair's tokens (the recipe's ids, which are the Reranker's), query by query."""
    return [len(ids) for query, documents in work
            for ids in recipe_ids(tokenizer, query, documents, max_length=config.max_length)]


def no_share_block_size(lengths: list[int]) -> int:
    """The smallest power of two above every pair's length: no block ever fills, so none is
    reused."""
    return 1 << max(lengths).bit_length()


def dtype_rows(config: RerankBenchConfig, folder: Path, dtype_name: str,
               work: list[tuple[str, list[str]]]) -> list[dict[str, object]]:
    """Loads both sides in ``dtype_name``, times the recipe and the config's rungs
    interleaved; returns one row per competitor, the recipe first."""
    dtype = getattr(torch, dtype_name)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype,
                                              attn_implementation="sdpa").to(config.device).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    rungs = {name: RUNGS[name] for name in config.rungs}
    lengths = pair_lengths(tokenizer, work, config)
    # Rungs 1 to 4: KV blocks too big to fill (nothing shared); rung 5: the Reranker as is.
    rerankers = {shared: fastllm.Reranker(
        folder, dtype=dtype_name, device=config.device, max_length=config.max_length,
        max_num_batched_tokens=config.max_num_batched_tokens,
        block_size=config.block_size if shared else no_share_block_size(lengths))
        for shared in sorted({rung.shared_prefix for rung in rungs.values()})}
    for reranker in rerankers.values():
        RungModel.install(reranker)  # one model, shared by the pool, wrapped per reranker
    # Warm-up: one pair per model (the first forward of a fresh model pages its weights in).
    query, documents = work[0]
    next(iter(rerankers.values())).score(query, documents[:1])
    recipe_scores(hf, tokenizer, query, documents[:1], max_length=config.max_length)

    samples: dict[str, list[CallSample]] = {"hf": [], **{name: [] for name in rungs}}
    calls = {"hf": hf_call(hf, tokenizer, work, config, samples["hf"])}
    calls |= {name: fastllm_call(rerankers[rung.shared_prefix], rung, work, samples[name])
              for name, rung in rungs.items()}
    timings = compare(calls, config.timer, device=config.device)
    del hf, rerankers, calls
    model_pool.clear()  # the Rerankers share their model through the pool: let it go
    gc.collect()

    num_pairs = sum(len(documents) for _, documents in work)
    pair_tokens = sum(lengths)
    hf_scores = samples["hf"][-1].scores
    rows: list[dict[str, object]] = []
    for name, timing in timings.items():
        rung = RUNGS.get(name)
        last = samples[name][-1]
        if rung is not None and not rung.shared_prefix and last.tokens != pair_tokens:
            raise RuntimeError(f"{name} computed {last.tokens} tokens, not all {pair_tokens}: "
                               "some KV was shared")
        row: dict[str, object] = {
            "dtype": dtype_name, "competitor": name, "label": HF_LABEL if rung is None
            else rung.label, "head": "every" if rung is None else rung.head,
            "packing": False if rung is None else rung.packing,
            "shared_prefix": False if rung is None else rung.shared_prefix,
            "layers": config.layers, "hidden_size": config.hidden_size,
            "queries": len(work), "pairs": num_pairs, "pair_tokens": pair_tokens,
            "tokens_computed": last.tokens}
        row.update(timing.to_dict())
        row["pairs_per_s"] = num_pairs / timing.median_s
        row["max_abs_score_diff_vs_hf"] = max(abs(a - b) for a, b in zip(last.scores, hf_scores))
        row["scores"] = last.scores
        rows.append(row)
    hf_median = rows[0]["median_ms"]
    for previous, row in zip([None, *rows[1:]], rows[1:]):
        row["speedup_vs_hf"] = hf_median / row["median_ms"]
        row["gain_vs_previous"] = (None if previous is None
                                   else previous["median_ms"] / row["median_ms"])
    rows[0]["speedup_vs_hf"] = 1.0
    return rows


def run(config: RerankBenchConfig) -> list[dict[str, object]]:
    """Saves the random model, then measures every dtype; returns the JSON rows."""
    work = workload(config)
    rows = []
    with random_model_folder(config, "rerank") as folder:
        for dtype_name in config.dtypes:
            rows += dtype_rows(config, folder, dtype_name, work)
            print(f"rerank: {dtype_name} measured", flush=True)
    return rows


def goal_summary(config: RerankBenchConfig, rows: Sequence[dict[str, object]]) -> str:
    """One line: the goal and, at the goal size, the float32 figures against it."""
    goal = (f"Goal: fastllm.Reranker >= {GOAL_SPEEDUP:g}x the HF recipe's pairs/s with scores "
            f"within {GOAL_SCORE_DIFF:g} of it, {MODEL} in float32")
    found = [row for row in rows if row["competitor"] == "fastllm" and row["dtype"] == "float32"]
    if not config.at_goal_size or not found:
        return (f"{goal}: not measured in this run ({config.layers} of "
                f"{MODEL_SHAPES[MODEL].num_layers} layers, hidden {config.hidden_size}, "
                f"dtypes {', '.join(config.dtypes)}).")
    row = found[0]
    met = (row["speedup_vs_hf"] >= GOAL_SPEEDUP
           and row["max_abs_score_diff_vs_hf"] <= GOAL_SCORE_DIFF)
    return (f"{goal}: {format_cell(row['speedup_vs_hf'])}x, scores within "
            f"{format_cell(row['max_abs_score_diff_vs_hf'])} ({'met' if met else 'NOT met'}).")


def tables(config: RerankBenchConfig, rows: list[dict[str, object]]) -> dict[str, str]:
    """The markdown tables of the report, by title."""
    batch = (f"batches of {config.hf_batch_size}" if config.hf_batch_size
             else "one batch per query")
    first = rows[0] if rows else {}
    about = (f"{config.layers} layers, hidden {config.hidden_size}, MLP "
             f"{config.intermediate_size}; {config.queries} DL19 queries x their top "
             f"{config.top_k} BM25 passages = {first.get('pairs')} pairs of "
             f"{first.get('pair_tokens')} tokens in all. HF: the model card's recipe, "
             f"left-padded, {batch}, full logits at every position. fastllm: the Reranker's "
             "techniques added one row at a time; gain: this row's pairs/s over the row "
             "above's. Tokens: run through the model per call (HF: with padding).")
    columns = {"dtype": "dtype", "label": "", "pairs_per_s": "pairs/s",
               "median_ms": "call (ms)", "repeats": "calls timed",
               "speedup_vs_hf": "vs HF", "gain_vs_previous": "gain",
               "tokens_computed": "tokens", "max_abs_score_diff_vs_hf": "max |score - HF|"}
    return {f"Reranking DL19 passages, random-weight {MODEL} (vs HF > 1: fastllm faster)":
            goal_summary(config, rows) + "\n\n" + about + "\n\n" + markdown_table(rows, columns)}


def parse_args(argv: list[str] | None) -> tuple[RerankBenchConfig, Path]:
    """The config and output folder from the command line."""
    sizes = ("layers", "hidden_size", "intermediate_size", "queries", "top_k", "hf_batch_size",
             "max_length", "max_num_batched_tokens", "block_size", "seed")
    return parse_model_bench_args(argv, RerankBenchConfig(), benchmark="rerank",
                                  description=__doc__.split("\n\n")[0], sizes=sizes,
                                  choice_lists={"rungs": tuple(RUNGS)},
                                  models_dir_help="folder holding qwen3_tokenizer and rerank_eval")


def main(argv: list[str] | None = None) -> dict[str, object]:
    """Runs the benchmark, writes ``rerank.json`` and ``rerank.md``, prints the tables; returns
    the JSON document."""
    config, out = parse_args(argv)
    transformers.logging.set_verbosity_error()  # no tied-weight notes
    transformers.logging.disable_progress_bar()  # nor weight-loading bars
    rows = run(config)
    return publish(benchmark="rerank", device=config.device, config=config, rows=rows,
                   tables=tables(config, rows), out=out)


if __name__ == "__main__":
    main()
