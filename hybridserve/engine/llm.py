"""The offline API: `LLM(model).generate(prompts, params)`, with the engine core in this process."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from hybridserve.config import EngineConfig
from hybridserve.engine.async_llm import eos_token_ids
from hybridserve.engine.core import EngineCore
from hybridserve.engine.fanout import expand
from hybridserve.engine.output_processor import SequenceOutput
from hybridserve.engine.outputs import Completion, CompletionOutput, FinalOutput, Logprob
from hybridserve.models.loader import resolve_model
from hybridserve.sampling_params import SamplingParams
from hybridserve.tokenizer import load_tokenizer


class LLM:
    def __init__(self, model: str | None = None, **engine_args: object) -> None:
        config = EngineConfig(model=model, **engine_args)  # type: ignore[arg-type]
        resolved = resolve_model(config.model)
        self.config = config
        self.tokenizer = load_tokenizer(resolved.hf_dir)
        self.eos_token_ids = eos_token_ids(resolved.hf_dir, self.tokenizer)
        self.core = EngineCore(config, resolved.hf_dir)
        self._ids = itertools.count()

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def generate(
        self,
        prompts: Sequence[str | list[int]],
        params: SamplingParams | None = None,
    ) -> list[FinalOutput]:
        """Run every prompt to completion, all batched together; results in prompt order."""
        params = params or SamplingParams()
        finals: list[FinalOutput] = []
        seqs: dict[str, tuple[SequenceOutput, FinalOutput, list[int], list[Logprob]]] = {}
        for prompt in prompts:
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            final = FinalOutput(f"offline-{next(self._ids)}", ids, 0)
            finals.append(final)
            for i, child in enumerate(
                expand(final.request_id, ids, params, self.eos_token_ids, self.core.max_model_len)
            ):
                seqs[child.request_id] = (SequenceOutput(self.tokenizer, child, i), final, [], [])
                self.core.add_request(child)
        pending = set(seqs)
        while pending:
            for out in self.core.step().outputs:
                seq, final, token_ids, logprobs = seqs[out.request_id]
                if seq.finished:
                    continue
                update = seq.update(out)
                final.num_cached_tokens = max(final.num_cached_tokens, out.num_cached_tokens)
                if update is not None:
                    token_ids.extend(update.delta_token_ids)
                    logprobs.extend(update.delta_logprobs or [])
                if seq.stopped_by_string:
                    self.core.abort([out.request_id])
                if seq.finished:
                    pending.discard(out.request_id)
                    final.outputs.append(_completion(update, token_ids, logprobs, params.logprobs is not None))
        for final in finals:
            final.outputs.sort(key=lambda o: o.index)
        return finals


def _completion(
    last: CompletionOutput | None, token_ids: list[int], logprobs: list[Logprob], wants_logprobs: bool
) -> Completion:
    if last is None:
        raise RuntimeError("a sequence finished without a final update")
    return Completion(
        last.index,
        last.text,
        token_ids,
        logprobs if wants_logprobs else None,
        last.finish_reason,
        last.stop_reason,
        last.error,
    )
