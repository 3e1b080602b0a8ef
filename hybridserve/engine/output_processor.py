"""Turns one engine request's token-id increments into text updates, applying stop strings.

The engine knows nothing of text: this is where ids become text, where a stop string ends a sequence (the
caller then aborts the engine request) and where logprobs get their token text and bytes.
"""

from __future__ import annotations

from collections.abc import Callable

from transformers import PreTrainedTokenizerBase

from hybridserve.engine.outputs import CompletionOutput, Logprob, TopLogprob
from hybridserve.engine.protocol import EngineCoreOutput, EngineCoreRequest, FinishReason, TokenLogprobs
from hybridserve.tokenizer.detokenizer import IncrementalDetokenizer, token_bytes, token_text


class SequenceOutput:
    """The text state of one sequence (choice `index`), fed every EngineCoreOutput of its engine request.

    Text that might be the start of a stop string is held back until it is disambiguated. An update that
    releases no text and does not finish returns None; its token ids and logprobs are carried into the next
    update that is reported, so each id and logprob is reported exactly once, no earlier than its text.
    After the sequence has finished, further outputs are ignored.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, request: EngineCoreRequest, index: int) -> None:
        self._tokenizer = tokenizer
        self._params = request.sampling_params
        self._eos_token_ids = frozenset(request.eos_token_ids)
        self._index = index
        self._detokenizer = IncrementalDetokenizer(
            tokenizer, request.prompt_token_ids, self._params.skip_special_tokens
        )
        self._text = ""  # released
        self._held = ""  # detokenized but not released: might start a stop string
        self._ids: list[int] = []  # not yet reported
        self._logprobs: list[Logprob] = []  # not yet reported
        self._prompt_logprobs: list[Logprob | None] | None = None  # not yet reported
        self._num_output_tokens = 0
        self._finish_reason: str | None = None
        self._stop_reason: int | str | None = None
        self._stopped_by_string = False

    @property
    def finished(self) -> bool:
        return self._finish_reason is not None

    @property
    def stopped_by_string(self) -> bool:
        """A stop string ended the sequence: the engine request is still running and must be aborted."""
        return self._stopped_by_string

    def update(self, out: EngineCoreOutput) -> CompletionOutput | None:
        if self.finished:
            return None
        ids = out.new_token_ids
        final = out.finish_reason is not None
        if out.prompt_logprobs is not None:
            self._prompt_logprobs = [None, *map(self._convert, out.prompt_logprobs)]
        text_ids = ids[:-1] if self._ends_on_stop_token(out) else ids
        # Stop strings apply from min_tokens on: the text of earlier tokens is released unchecked.
        unchecked = max(0, min(len(text_ids), self._params.min_tokens - self._num_output_tokens))
        early = self._detokenizer.add(text_ids[:unchecked]) if unchecked else ""
        self._text += early
        checked = text_ids[unchecked:]
        if len(checked) > 1 and self._params.stop:  # several tokens at once (speculative decoding)
            ids = ids[: unchecked + self._add_until_stop(checked)]
        else:
            self._held += self._detokenizer.add(checked)
        self._ids.extend(ids)
        if self._params.logprobs is not None:
            self._logprobs.extend(self._convert(lp) for lp in (out.new_logprobs or [])[: len(ids)])
        self._num_output_tokens += len(ids)
        if final:
            self._held += self._detokenizer.flush()
        delta = early + self._release(final)
        if final and not self.finished:
            self._finish_reason = FinishReason(out.finish_reason).value
            self._stop_reason = out.stop_reason
        if not delta and not self.finished:
            return None
        return self._report(delta, out.error, out.unavailable)

    def _add_until_stop(self, token_ids: list[int]) -> int:
        """Detokenize `token_ids` one by one up to the first that completes a stop string; returns how many were
        taken. The tokens after it are dropped, as a sequence decoded one token a step never produces them."""
        for i, token_id in enumerate(token_ids):
            self._held += self._detokenizer.add([token_id])
            if self._find_stop() is not None:
                return i + 1
        return len(token_ids)

    def _ends_on_stop_token(self, out: EngineCoreOutput) -> bool:
        """The engine stopped on EOS or a stop token id, whose text is left out unless asked for."""
        if out.finish_reason != FinishReason.STOP or not out.new_token_ids:
            return False
        last = out.new_token_ids[-1]
        stop_token = last == out.stop_reason or last in self._eos_token_ids
        return stop_token and not self._params.include_stop_str_in_output

    def _release(self, final: bool) -> str:
        """Move held text that cannot be part of a stop string to the released text; return it."""
        match = self._find_stop()
        if match is not None:
            start, stop = match
            end = start + len(stop) if self._params.include_stop_str_in_output else start
            delta = self._held[:end]
            self._finish_reason, self._stop_reason, self._stopped_by_string = "stop", stop, True
        else:
            keep = 0 if final else self._held_back_length()
            delta = self._held[: len(self._held) - keep]
        self._held = self._held[len(delta) :]
        self._text += delta
        return delta

    def _find_stop(self) -> tuple[int, str] | None:
        """The earliest stop string in the held text (the shortest one when several start there)."""
        found = [(self._held.find(s), len(s), s) for s in self._params.stop]
        matches = [(start, size, s) for start, size, s in found if start >= 0]
        if not matches:
            return None
        start, _, stop = min(matches)
        return start, stop

    def _held_back_length(self) -> int:
        """Length of the longest suffix of the held text that is a proper prefix of some stop string.

        Held back even with include_stop_str_in_output, so that a match always lies in the held text.
        """
        longest = 0
        for stop in self._params.stop:
            for size in range(min(len(stop) - 1, len(self._held)), longest, -1):
                if self._held.endswith(stop[:size]):
                    longest = size
                    break
        return longest

    def _report(self, delta: str, error: str | None, unavailable: bool = False) -> CompletionOutput:
        ids, logprobs, prompt_logprobs = self._ids, self._logprobs, self._prompt_logprobs
        self._ids, self._logprobs, self._prompt_logprobs = [], [], None
        return CompletionOutput(
            index=self._index,
            delta_text=delta,
            delta_token_ids=ids,
            delta_logprobs=logprobs if self._params.logprobs is not None else None,
            text=self._text,
            num_output_tokens=self._num_output_tokens,
            finish_reason=self._finish_reason,
            stop_reason=self._stop_reason,
            error=error,
            unavailable=unavailable,
            prompt_logprobs=prompt_logprobs,
        )

    def _convert(self, lp: TokenLogprobs) -> Logprob:
        top = [
            TopLogprob(
                token_id,
                token_text(self._tokenizer, token_id),
                list(token_bytes(self._tokenizer, token_id)),
                logprob,
            )
            for token_id, logprob in lp.top
        ]
        return Logprob(
            lp.token_id,
            token_text(self._tokenizer, lp.token_id),
            list(token_bytes(self._tokenizer, lp.token_id)),
            lp.logprob,
            top,
            lp.rank,
        )


class ChoiceOutputs:
    """The sequences of one request (its n choices, one engine request each): every engine output goes to
    its sequence, an engine request a stop string ended is aborted through `abort`, and `done` says when
    every choice has finished. Outputs of a finished sequence are ignored."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        requests: list[EngineCoreRequest],
        abort: Callable[[list[str]], None],
    ) -> None:
        self._seqs = {r.request_id: SequenceOutput(tokenizer, r, i) for i, r in enumerate(requests)}
        self._abort = abort
        self._running = len(self._seqs)
        self.num_cached_tokens = 0  # the most any of its engine requests found cached

    @property
    def request_ids(self) -> list[str]:
        return list(self._seqs)

    @property
    def done(self) -> bool:
        return self._running == 0

    def unfinished(self) -> list[str]:
        return [rid for rid, seq in self._seqs.items() if not seq.finished]

    def feed(self, out: EngineCoreOutput) -> CompletionOutput | None:
        """The update `out` makes to its sequence (None: nothing to report yet)."""
        seq = self._seqs[out.request_id]
        if seq.finished:
            return None
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        update = seq.update(out)
        if seq.stopped_by_string:
            self._abort([out.request_id])
        if seq.finished:
            self._running -= 1
        return update
