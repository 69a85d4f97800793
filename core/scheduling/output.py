"""Turning a finished step's sampled tokens into request state and ReqOutputs.

Runs on the host one step late under overlap scheduling: by then the next step is already queued
on the device. A request that finished (or was aborted) while its next step was in flight gets that
step's token discarded here; its memory was released when it finished.

A verify step (TARGET_VERIFY: each request's last token and ``t - 1`` drafts) gives each request its accepted
drafts and then the target's own token: ``accepted + 1`` tokens, each through the same stop checks. It is read in
two parts: :meth:`OutputProcessing.take_positions` (how far each request got: its pending tokens, and the KV of
its rejected positions given back) before the next batch is built, and :meth:`OutputProcessing.process_verified`
(append, stop checks, outputs) after that batch's forward is queued (docs/scheduling.md, "Steps of several tokens").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any


from treadle.core.execution.overlap import LaunchedStep
from treadle.core.request import FinishReason, Req, ReqOutput
from treadle.core.scheduling.kv_memory import KVMemory
from treadle.core.scheduling.schedule_batch import BatchEntry
from treadle.core.scheduling.state import SchedulerState, remaining_new_tokens

if TYPE_CHECKING:
    from treadle.core.scheduling.lifecycle import RequestLifecycle


# What every step copies home; prompt log-probs add keys ``in{entry}`` (see core/execution/worker.py's
# prompt_logprob_tensors).
_SAMPLED_KEYS = ("next_ids", "logprobs", "top_values", "top_ids")


class OutputProcessing:
    """Applies a step's tokens once they are on the host: appends them, checks stops and limits, ends finished
    requests and queues the outputs in ``state.outputs``."""

    def __init__(self, state: SchedulerState, lifecycle: "RequestLifecycle", grammar, eos_token_ids: set[int],
                 tokenizer, context_len: int) -> None:
        self.state = state
        self.lifecycle = lifecycle
        self.grammar = grammar
        self.eos_token_ids = eos_token_ids
        self.tokenizer = tokenizer
        self.context_len = context_len
        self.memory: KVMemory = lifecycle.memory
        # The verify step whose positions were taken and what each of its rows added to pending_tokens.
        self._positioned: tuple[LaunchedStep, list[int]] | None = None

    def process(self, step: LaunchedStep, host: dict[str, Any]) -> None:
        """Apply ``step``'s tokens (``host``: its results, waited for) and queue the outputs."""
        next_ids = host["next_ids"].tolist()
        token_logprobs = host["logprobs"].tolist() if host["logprobs"] is not None else None
        top = None
        if host["top_values"] is not None:
            top = (host["top_values"].tolist(), host["top_ids"].tolist())
        any_input_logprobs = len(host) > len(_SAMPLED_KEYS)
        outputs, finish = self.state.outputs, self.lifecycle.finish

        for i, entry in enumerate(step.batch.entries):
            req = entry.req
            if entry.completes_sequence:
                req.pending_tokens -= 1
            if req.finished:
                continue  # aborted, or finished by the step before: this row's token is discarded
            first_output = not req.output_ids and not req.input_logprobs_sent
            if any_input_logprobs and f"in{i}" in host:
                values, tops = self._input_logprob_lists(entry, host, i)
                req.input_token_logprobs.extend(values)
                req.input_top_logprobs.extend(tops)
            if not entry.completes_sequence:
                continue  # a middle chunk: nothing to sample yet
            new_ids: list[int] = []
            if remaining_new_tokens(req) > 0:
                token = next_ids[i]
                req.output_ids.append(token)
                new_ids.append(token)
                if req.return_logprob and token_logprobs is not None:
                    req.output_token_logprobs.append(token_logprobs[i])
                    if req.top_logprobs_num and top is not None:
                        k = req.top_logprobs_num
                        req.output_top_logprobs.append(list(zip(top[1][i][:k], top[0][i][:k])))
                self._check_finished(req, token)
            else:
                req.finish(FinishReason.LENGTH, None)
            if req.finished:
                finish(req)
            outputs.append(req_output(req, new_ids, include_input_logprobs=first_output))

    # ------------------------------------------------------------ verify steps

    def take_positions(self, step: LaunchedStep, host: dict[str, Any]) -> list[int]:
        """A verify step's accepted counts, before its tokens are appended: each live request's ``accepted``
        more tokens become pending (so the next batch sees its budget and its next position) and the KV of its
        rejected positions goes back. Returns what each row added to ``pending_tokens``; done once per step."""
        if self._positioned is not None and self._positioned[0] is step:
            return self._positioned[1]
        followers = _followers(step)
        added: list[int] = []
        kept: list[tuple[Req, int]] = []
        cut: list[tuple[Req, int, int]] = []
        for i, (entry, accepted) in enumerate(zip(step.batch.entries, host["accepted"].tolist())):
            req = entry.req
            if req.finished:
                added.append(0)  # aborted or finished while in flight: its memory is already back
                continue
            req.pending_tokens += accepted
            added.append(accepted)
            # Valid KV: the last token's and the accepted drafts'; the target's own token has none yet.
            valid = entry.kv_start + accepted + 1
            follower = followers.get(i)
            if follower is None:
                kept.append((req, valid))
                continue
            # An overlapped verify step already holds the slots after these: cut the rejected ones from between.
            cut.append((req, valid, entry.kv_start + entry.extend_len))
            follower.kv_start = follower.write_from = valid
            follower.logit_positions = range(valid, valid + follower.extend_len)
        self.memory.shorten(kept)
        self.memory.cut(cut)
        self._positioned = (step, added)
        return added

    def process_verified(self, step: LaunchedStep, host: dict[str, Any]) -> None:
        """Apply a verify step's tokens (``host``: its results, waited for): per request its accepted drafts and
        the target's next token, each through the stop checks; a request that finishes part-way drops the rest."""
        added = self.take_positions(step, host)
        self._positioned = None
        next_ids = host["next_ids"].tolist()
        accepted = host["accepted"].tolist()
        token_logprobs = host["logprobs"].tolist() if host["logprobs"] is not None else None
        top = None
        if host["top_values"] is not None:
            top = (host["top_values"].tolist(), host["top_ids"].tolist())
        outputs, finish = self.state.outputs, self.lifecycle.finish
        for i, entry in enumerate(step.batch.entries):
            req = entry.req
            req.pending_tokens -= 1 + added[i]
            if req.finished:
                continue  # aborted, or finished by the step before: this row's tokens are discarded
            new_ids: list[int] = []
            limit = req.sampling_params.max_new_tokens
            for j in range(accepted[i] + 1):
                # Not remaining_new_tokens: an overlapped verify step queued after this one counts a token of its
                # own as pending, which these may still take (its row is then discarded).
                if len(req.output_ids) >= limit:
                    req.finish(FinishReason.LENGTH, None)
                    break
                token = next_ids[i][j]
                req.output_ids.append(token)
                new_ids.append(token)
                if req.return_logprob and token_logprobs is not None:
                    req.output_token_logprobs.append(token_logprobs[i][j])
                    if req.top_logprobs_num and top is not None:
                        k = req.top_logprobs_num
                        req.output_top_logprobs.append(list(zip(top[1][i][j][:k], top[0][i][j][:k])))
                self._check_finished(req, token)
                if req.finished:
                    break
            if new_ids:
                req.spec_verify_steps += 1
            if req.finished:
                finish(req)
            output = req_output(req, new_ids)
            if new_ids:
                output.new_verify_lengths = [len(new_ids)]
            outputs.append(output)

    # ------------------------------------------------------------ log-probs

    @staticmethod
    def _input_logprob_lists(entry: BatchEntry, host: dict[str, Any], i: int) -> tuple[list, list]:
        req = entry.req
        values: list[float | None] = []
        tops: list = []
        if req.logprob_start_len == 0 and entry.kv_start == 0:
            values.append(None)  # the first token has no context to be predicted from
            tops.append(None)
        computed = host[f"in{i}"].tolist()
        values.extend(computed)
        if f"in{i}_top_ids" in host:
            ids, vals = host[f"in{i}_top_ids"].tolist(), host[f"in{i}_top_values"].tolist()
            tops.extend(list(zip(row_ids, row_vals)) for row_ids, row_vals in zip(ids, vals))
        else:
            tops.extend([None] * len(computed))
        return values, tops

    # ------------------------------------------------------------ finishing

    def _check_finished(self, req: Req, token: int) -> None:
        params = req.sampling_params
        if self.grammar.accept(req, token):
            req.finish(FinishReason.STOP, str(token) if token in self.eos_token_ids else None)
        elif token in params.stop_token_ids:
            req.finish(FinishReason.STOP, str(token))
        elif not params.ignore_eos and token in self.eos_token_ids:
            req.finish(FinishReason.STOP, str(token))
        elif params.stop and self.tokenizer is not None and (matched := self._matched_stop(req)) is not None:
            req.finish(FinishReason.STOP, matched)
        elif len(req.output_ids) >= params.max_new_tokens:
            req.finish(FinishReason.LENGTH, None)
        elif req.seq_len >= self.context_len:
            req.finish(FinishReason.LENGTH, None)

    def _matched_stop(self, req: Req) -> str | None:
        stops = req.sampling_params.stop
        longest = max(len(s) for s in stops)
        tail = self.tokenizer.decode(req.output_ids[-(longest + 2):], skip_special_tokens=False)
        for stop in stops:
            if stop in tail:
                return stop
        return None


def _followers(step: LaunchedStep) -> dict[int, BatchEntry]:
    """The entries of the overlapped verify batch queued after ``step`` (``ScheduleBatch.follows``), by their row
    in ``step``; the link between the two is dropped (read once)."""
    successor = step.followed_by
    if successor is None:
        return {}
    step.followed_by = successor.follows = None
    return dict(zip(successor.follow_rows, successor.entries))


def req_output(req: Req, new_ids: list[int], include_input_logprobs: bool = False) -> ReqOutput:
    """What the caller hears of ``req`` now: ``new_ids``, its finish reason, its token counts and log-probs (the
    prompt's once: with its first output, else when it finishes)."""
    output = ReqOutput(
        rid=req.rid,
        new_token_ids=new_ids,
        finished_reason=req.finished_reason,
        finished_detail=req.finished_detail,
        prompt_tokens=len(req.origin_input_ids),
        completion_tokens=len(req.output_ids),
        cached_tokens=req.cached_tokens,
        spec_verify_steps=req.spec_verify_steps,
    )
    if req.return_logprob:
        count = len(new_ids)
        output.new_output_logprobs = req.output_token_logprobs[len(req.output_token_logprobs) - count:] if count else []
        if req.top_logprobs_num:
            output.new_output_top_logprobs = req.output_top_logprobs[-count:] if count else []
        if include_input_logprobs or (req.finished and not req.input_logprobs_sent):
            output.input_token_logprobs = list(req.input_token_logprobs)
            output.input_top_logprobs = list(req.input_top_logprobs)
            req.input_logprobs_sent = True
    return output
