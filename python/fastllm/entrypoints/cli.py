"""The ``fastllm`` command line (``fastllm --help``, ``fastllm SUBCOMMAND --help``).

    fastllm chat Qwen/Qwen3-0.6B --system-prompt "Answer briefly."
    fastllm generate PATH --prompt "Once upon a time" --max-tokens 64 --temperature 0.7
    fastllm generate PATH --prompt "What is 2 + 2?" --chat --quantization int4
    fastllm serve Qwen/Qwen3-0.6B [--host 127.0.0.1] [--port 8000] [--api-key KEY] [-dp 2]
    fastllm rerank PATH --query "capital of France" --docs docs.txt --top-n 3

MODEL is a model folder, a .gguf file or a model on the Hugging Face Hub by name
(:mod:`fastllm.hub`). Each subcommand's options come in groups as vLLM's help has them (model,
engine, sampling, server); a group shared by several subcommands is defined once, below.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations; each command imports what it runs when it runs
    from fastllm import AsyncLLM, SamplingParams

__all__ = ["main"]

_EXAMPLES = """examples:
  fastllm chat Qwen/Qwen3-0.6B
  fastllm generate Qwen/Qwen3-0.6B-GGUF:Q8_0 --prompt "Once upon a time" --max-tokens 64
  fastllm serve Qwen/Qwen3-0.6B --port 8000
  fastllm rerank Qwen/Qwen3-Reranker-0.6B --query "capital of France" --docs docs.txt

Each subcommand's --help lists its options."""

_CHAT_COMMANDS = """commands:
  /clear        start a new conversation (the system prompt stays)
  /exit, /bye   exit (as Ctrl-D does)
Ctrl-C stops a reply; what it had written stays in the conversation."""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and epilogs as written; ``(default: X)`` after each option that has a
    default value (an option whose default needs words says it in its own help)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("(default:" in text or not action.option_strings or action.nargs == 0
                or action.default in (None, [], argparse.SUPPRESS)):
            return text
        return f"{text} (default: %(default)s)"


def _add_subcommand(subparsers: argparse._SubParsersAction, name: str, usage: str, summary: str,
                    description: str) -> argparse.ArgumentParser:
    return subparsers.add_parser(name, usage=f"fastllm {name} {usage}", help=summary,
                                 description=description, formatter_class=_HelpFormatter)


# ---- option groups, each defined once ------------------------------------------------------------

def _add_model_group(parser: argparse.ArgumentParser, *, llm: bool) -> argparse._ArgumentGroup:
    """MODEL and how to load it; ``llm``: with the options :class:`fastllm.LLM` takes and
    :class:`fastllm.Reranker` does not (tokenizer, quantization). Returns the group, for a
    subcommand's own model options."""
    group = parser.add_argument_group("model")
    group.add_argument("model", nargs="?", metavar="MODEL",
                       help="a model folder (config.json, *.safetensors, tokenizer files), a "
                            ".gguf file, or a model on the Hugging Face Hub: org/name "
                            "(safetensors), org/name:QUANT or org/name/FILE.gguf (a GGUF repo, "
                            "as llama.cpp's -hf takes it), downloaded into huggingface_hub's "
                            "cache (HF_HOME, HF_TOKEN and HF_HUB_OFFLINE apply)")
    group.add_argument("--model", dest="model_option", metavar="MODEL",
                       help="MODEL given as an option")
    group.add_argument("--revision", metavar="REV",
                       help="the hub model's branch, tag or commit (default: main)")
    if llm:
        group.add_argument("--tokenizer", metavar="NAME",
                           help="a folder, .gguf file or hub name to read the tokenizer from "
                                "(default: MODEL's)")
        group.add_argument("--tokenizer-revision", metavar="REV",
                           help="the hub tokenizer's branch, tag or commit (default: main)")
    group.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                       help="the weights' and activations' dtype")
    if llm:
        group.add_argument("--quantization", choices=["int8", "int4"],
                           help="quantize a float checkpoint's weights at load, weight-only "
                                "(default: none; a quantized GGUF loads as it is)")
    return group


def _add_engine_group(parser: argparse.ArgumentParser, *, llm: bool) -> None:
    """Where the model runs and its KV cache; ``llm``: with :class:`fastllm.LLM`'s scheduling
    and parallelism options."""
    group = parser.add_argument_group("engine")
    group.add_argument("--device", default="cpu", help="where the model and KV cache live")
    group.add_argument("--kv-cache-dtype", default="auto",
                       choices=["auto", "float32", "bfloat16", "float16"],
                       help="what the KV cache stores (auto: the model's dtype; a float32 model "
                            "may keep K/V in 16 bits)")
    if not llm:
        return
    group.add_argument("--max-model-len", type=int, metavar="N",
                       help="the most tokens (prompt and output) of one sequence (default: the "
                            "model's context, up to 8192)")
    group.add_argument("--kv-cache-memory", type=int, metavar="BYTES",
                       help="bytes of the paged KV pool (default: a share of the free memory)")
    group.add_argument("--max-num-seqs", type=int, default=32, metavar="N",
                       help="the most sequences in one batch")
    group.add_argument("--max-num-batched-tokens", type=int, default=2048, metavar="N",
                       help="the most tokens one engine step computes")
    group.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                       help="shard the model over this many ranks (one process per device)")
    group.add_argument("--batch-invariant", action="store_true",
                       help="the same tokens for a seeded request whatever runs beside it, in "
                            "every dtype (slower prefill; CPU only)")


def _llm_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The options of the model and engine groups (``llm=True``) as fastllm.LLM's arguments."""
    return dict(revision=args.revision, tokenizer=args.tokenizer,
                tokenizer_revision=args.tokenizer_revision, dtype=args.dtype,
                quantization=args.quantization, device=args.device,
                kv_cache_dtype=args.kv_cache_dtype, max_model_len=args.max_model_len,
                kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                tensor_parallel_size=args.tensor_parallel_size,
                batch_invariant=args.batch_invariant)


def _add_sampling_group(parser: argparse.ArgumentParser, max_tokens: int | None,
                        max_tokens_help: str) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--temperature", type=float, default=1.0, metavar="T", help="0 = greedy")
    group.add_argument("--top-p", type=float, default=1.0, metavar="P",
                       help="keep the most likely tokens up to this probability mass")
    group.add_argument("--top-k", type=int, default=0, metavar="K",
                       help="keep the k most likely tokens; 0 = all")
    group.add_argument("--seed", type=int, metavar="N",
                       help="makes the sampled tokens reproducible (default: a fresh seed)")
    group.add_argument("--max-tokens", type=int, default=max_tokens, metavar="N",
                       help=max_tokens_help)
    group.add_argument("--stop", action="append", default=[], metavar="TEXT",
                       help="a stop string (repeatable); it is not printed")


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The sampling group's options; an unset --max-tokens (chat's default) leaves
    SamplingParams' own, for the caller to replace."""
    from fastllm import SamplingParams

    limit = {} if args.max_tokens is None else {"max_tokens": args.max_tokens}
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          seed=args.seed, stop=args.stop, **limit)


# ---- generate ------------------------------------------------------------------------------------

def _add_generate(subparsers: argparse._SubParsersAction) -> None:
    parser = _add_subcommand(subparsers, "generate", "MODEL --prompt TEXT [options]",
                             "complete a prompt, streamed to the terminal",
                             "Generates a completion of --prompt and streams it to stdout.")
    _add_model_group(parser, llm=True)
    group = parser.add_argument_group("input")
    group.add_argument("--prompt", required=True, metavar="TEXT", help="the prompt text")
    group.add_argument("--chat", action="store_true",
                       help="send the prompt as a user message through the chat template")
    _add_sampling_group(parser, 256, "the most tokens to generate")
    _add_engine_group(parser, llm=True)
    parser.set_defaults(run=_generate)


def _generate(args: argparse.Namespace) -> None:
    from fastllm import LLM

    params = _sampling_params(args)
    llm = LLM(args.model, **_llm_kwargs(args))
    prompt = (llm.chat_prompt([{"role": "user", "content": args.prompt}]) if args.chat
              else args.prompt)
    for delta in llm.stream(prompt, params):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")


# ---- chat ----------------------------------------------------------------------------------------

def _add_chat(subparsers: argparse._SubParsersAction) -> None:
    parser = _add_subcommand(
        subparsers, "chat", "MODEL [options]", "chat with a model in the terminal",
        "An interactive chat in the terminal: each line typed is a user message; the\n"
        "conversation so far goes through the model's chat template, and the reply streams\n"
        "back.\n\n" + _CHAT_COMMANDS)
    _add_model_group(parser, llm=True)
    group = parser.add_argument_group("chat")
    group.add_argument("--system-prompt", metavar="TEXT",
                       help="a system message that starts every conversation (default: none)")
    _add_sampling_group(parser, None, "the most tokens of one reply (default: as many as the "
                                      "context has room for)")
    _add_engine_group(parser, llm=True)
    parser.set_defaults(run=_chat)


def _chat(args: argparse.Namespace) -> None:
    from fastllm import AsyncLLM
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:  # not on Windows
        pass

    params = _sampling_params(args)
    # AsyncLLM: the engine steps on its own thread, so Ctrl-C cancels the reply between steps
    # (never inside one) and the stream's finish reason says when --max-tokens cut a reply.
    llm = AsyncLLM(args.model, **_llm_kwargs(args))
    try:
        if llm.client.tokenizer.chat_template is None:
            raise ValueError(f"{args.model} has no chat template: fastllm chat needs one "
                             "(fastllm generate completes plain text)")
        print(f"fastllm chat: {args.model} ({llm.client.max_model_len}-token context). "
              "/exit or Ctrl-D exits, /clear starts over, /? lists the commands.")
        with asyncio.Runner() as runner:
            _converse(llm, runner, params, args.max_tokens, args.system_prompt)
    finally:
        llm.shutdown()


def _converse(llm: AsyncLLM, runner: asyncio.Runner, params: SamplingParams,
              max_tokens: int | None, system_prompt: str | None) -> None:
    """Reads the user's lines and answers them, until /exit, /bye or end of input."""
    start = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
    messages = list(start)
    while True:
        try:
            line = input(">>> ").strip()
        except KeyboardInterrupt:
            print("\nUse Ctrl + d or /bye to exit.")
            continue
        except EOFError:
            print()
            return
        if line in ("/exit", "/bye"):
            return
        if line == "/clear":
            messages = list(start)
            print("Cleared the conversation.")
        elif line.startswith("/"):
            print(_CHAT_COMMANDS if line in ("/?", "/help")
                  else f"Unknown command {line.split()[0]!r}.\n{_CHAT_COMMANDS}")
        elif line:
            messages.append({"role": "user", "content": line})
            reply = _reply(llm, runner, messages, params, max_tokens)
            if reply is None:
                messages.pop()
            else:
                messages.append({"role": "assistant", "content": reply})


def _reply(llm: AsyncLLM, runner: asyncio.Runner, messages: list[dict[str, str]],
           params: SamplingParams, max_tokens: int | None) -> str | None:
    """Streams the reply to ``messages`` to stdout and returns it (as far as it went, when
    Ctrl-C stopped it); None, with the reason printed, when the conversation cannot go on."""
    context = llm.client.max_model_len
    try:
        prompt = llm.client.chat_prompt(messages)
    except ValueError as error:  # the template refuses the conversation
        print(f"error: {error}")
        return None
    room = context - len(prompt["prompt_token_ids"])
    if room <= 0:
        print(f"The conversation fills the {context}-token context: /clear starts a new one.")
        return None
    limit = room if max_tokens is None else min(max_tokens, room)
    pieces: list[str] = []

    async def stream() -> str | None:
        finish_reason = None
        async for delta in llm.stream_outputs(prompt, dataclasses.replace(params,
                                                                          max_tokens=limit)):
            sys.stdout.write(delta.text)
            sys.stdout.flush()
            pieces.append(delta.text)
            finish_reason = delta.finish_reason
        return finish_reason

    try:
        # Ctrl-C cancels the stream (asyncio.Runner's handler), which aborts the request and
        # frees its KV blocks.
        finish_reason = runner.run(stream())
    except KeyboardInterrupt:
        finish_reason = "abort"
    print()
    if finish_reason == "length":
        print(f"[cut at --max-tokens {limit}]" if limit < room else
              f"[cut: the conversation fills the {context}-token context; /clear starts a "
              "new one]")
    return "".join(pieces)


# ---- rerank --------------------------------------------------------------------------------------

def _add_rerank(subparsers: argparse._SubParsersAction) -> None:
    parser = _add_subcommand(
        subparsers, "rerank", "MODEL --query TEXT --docs FILE [options]",
        "rank documents for a query with a Qwen3-Reranker model",
        "Scores each document of --docs against --query and prints one JSON line per\n"
        "document, best first: {\"index\", \"score\", \"document\"}.")
    _add_model_group(parser, llm=False)
    group = parser.add_argument_group("rerank")
    group.add_argument("--query", required=True, metavar="TEXT", help="the query")
    group.add_argument("--docs", required=True, type=Path, metavar="FILE",
                       help="the documents: a text file with one per line (empty lines "
                            "skipped), or a .json file holding a list of strings")
    group.add_argument("--top-n", type=int, metavar="N",
                       help="print only the N best (default: all)")
    group.add_argument("--instruction", metavar="TEXT",
                       help="the task instruction (default: the model card's web search one)")
    group.add_argument("--max-length", type=int, default=8192, metavar="N",
                       help="the most tokens of a wrapped (query, document) pair")
    _add_engine_group(parser, llm=False)
    parser.set_defaults(run=_rerank)


def _rerank(args: argparse.Namespace) -> None:
    from fastllm import Reranker

    text = args.docs.read_text(encoding="utf-8")
    if args.docs.suffix == ".json":
        documents = json.loads(text)
    else:
        documents = [line for line in text.splitlines() if line.strip()]
    reranker = Reranker(args.model, revision=args.revision, dtype=args.dtype,
                        device=args.device, instruction=args.instruction,
                        max_length=args.max_length, kv_cache_dtype=args.kv_cache_dtype)
    for result in reranker.rerank(args.query, documents, top_n=args.top_n):
        print(json.dumps({"index": result.index, "score": result.score,
                          "document": result.document}, ensure_ascii=False))


# ---- serve ---------------------------------------------------------------------------------------

def _add_serve(subparsers: argparse._SubParsersAction) -> None:
    parser = _add_subcommand(
        subparsers, "serve", "MODEL [options]",
        "serve a model over the OpenAI API (completions, chat, embeddings, rerank)",
        "An OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions,\n"
        "/v1/embeddings, /v1/models, /v1/rerank, /health and /metrics.")
    model = _add_model_group(parser, llm=True)
    model.add_argument("--served-model-name", metavar="NAME",
                       help="the model name clients send and see (default: MODEL as given)")
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", metavar="ADDRESS",
                       help="address to listen on (127.0.0.1: this machine only; 0.0.0.0: "
                            "every interface)")
    group.add_argument("--port", type=int, default=8000, help="port to listen on")
    group.add_argument("--api-key", default=os.environ.get("FASTLLM_API_KEY"), metavar="KEY",
                       help="require 'Authorization: Bearer KEY' on /v1 (default: "
                            "$FASTLLM_API_KEY, or none)")
    group.add_argument("--chat-template", metavar="FILE",
                       help="a Jinja chat template file overriding the tokenizer's")
    group.add_argument("--tool-call-parser", metavar="NAME",
                       help="the format the model writes tool calls in: hermes, llama3_json or "
                            "mistral (default: picked from the chat template)")
    group.add_argument("--reasoning-parser", metavar="NAME",
                       help="the way the model marks its reasoning, returned apart from the "
                            "answer: qwen3 or deepseek_r1 (default: none)")
    group.add_argument("--pooling", default="last", choices=["last", "mean"],
                       help="how /v1/embeddings pools the final hidden states")
    group.add_argument("--max-waiting-requests", type=int, default=256, metavar="N",
                       help="queued requests past which new ones get a 503")
    group.add_argument("--max-body-bytes", type=int, default=4 << 20, metavar="BYTES",
                       help="the largest request body (past it, a 413)")
    _add_engine_group(parser, llm=True)
    group.add_argument("--kv-events-config", metavar="JSON",
                       help="publish the prefix cache's changes for routers, as vLLM's: e.g. "
                            "'{\"enable_kv_cache_events\": true, \"endpoint\": "
                            "\"tcp://*:5557\"}'")
    group.add_argument("--prefix-caching-hash-algo", default="sha256", choices=["sha256"],
                       help="the block hashes KV-cache events carry (fastllm.engine.kv_events)")
    group = parser.add_argument_group("data parallelism")
    group.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="N",
                       help="serve N replicas of the engine, each in a process of its own (and "
                            "each with --tensor-parallel-size ranks), behind one server on "
                            "--port: a request goes to the replica with the fewest in flight, "
                            "or to the one that served its prompt's beginning (its prefix "
                            "cache); CPU threads are shared out, CUDA replicas get devices of "
                            "their own")
    group.add_argument("--data-parallel-prefix-affinity", default=True,
                       action=argparse.BooleanOptionalAction,
                       help="send a request whose prompt begins as an earlier one's to the "
                            "replica that served that one (whose prefix cache holds it) unless "
                            "it is busier than the others by a margin; off: always the replica "
                            "with the fewest in flight")
    group.add_argument("--data-parallel-rank", type=int, metavar="R",
                       help="serve alone as rank R of --data-parallel-size (one server per node "
                            "behind a router): metrics labelled engine=\"R\", KV events on the "
                            "--kv-events-config ports + R (default: none)")
    # How a data-parallel router starts its replicas: where each listens, and whom it outlives.
    group.add_argument("--data-parallel-socket", help=argparse.SUPPRESS)
    group.add_argument("--data-parallel-parent", type=int, help=argparse.SUPPRESS)
    group = parser.add_argument_group("LoRA")
    group.add_argument("--enable-lora", action="store_true",
                       help="serve LoRA adapters: a request's model names one")
    group.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                       help="adapters served from the start: name=path (a peft folder or hub "
                            "repo) or JSON {\"name\": ..., \"path\": ...}")
    group.add_argument("--max-loras", type=int, default=1, metavar="N",
                       help="adapters in one batch at most")
    group.add_argument("--max-lora-rank", type=int, default=16, metavar="R",
                       help="the largest rank an adapter may have")
    group.add_argument("--max-cpu-loras", type=int, metavar="N",
                       help="adapters kept loaded in host memory (default: --max-loras)")
    group.add_argument("--allow-runtime-lora-updating", action="store_true",
                       default=os.environ.get("FASTLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower()
                       in ("1", "true"),
                       help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter (default: "
                            "$FASTLLM_ALLOW_RUNTIME_LORA_UPDATING)")
    parser.set_defaults(run=_serve)


def _lora_modules(values: Sequence[str]) -> dict[str, str]:
    """--lora-modules' adapters, name -> path, from ``name=path`` or vLLM's JSON form."""
    modules: dict[str, str] = {}
    for value in values:
        if value.lstrip().startswith("{"):
            try:
                entry = json.loads(value)
            except ValueError as error:
                raise ValueError(f"--lora-modules: {value!r} is not valid JSON: {error}") from None
            if not isinstance(entry, dict) or not all(
                    isinstance(entry.get(key), str) for key in ("name", "path")):
                raise ValueError(f"--lora-modules: {value!r} needs string fields name and path")
            name, path = entry["name"], entry["path"]
        else:
            name, _, path = value.partition("=")
        if not name or not path:
            raise ValueError(f"--lora-modules takes name=path, got {value!r}")
        if name in modules:
            raise ValueError(f"--lora-modules names adapter {name!r} twice")
        modules[name] = path
    return modules


def _check_data_parallel(args: argparse.Namespace) -> None:
    size, rank = args.data_parallel_size, args.data_parallel_rank
    if size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {size}")
    if rank is not None and not 0 <= rank < size:
        raise ValueError(f"--data-parallel-rank must be in [0, --data-parallel-size={size}), got "
                         f"{rank}")
    if args.data_parallel_socket is not None and rank is None:
        raise ValueError("--data-parallel-socket needs --data-parallel-rank")


def _serve(args: argparse.Namespace) -> None:
    from fastllm import AsyncLLM
    try:
        from fastllm.entrypoints.openai import data_parallel
        from fastllm.entrypoints.openai.api_server import ServerConfig, build_server
    except ModuleNotFoundError as error:
        raise OSError(f"fastllm serve needs the server's packages ({error.name} is missing): "
                      "pip install 'fastllm[server]'") from None

    _check_data_parallel(args)
    rank = args.data_parallel_rank
    name = args.served_model_name or args.model
    config = ServerConfig(
        host=args.host, port=args.port, api_key=args.api_key,
        max_waiting_requests=args.max_waiting_requests, max_body_bytes=args.max_body_bytes,
        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
        chat_template=(None if args.chat_template is None
                       else Path(args.chat_template).read_text(encoding="utf-8")),
        pooling=args.pooling, lora_modules=_lora_modules(args.lora_modules),
        allow_runtime_lora_updating=args.allow_runtime_lora_updating, data_parallel_rank=rank)
    if (config.lora_modules or config.allow_runtime_lora_updating) and not args.enable_lora:
        raise ValueError("--lora-modules and --allow-runtime-lora-updating need --enable-lora")
    kv_events = None
    if args.kv_events_config is not None:
        try:
            kv_events = json.loads(args.kv_events_config)
        except ValueError as error:
            raise ValueError(f"--kv-events-config is not valid JSON: {error}") from None
        if rank is not None and isinstance(kv_events, dict):
            kv_events["data_parallel_rank"] = rank
    if args.data_parallel_size > 1 and rank is None:  # the router, in front of its replicas
        data_parallel.serve_data_parallel(
            args.argv, data_parallel.RouterConfig(
                args.data_parallel_size, max_body_bytes=args.max_body_bytes,
                prefix_affinity=args.data_parallel_prefix_affinity),
            args.host, args.port, name, args.device, args.tensor_parallel_size)
        return
    if args.data_parallel_parent is not None:
        data_parallel.watch_parent(args.data_parallel_parent)
    llm = AsyncLLM(args.model, **_llm_kwargs(args), enable_lora=args.enable_lora,
                   max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                   max_cpu_loras=args.max_cpu_loras, kv_events_config=kv_events)
    try:
        server = build_server(llm, config, name)
        # What start-up made (modules, the model, the app) lives as long as the server: frozen
        # out of the cyclic collector's sight, a full collection between requests walks only
        # what requests made (vLLM freezes its engine's start-up heap too).
        gc.collect()
        gc.freeze()
        if args.data_parallel_socket is not None:  # a replica: its router says where it is
            data_parallel.exit_when_engine_fails(llm)
            server.run(sockets=[data_parallel.bind_unix(args.data_parallel_socket)])
            return
        print(f"fastllm serve: {name} on http://{config.host}:{config.port}/v1", flush=True)
        server.run()
    finally:
        llm.shutdown()


# ---- the command ---------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> None:
    """Runs the ``fastllm`` command line on ``argv`` (default: ``sys.argv[1:]``). Bad input
    exits with status 2 and a one-line message."""
    parser = argparse.ArgumentParser(
        prog="fastllm", usage="fastllm SUBCOMMAND MODEL [options]",
        description="fastllm: fast LLM inference on CPUs and GPUs, with vLLM's interfaces.",
        epilog=_EXAMPLES, formatter_class=_HelpFormatter)
    subparsers = parser.add_subparsers(title="subcommands", dest="command", required=True,
                                       metavar="SUBCOMMAND")
    for add in (_add_chat, _add_generate, _add_serve, _add_rerank):
        add(subparsers)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.argv = argv  # a data-parallel server starts its replicas with them
    command = subparsers.choices[args.command]
    if args.model_option is not None:
        if args.model is not None:
            command.error(f"MODEL given twice: {args.model} and --model {args.model_option}")
        args.model = args.model_option
    if args.model is None:
        command.error("the following arguments are required: MODEL (or --model)")
    try:
        args.run(args)
    except (ValueError, TypeError, OSError) as error:
        parser.exit(2, f"fastllm {args.command}: error: {error}\n")
    except KeyboardInterrupt:  # while loading, or generate stopped: no traceback
        parser.exit(130, "\n")


if __name__ == "__main__":
    main()
