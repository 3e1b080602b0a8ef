"""POST /tokenize and POST /detokenize, in vLLM's shapes.

/tokenize takes a completion prompt (`prompt`) or a chat (`messages`, with `tools` and `chat_template_kwargs`) and
answers `{"count", "max_model_len", "tokens", "token_strs"}`. A chat goes through Chat Completions' own steps (the
model's extension, tools, renderer, tokenizing), so its tokens are the prompt ids /v1/chat/completions hands the
engine for the same messages; a prompt is tokenized as /v1/completions tokenizes it. /detokenize turns ids back
into text (`{"prompt"}`); an id outside the vocabulary is a 400 naming it.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from hybridserve.serving.engine import ServingEngine
from hybridserve.serving.extensions.base import ServingExtension
from hybridserve.serving.openai.body import parse_body
from hybridserve.serving.openai.errors import APIError, json_response
from hybridserve.serving.openai.models import check_model
from hybridserve.serving.openai.openapi import errors, json_body
from hybridserve.serving.openai.preamble import Preamble, chat_dialect
from hybridserve.serving.openai.prompt import check_vocabulary, off_loop
from hybridserve.serving.openai.protocol import ChatCompletionRequest, ChatMessage, RequestModel


class TokenizeRequest(RequestModel):
    """vLLM's two forms in one model: exactly one of `prompt` (completion) and `messages` (chat)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # the completion form's default: true; the chat form's: false
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


class TokenizeService:
    def __init__(self, engine: ServingEngine, extension: ServingExtension) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.extension = extension
        self.preamble = Preamble(engine, extension)
        self.vocab_size = len(engine.tokenizer)

    async def tokenize(self, req: TokenizeRequest) -> Response:
        check_model(self.engine, req.model)
        if req.prompt is None and req.messages is None:
            raise APIError(
                400,
                "Missing required parameter: 'prompt' (a completion prompt) or 'messages' (a chat).",
                param="prompt",
                code="missing_required_parameter",
            )
        if req.prompt is not None and req.messages is not None:
            raise APIError(400, "Send either 'prompt' or 'messages', not both.", param="messages")
        if req.messages is not None:
            ids = await self._chat(req, req.messages)
        else:
            special = req.add_special_tokens is not False
            ids = await off_loop(len(req.prompt), self.tokenizer.encode, req.prompt, add_special_tokens=special)
        strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        body = {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids, "token_strs": strs}
        return json_response(body)

    async def _chat(self, req: TokenizeRequest, messages: list[ChatMessage]) -> list[int]:
        """The prompt ids of a chat request with these messages, tools and template kwargs."""
        if req.add_generation_prompt and req.continue_final_message:
            raise APIError(
                400,
                "continue_final_message and add_generation_prompt cannot both be true: set add_generation_prompt "
                "to false to continue the final message.",
                param="continue_final_message",
            )
        kwargs = {"add_generation_prompt": req.add_generation_prompt, **(req.chat_template_kwargs or {})}
        if req.continue_final_message:
            kwargs["continue_final_message"] = True
        chat = ChatCompletionRequest(messages=messages, tools=req.tools, chat_template_kwargs=kwargs)
        chat = self.extension.apply_chat_extensions(chat)
        dialect = chat_dialect(chat.max_tokens_param)
        tools = await self.preamble.tools(dialect, chat.tools, chat.tool_choice, chat.parallel_tool_calls)
        prompt = await self.preamble.render(dialect, chat.template_messages(), tools, chat.chat_template_kwargs)
        if not req.add_special_tokens:
            return prompt.ids  # exactly the ids a chat completion hands the engine
        return await off_loop(len(prompt.text), self.tokenizer.encode, prompt.text, add_special_tokens=True)

    async def detokenize(self, req: DetokenizeRequest) -> Response:
        check_model(self.engine, req.model)
        check_vocabulary(req.tokens, self.vocab_size, "tokens", "tokens")
        return json_response({"prompt": await off_loop(len(req.tokens), self.tokenizer.decode, req.tokens)})


def add_tokenize_routes(app: FastAPI, service: TokenizeService, max_body_bytes: int) -> None:
    @app.post("/tokenize", openapi_extra=json_body(TokenizeRequest), responses=errors(400, 404, 413))
    async def tokenize(request: Request) -> Response:
        return await service.tokenize(await parse_body(request, TokenizeRequest, max_body_bytes))

    @app.post("/detokenize", openapi_extra=json_body(DetokenizeRequest), responses=errors(400, 404, 413))
    async def detokenize(request: Request) -> Response:
        return await service.detokenize(await parse_body(request, DetokenizeRequest, max_body_bytes))
