"""The offline API: `LLM(model).generate(prompts, params)`, with the engine core in this process.

Chat prompts go through the renderer the frontend uses for the model (hybridserve/rendering/), so a chat
prompt here and the same messages sent to `hybridserve serve` are the same token ids."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from hybridserve.config import EngineConfig
from hybridserve.engine.async_llm import eos_token_ids, model_type
from hybridserve.engine.client import InprocEngineClient
from hybridserve.engine.core import EngineCore
from hybridserve.engine.fanout import expand
from hybridserve.engine.output_processor import ChoiceOutputs
from hybridserve.engine.outputs import Completion, CompletionOutput, FinalOutput, Logprob
from hybridserve.models.loader import resolve_model
from hybridserve.rendering.registry import renderer_for
from hybridserve.sampling_params import SamplingParams
from hybridserve.tokenizer import load_tokenizer


class LLM:
    def __init__(self, model: str | None = None, **engine_args: object) -> None:
        config = EngineConfig.of(model=model, **engine_args)
        resolved = resolve_model(config.model.model)
        self.config = config
        self.tokenizer = load_tokenizer(resolved.hf_dir)
        self.renderer = renderer_for(model_type(resolved.hf_dir), self.tokenizer)
        self.eos_token_ids = eos_token_ids(resolved.hf_dir, self.tokenizer)
        self.core = EngineCore(config, resolved.hf_dir)
        self.client = InprocEngineClient(self.core, config)
        self._ids = itertools.count()

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """The ids of `messages` rendered for the model's answer, as the frontend renders and tokenizes them."""
        return self.tokenizer.encode(self.renderer.render(messages), add_special_tokens=False)

    def generate(
        self,
        prompts: Sequence[str | list[int]],
        params: SamplingParams | None = None,
    ) -> list[FinalOutput]:
        """Run every prompt to completion, all batched together; results in prompt order."""
        params = params or SamplingParams()
        requests: list[tuple[FinalOutput, ChoiceOutputs]] = []
        for prompt in prompts:
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            final = FinalOutput(f"offline-{next(self._ids)}", ids, 0)
            children = expand(final.request_id, ids, params, self.eos_token_ids, self.client.facts.max_model_len)
            requests.append((final, ChoiceOutputs(self.tokenizer, children, self.client.abort)))
            for child in children:
                self.client.add_request(child)
        owner = {rid: (final, choices) for final, choices in requests for rid in choices.request_ids}
        token_ids: dict[str, list[int]] = {rid: [] for rid in owner}
        logprobs: dict[str, list[Logprob]] = {rid: [] for rid in owner}
        while not all(choices.done for _, choices in requests):
            for out in self.client.step().outputs:
                if out.request_id not in owner:  # an earlier call's request a stop string ended: its abort
                    continue
                final, choices = owner[out.request_id]
                update = choices.feed(out)
                if update is None:
                    continue
                if update.prompt_logprobs is not None:
                    final.prompt_logprobs = update.prompt_logprobs
                token_ids[out.request_id].extend(update.delta_token_ids)
                logprobs[out.request_id].extend(update.delta_logprobs or [])
                if update.finish_reason is not None:
                    wants_logprobs = params.logprobs is not None
                    completion = _completion(
                        update, token_ids[out.request_id], logprobs[out.request_id], wants_logprobs
                    )
                    final.outputs.append(completion)
        for final, choices in requests:
            final.num_cached_tokens = choices.num_cached_tokens
            final.outputs.sort(key=lambda o: o.index)
        return [final for final, _ in requests]


def _completion(
    last: CompletionOutput, token_ids: list[int], logprobs: list[Logprob], wants_logprobs: bool
) -> Completion:
    return Completion(
        last.index,
        last.text,
        token_ids,
        logprobs if wants_logprobs else None,
        last.finish_reason,
        last.stop_reason,
        last.error,
    )
