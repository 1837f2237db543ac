"""vLLM's ``POST /tokenize`` and ``POST /detokenize``, as routers and RL frameworks call them:
a prompt (or a conversation through the chat template, tools included) to the token ids the
engine would run, and token ids back to text."""

from __future__ import annotations

from fastllm.entrypoints.openai import protocol as api
from fastllm.entrypoints.openai.serving import APIError, OpenAIServing

__all__ = ["TokenizationServing"]


class TokenizationServing:
    """Tokenizes and detokenizes with ``serving``'s tokenizer and chat template."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    def tokenize(self, req: api.TokenizeRequest) -> api.TokenizeResponse:
        self.serving.check_model(req.model)
        tokenizer = self.serving.tokenizer
        if req.prompt is not None:
            tokens = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens
                                      is not False)
        else:
            if req.add_special_tokens:
                raise APIError(400, "add_special_tokens takes a prompt: with messages the chat "
                                    "template writes the special tokens",
                               param="add_special_tokens")
            chat = api.ChatCompletionRequest(model=req.model, messages=req.messages,
                                             tools=req.tools,
                                             chat_template_kwargs=req.chat_template_kwargs)
            tokens = self.serving.chat_prompt(chat, self.serving.tool_use(chat),
                                              req.add_generation_prompt)
        return api.TokenizeResponse(
            count=len(tokens), max_model_len=self.serving.max_model_len, tokens=tokens,
            token_strs=tokenizer.convert_ids_to_tokens(tokens) if req.return_token_strs
            else None)

    def detokenize(self, req: api.DetokenizeRequest) -> api.DetokenizeResponse:
        self.serving.check_model(req.model)
        bad = [t for t in req.tokens if t >= self.serving.vocab_size]
        if bad:
            raise APIError(400, f"token ids {bad[:8]} are outside the vocabulary [0, "
                                f"{self.serving.vocab_size})", param="tokens")
        return api.DetokenizeResponse(prompt=self.serving.tokenizer.decode(req.tokens))
