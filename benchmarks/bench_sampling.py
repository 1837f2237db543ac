"""fastllm.ops.sample (and apply_penalties) against HF transformers' logits processors and a
plain sort-based sampler, one token per row.

Vocabularies of 32,000 (Llama-2 / Mistral-7B) and 151,936 (Qwen2.5 / Qwen3), batches of 1, 16
and 64 rows, float32 logits (``randn * 3``, fresh per case). Settings: greedy (temperature 0),
top-k (k=50, T=0.8), top-p (p=0.9, T=0.8), top-k + top-p, min-p (0.05, T=0.8), and top-k + top-p
with penalties (repetition 1.1, frequency 0.5, presence 0.5; a random 512-token prompt and 128
output tokens per row). Per case, interleaved in one process:

- fastllm: ``fastllm.ops.sample`` with per-row parameter tensors (plus
  ``fastllm.ops.apply_penalties`` on a copy of the logits, with the prompt mask and output
  counts an engine keeps, for the penalties setting);
- HF chain: the logits processors ``generate`` builds for the setting, in its order
  (``RepetitionPenaltyLogitsProcessor`` on the prompt + output ids, then temperature, top-k,
  top-p, min-p), then softmax and ``torch.multinomial``; greedy is ``argmax``. transformers has
  no frequency or presence processor, so this peer applies the repetition penalty only: it does
  less work than the other two there;
- sort-based: what hand-written samplers do: sort descending once, cut at k, softmax, cumsum,
  drop the tail past p, ``torch.multinomial``; min-p is softmax, threshold, multinomial; greedy
  is ``argmax``; penalties are plain PyTorch on the same mask and counts as fastllm
  (``fastllm.ops.reference.apply_penalties``, vLLM's formula).

With penalties every competitor copies the logits once inside its timed call (fastllm penalizes
in place); without, none does. Around the ops it calls, no timed call reads a value back to
the host; the timer synchronizes the device around each call, alike for all.

Defaults depend on ``--device``: on the CPU, both vocabularies, batches 1, 16 and 64 and every
setting (sized for two cores); on CUDA, vocabulary 151,936, batches 1, 4, 16, 64 and 256, the
top-k and top-p settings, and more calls timed. Sizes given on the command line replace the
device's.

    python benchmarks/bench_sampling.py --out results --vocabs 151936 --batches 1 16
    python benchmarks/bench_sampling.py --out results --device cuda
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import fastllm
from fastllm.bench.report import format_cell, markdown_table, publish
from fastllm.bench.timer import TimerConfig, Timing, compare
from fastllm.bench.workloads import parse_device
from fastllm.ops import reference
from fastllm.ops.host_to_device import StagingBuffer
from fastllm.sampling import SamplingParams, SamplingTensors, resolve_seed

COMPETITORS = {"fastllm": "fastllm", "hf": "HF chain", "sort": "sort-based"}
# The headline goal: fastllm at least this many times faster than the HF chain here.
GOAL_SPEEDUP_VS_HF = 5.0
GOAL_VOCAB, GOAL_SETTING, GOAL_BATCHES = 151_936, "top_k_top_p", (1, 16)


@dataclass(frozen=True)
class Setting:
    """One benchmarked configuration: the parameters every row of the batch uses."""

    key: str
    label: str
    params: SamplingParams

    @property
    def beyond_hf(self) -> bool:
        """Uses presence or frequency penalties, which transformers has no processor for."""
        return bool(self.params.presence_penalty or self.params.frequency_penalty)


# The SamplingParams fields a setting varies, recorded in every JSON row.
SETTING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                  "frequency_penalty", "presence_penalty")

SETTINGS: dict[str, Setting] = {
    setting.key: setting
    for setting in (
        Setting("greedy", "greedy", SamplingParams(temperature=0.0)),
        Setting("top_k", "top-k 50", SamplingParams(temperature=0.8, top_k=50)),
        Setting("top_p", "top-p 0.9", SamplingParams(temperature=0.8, top_p=0.9)),
        Setting("top_k_top_p", "top-k 50 + top-p 0.9",
                SamplingParams(temperature=0.8, top_k=50, top_p=0.9)),
        Setting("min_p", "min-p 0.05", SamplingParams(temperature=0.8, min_p=0.05)),
        Setting("penalties", "top-k + top-p + penalties",
                SamplingParams(temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.1,
                               frequency_penalty=0.5, presence_penalty=0.5)),
    )
}


@dataclass(frozen=True)
class SamplingCase:
    """One measured configuration: ``batch`` rows of ``vocab`` logits sampled with ``setting``."""

    vocab: int
    setting: str
    batch: int


@dataclass(frozen=True)
class SamplingBenchConfig:
    """What the sampling benchmark measures."""

    vocabs: tuple[int, ...] = (32_000, 151_936)
    batches: tuple[int, ...] = (1, 16, 64)
    settings: tuple[str, ...] = tuple(SETTINGS)
    prompt_len: int = 512  # penalties: prompt tokens per row
    output_len: int = 128  # penalties: generated tokens per row
    device: str = "cpu"
    # 36 cases x 3 competitors: half a second each keeps the default run short on two cores;
    # a slow peer call (batch 64, vocab 151,936) is timed once or twice.
    timer: TimerConfig = field(default_factory=lambda: TimerConfig(warmup=1, repeats=20,
                                                                   budget_s=0.5))

    @classmethod
    def for_device(cls, device: str) -> SamplingBenchConfig:
        """The defaults on ``device``: the class defaults (sized for two CPU cores) except on
        CUDA, where the top-k and top-p settings run at vocabulary 151,936 and batch 1 to 256,
        with more calls (of a millisecond or less) timed."""
        if torch.device(device).type != "cuda":
            return cls(device=device)
        return cls(vocabs=(151_936,), batches=(1, 4, 16, 64, 256),
                   settings=("top_k", "top_p", "top_k_top_p"), device=device,
                   timer=TimerConfig(warmup=3, repeats=50, budget_s=0.5))

    def cases(self) -> list[SamplingCase]:
        """Every case: per vocabulary, per setting, the batches smallest first."""
        return [SamplingCase(vocab, setting, batch) for vocab in self.vocabs
                for setting in self.settings for batch in self.batches]


@dataclass(frozen=True)
class SamplingInputs:
    """One case's logits and what each competitor takes besides them, built outside timing."""

    logits: Tensor  # float32 [batch, vocab]
    tensors: SamplingTensors  # the setting's per-row tensors
    prompt_mask: Tensor | None  # bool [batch, vocab], penalties only
    output_counts: Tensor | None  # int32 [batch, vocab], penalties only
    token_ids: Tensor | None  # int64 [batch, prompt_len + output_len], penalties only (HF)


def make_sampling_inputs(setting: Setting, *, batch: int, vocab: int, prompt_len: int,
                         output_len: int, device: torch.device) -> SamplingInputs:
    """Random logits, the setting as per-row tensors and, with penalties, a random history."""
    # As an engine builds them: host columns (a request's seed, its first output position)
    # moved in one copy, read back on the device.
    params = [setting.params] * batch
    columns = SamplingTensors.host_columns(params, vocab, [resolve_seed(p) for p in params],
                                           [0] * batch)
    tensors = SamplingTensors.from_columns(StagingBuffer(device).send(columns)[0], params, vocab)
    prompt_mask = output_counts = token_ids = None
    if tensors.needs_penalties:
        prompt = torch.randint(vocab, (batch, prompt_len), device=device)
        output = torch.randint(vocab, (batch, output_len), device=device)
        prompt_mask = torch.zeros(batch, vocab, dtype=torch.bool, device=device)
        prompt_mask.scatter_(1, prompt, True)
        output_counts = torch.zeros(batch, vocab, dtype=torch.int32, device=device)
        output_counts.scatter_add_(1, output, torch.ones_like(output, dtype=torch.int32))
        token_ids = torch.cat([prompt, output], dim=1)
    return SamplingInputs(
        logits=torch.randn(batch, vocab, device=device) * 3,
        tensors=tensors,
        prompt_mask=prompt_mask,
        output_counts=output_counts,
        token_ids=token_ids,
    )


def hf_processors(setting: Setting) -> LogitsProcessorList:
    """The processors ``generate`` builds for ``setting``, in its order (``min_tokens_to_keep``
    1, as without beams); empty for greedy."""
    params = setting.params
    processors = LogitsProcessorList()
    if params.repetition_penalty != 1:
        processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.temperature == 0:  # do_sample=False: no warpers
        return processors
    if params.temperature != 1:
        processors.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k > 0:
        processors.append(TopKLogitsWarper(top_k=params.top_k))
    if params.top_p < 1:
        processors.append(TopPLogitsWarper(top_p=params.top_p))
    if params.min_p > 0:
        processors.append(MinPLogitsWarper(min_p=params.min_p))
    return processors


def hf_sample(logits: Tensor, token_ids: Tensor | None, processors: LogitsProcessorList,
              greedy: bool) -> Tensor:
    """One step of HF's sampling loop: processors, then argmax or softmax + multinomial."""
    scores = processors(token_ids, logits)
    if greedy:
        return scores.argmax(dim=-1)
    return torch.multinomial(scores.softmax(dim=-1), num_samples=1).squeeze(1)


def sort_sample(logits: Tensor, setting: Setting) -> Tensor:
    """A hand-written sampler: one descending sort serves top-k and top-p; min-p thresholds the
    softmax; greedy is argmax."""
    params = setting.params
    if params.temperature == 0:
        return logits.argmax(dim=-1)
    scaled = logits / params.temperature  # [batch, vocab]
    if params.top_k <= 0 and params.top_p >= 1:
        probs = scaled.softmax(dim=-1)
        if params.min_p > 0:
            probs = probs.masked_fill(probs < params.min_p * probs.amax(dim=-1, keepdim=True),
                                      0.0)
        return torch.multinomial(probs, num_samples=1).squeeze(1)
    sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [batch, vocab]
    if 0 < params.top_k < sorted_logits.shape[-1]:
        sorted_logits[:, params.top_k:] = float("-inf")
    probs = sorted_logits.softmax(dim=-1)
    if params.top_p < 1:
        mass_before = probs.cumsum(dim=-1) - probs  # the most likely token always stays
        probs = probs.masked_fill(mass_before >= params.top_p, 0.0)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs[:, :1], 0.0)
    choice = torch.multinomial(probs, num_samples=1)  # [batch, 1], index into the sorted row
    return order.gather(1, choice).squeeze(1)


def sampling_competitors(setting: Setting, inputs: SamplingInputs
                         ) -> dict[str, Callable[[], object]]:
    """One call of fastllm, the HF chain and the sort-based sampler on the same inputs."""
    x = inputs
    processors = hf_processors(setting)
    greedy = setting.params.is_greedy

    if not x.tensors.needs_penalties:
        return {
            "fastllm": lambda: fastllm.sample_next_tokens(x.logits, x.tensors).tokens,
            "hf": lambda: hf_sample(x.logits, x.token_ids, processors, greedy),
            "sort": lambda: sort_sample(x.logits, setting),
        }

    def fastllm_penalized() -> Tensor:
        logits = x.logits.clone()  # penalized in place
        return fastllm.sample_next_tokens(logits, x.tensors, prompt_mask=x.prompt_mask,
                                          output_counts=x.output_counts).tokens

    def sort_penalized() -> Tensor:
        t = x.tensors
        logits = reference.apply_penalties(  # returns a penalized copy
            x.logits, x.prompt_mask, x.output_counts, t.repetition_penalty,
            t.frequency_penalty, t.presence_penalty)
        return sort_sample(logits, setting)

    return {
        "fastllm": fastllm_penalized,
        "hf": lambda: hf_sample(x.logits.clone(), x.token_ids, processors, greedy),
        "sort": sort_penalized,
    }


def case_row(case: SamplingCase, timings: dict[str, Timing]) -> dict[str, object]:
    """The JSON row of one case: its fields and setting, each method's timing, the ratios."""
    setting = SETTINGS[case.setting]
    row: dict[str, object] = dict(vars(case))
    row["setting_label"] = setting.label
    row.update({f"setting_{key}": value for key, value in vars(setting.params).items()
                if key in SETTING_FIELDS})
    for name, timing in timings.items():
        row.update({f"{name}_{key}": value for key, value in timing.to_dict().items()})
    fastllm_s = timings["fastllm"].median_s
    row["speedup_vs_hf"] = timings["hf"].median_s / fastllm_s
    row["speedup_vs_sort"] = timings["sort"].median_s / fastllm_s
    return row


def run(config: SamplingBenchConfig) -> list[dict[str, object]]:
    """Times every case; returns the JSON rows."""
    device = torch.device(config.device)
    rows: list[dict[str, object]] = []
    for case in config.cases():
        torch.manual_seed(0)
        setting = SETTINGS[case.setting]
        inputs = make_sampling_inputs(setting, batch=case.batch, vocab=case.vocab,
                                      prompt_len=config.prompt_len,
                                      output_len=config.output_len, device=device)
        # As the engine calls it: parameters checked on the host when they were built.
        with fastllm.ops.trusted_inputs():
            timings = compare(sampling_competitors(setting, inputs), config.timer,
                              device=device)
        rows.append(case_row(case, timings))
        print(f"sampling: vocab={case.vocab} {case.setting} batch={case.batch} measured",
              flush=True)
    return rows


def goal_summary(rows: list[dict[str, object]]) -> str:
    """One line: the measured speedup over the HF chain where the headline goal is set."""
    goal = (f"Goal: fastllm >= {GOAL_SPEEDUP_VS_HF:g}x the HF chain at vocab {GOAL_VOCAB}, "
            f"{SETTINGS[GOAL_SETTING].label}, batch "
            + " and ".join(str(batch) for batch in GOAL_BATCHES))
    measured = {row["batch"]: row["speedup_vs_hf"] for row in rows
                if row["vocab"] == GOAL_VOCAB and row["setting"] == GOAL_SETTING
                and row["batch"] in GOAL_BATCHES}
    if not measured:
        return f"{goal}: not measured in this run."
    verdict = "met" if (len(measured) == len(GOAL_BATCHES)
                        and min(measured.values()) >= GOAL_SPEEDUP_VS_HF) else "NOT met"
    found = ", ".join(f"{format_cell(speedup)}x at batch {batch}"
                      for batch, speedup in sorted(measured.items()))
    return f"{goal}: measured {found} ({verdict})."


def tables(rows: list[dict[str, object]]) -> dict[str, str]:
    """The markdown tables of the report, by title."""
    labelled = [dict(row, label=SETTINGS[row["setting"]].label
                     + ("*" if SETTINGS[row["setting"]].beyond_hf else ""))
                for row in rows]
    columns = {"vocab": "vocab", "label": "setting", "batch": "batch"}
    columns |= {f"{name}_median_ms": f"{label} (ms)" for name, label in COMPETITORS.items()}
    columns |= {"speedup_vs_hf": "speedup vs HF chain", "speedup_vs_sort": "speedup vs sort"}
    footnote = ("\\* The HF chain applies the repetition penalty only: transformers has no "
                "frequency or presence processor. fastllm and sort-based apply all three.")
    table = markdown_table(labelled, columns)
    if any(SETTINGS[row["setting"]].beyond_hf for row in rows):
        table += "\n\n" + footnote
    return {
        "One token per row, float32 logits (median ms; speedup > 1: fastllm faster)":
            goal_summary(rows) + "\n\n" + table,
    }


def parse_args(argv: list[str] | None) -> tuple[SamplingBenchConfig, Path]:
    """The config and output folder from the command line."""
    defaults = SamplingBenchConfig.for_device(parse_device(argv))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results"),
                        help="folder for sampling.json and sampling.md (default %(default)s)")
    parser.add_argument("--vocabs", "--vocab", type=int, nargs="+",
                        default=list(defaults.vocabs), help="default %(default)s")
    parser.add_argument("--batches", "--batch", type=int, nargs="+",
                        default=list(defaults.batches), help="default %(default)s")
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS),
                        default=list(defaults.settings), help="default %(default)s")
    parser.add_argument("--device", default=defaults.device,
                        help="cpu or cuda; the other defaults depend on it (default "
                             "%(default)s)")
    TimerConfig.add_arguments(parser, defaults.timer)
    args = parser.parse_args(argv)
    config = SamplingBenchConfig(vocabs=tuple(args.vocabs), batches=tuple(args.batches),
                                 settings=tuple(args.settings), device=args.device,
                                 timer=TimerConfig.from_arguments(args))
    return config, args.out


def main(argv: list[str] | None = None) -> dict[str, object]:
    """Runs the benchmark, writes ``sampling.json`` and ``sampling.md``, prints the tables;
    returns the JSON document."""
    config, out = parse_args(argv)
    with torch.inference_mode():
        rows = run(config)
    return publish(benchmark="sampling", device=config.device, config=config, rows=rows,
                   tables=tables(rows), out=out)


if __name__ == "__main__":
    main()
