"""The ``fastllm`` command line.

    fastllm generate --model PATH --prompt "Once upon a time" --max-tokens 64 --temperature 0.7
    fastllm generate --model PATH --prompt "What is 2 + 2?" --chat
    fastllm generate --model PATH --prompt "Once upon a time" --quantization int4
    fastllm rerank --model PATH --query "capital of France" --docs docs.txt --top-n 3
    fastllm serve PATH [--host 127.0.0.1] [--port 8000] [--api-key KEY]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]


def _add_generate(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="generate text, streamed to the terminal",
                                   description="Generates a completion of --prompt and streams "
                                               "it to stdout.")
    parser.add_argument("--model", required=True, help="HF model folder or .gguf file")
    parser.add_argument("--prompt", required=True, help="the prompt text")
    parser.add_argument("--chat", action="store_true",
                        help="send the prompt as a user message through the chat template")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[],
                        help="a stop string (repeatable); it is not printed")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--quantization", default=None, choices=["int8", "int4"],
                        help="quantize a float checkpoint's weights at load (weight-only)")
    _add_kv_cache_dtype(parser)
    _add_batch_invariant(parser)
    parser.add_argument("--device", default="cpu")
    _add_tensor_parallel_size(parser)
    parser.set_defaults(run=_generate)


def _add_tensor_parallel_size(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="shard the model over this many ranks (one process per device)")


def _add_batch_invariant(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-invariant", action="store_true",
                        help="the same tokens for a seeded request whatever runs beside it, in "
                             "every dtype (slower prefill; CPU only)")


def _add_kv_cache_dtype(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv-cache-dtype", default="auto",
                        choices=["auto", "float32", "bfloat16", "float16"],
                        help="what the KV cache stores (auto: the model's dtype; a float32 "
                             "model may keep K/V in 16 bits)")


def _generate(args: argparse.Namespace) -> None:
    from fastllm import LLM, SamplingParams  # here, so --help needs no torch import

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed, max_tokens=args.max_tokens, stop=args.stop)
    llm = LLM(args.model, dtype=args.dtype, device=args.device, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype, batch_invariant=args.batch_invariant,
              tensor_parallel_size=args.tensor_parallel_size)
    prompt = (llm.chat_prompt([{"role": "user", "content": args.prompt}]) if args.chat
              else args.prompt)
    for delta in llm.stream(prompt, params):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")


def _add_rerank(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "rerank", help="rank documents for a query with a Qwen3-Reranker model",
        description="Scores each document of --docs against --query and prints one JSON line "
                    "per document, best first: {\"index\", \"score\", \"document\"}.")
    parser.add_argument("--model", required=True, help="HF model folder or .gguf file")
    parser.add_argument("--query", required=True)
    parser.add_argument("--docs", required=True, type=Path,
                        help="the documents: a text file with one per line (empty lines "
                             "skipped), or a .json file holding a list of strings")
    parser.add_argument("--top-n", type=int, default=None, help="print only the n best")
    parser.add_argument("--instruction", default=None,
                        help="the task instruction (default: the model card's web search one)")
    parser.add_argument("--max-length", type=int, default=8192)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    _add_kv_cache_dtype(parser)
    parser.add_argument("--device", default="cpu")
    parser.set_defaults(run=_rerank)


def _rerank(args: argparse.Namespace) -> None:
    from fastllm import Reranker

    text = args.docs.read_text(encoding="utf-8")
    if args.docs.suffix == ".json":
        documents = json.loads(text)
    else:
        documents = [line for line in text.splitlines() if line.strip()]
    reranker = Reranker(args.model, dtype=args.dtype, device=args.device,
                        instruction=args.instruction, max_length=args.max_length,
                        kv_cache_dtype=args.kv_cache_dtype)
    for result in reranker.rerank(args.query, documents, top_n=args.top_n):
        print(json.dumps({"index": result.index, "score": result.score,
                          "document": result.document}, ensure_ascii=False))


def _add_serve(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve a model over the OpenAI API (completions, chat, rerank)",
        description="An OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, "
                    "/v1/models, /v1/rerank, /health and /metrics.")
    parser.add_argument("model", help="HF model folder or .gguf file")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("FASTLLM_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 (default: "
                             "$FASTLLM_API_KEY, or none)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients send (default: the model's file or "
                             "folder name)")
    parser.add_argument("--chat-template", default=None,
                        help="a Jinja chat template file overriding the tokenizer's")
    parser.add_argument("--tool-call-parser", default=None,
                        help="the format the model writes tool calls in: hermes, llama3_json "
                             "or mistral (default: picked from the chat template)")
    parser.add_argument("--max-waiting-requests", type=int, default=256,
                        help="queued requests past which new ones get a 503")
    parser.add_argument("--max-body-bytes", type=int, default=4 << 20,
                        help="the largest request body (past it, a 413)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--quantization", default=None, choices=["int8", "int4"],
                        help="quantize a float checkpoint's weights at load (weight-only)")
    _add_kv_cache_dtype(parser)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-memory", type=int, default=None, help="bytes of KV pool")
    _add_batch_invariant(parser)
    parser.add_argument("--device", default="cpu")
    _add_tensor_parallel_size(parser)
    parser.add_argument("--pooling", default="last", choices=["last", "mean"],
                        help="how /v1/embeddings pools the final hidden states")
    parser.set_defaults(run=_serve)


def _serve(args: argparse.Namespace) -> None:
    from fastllm import AsyncLLM
    try:
        from fastllm.entrypoints.openai.api_server import ServerConfig, build_server
    except ModuleNotFoundError as error:
        raise OSError(f"fastllm serve needs the server's packages ({error.name} is missing): "
                      "pip install 'fastllm[server]'") from None

    config = ServerConfig(
        host=args.host, port=args.port, api_key=args.api_key,
        served_model_name=args.served_model_name,
        max_waiting_requests=args.max_waiting_requests, max_body_bytes=args.max_body_bytes,
        tool_call_parser=args.tool_call_parser,
        chat_template=(None if args.chat_template is None
                       else Path(args.chat_template).read_text(encoding="utf-8")),
        pooling=args.pooling)
    llm = AsyncLLM(args.model, dtype=args.dtype, device=args.device,
                   quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                   max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                   max_num_batched_tokens=args.max_num_batched_tokens,
                   kv_cache_memory=args.kv_cache_memory, batch_invariant=args.batch_invariant,
                   tensor_parallel_size=args.tensor_parallel_size)
    name = args.served_model_name or Path(args.model).name
    print(f"fastllm serve: {name} on http://{config.host}:{config.port}/v1", flush=True)
    try:
        build_server(llm, config, name).run()
    finally:
        llm.shutdown()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="fastllm", description="fast LLM inference")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_generate(subparsers)
    _add_rerank(subparsers)
    _add_serve(subparsers)
    args = parser.parse_args(argv)
    try:
        args.run(args)
    except (ValueError, TypeError, OSError) as error:
        parser.exit(2, f"fastllm {args.command}: error: {error}\n")


if __name__ == "__main__":
    main()
