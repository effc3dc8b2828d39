"""Logprobs for the requests that ask: made on the device in a launch, copied to the host with the step's
tokens, turned into messages when the step is finished.

    sampled  (sampler.sampled_logprobs)   the drawn token's logprob and the top k, one row per request asking
    prompt   (prompt_logprobs below)      at every prompt position a chunk computes: position p's logits score
                                          token p + 1 (log_softmax of the raw logits)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from common.messages import Logprobs, RequestLogprobs
from gpu_worker.input_batch import StepInputs
from gpu_worker.request_mirrors import RequestMirrors

PROMPT_LOGPROBS_ROWS = 256  # prompt positions whose logits are made at once (bounds that memory)


@dataclass(slots=True)
class PendingLogprobs:
    """One request's logprobs of a step, on their way to the host."""

    rid: int
    start: int  # a sample's index in the output; a prompt's first scored position
    k: int  # top logprobs asked for
    token_ids: list[int]  # the tokens scored; empty for a sample: the token the step draws
    # [scored token's logprob, top ids, top logprobs], host tensors (being copied until the step is finished)
    values: list[torch.Tensor] = field(default_factory=list)


def prompt_logprob_targets(inputs: StepInputs, mirrors: RequestMirrors) -> tuple[list[int], list[PendingLogprobs]]:
    """Flat token rows whose logits give prompt logprobs, and per request what they score (values to come)."""
    rows: list[int] = []
    targets: list[PendingLogprobs] = []
    row = 0
    for rid, start, num_tokens in zip(inputs.rids, inputs.starts.tolist(), inputs.layout.query_lens.tolist()):
        mirror = mirrors[rid]
        end = min(start + num_tokens, mirror.prompt_logprobs_end - 1)
        if end > start:
            rows.extend(range(row, row + end - start))
            ids = mirror.token_ids[start + 1 : end + 1]
            targets.append(PendingLogprobs(rid, start + 1, mirror.sampling.prompt_logprobs, ids))
        row += num_tokens
    return rows, targets


def prompt_logprobs(
    model: torch.nn.Module,
    hidden: torch.Tensor,
    targets: list[PendingLogprobs],
    upload: Callable[[list[int], torch.dtype], torch.Tensor],
) -> list[torch.Tensor]:
    """[rows] logprob of each scored token, [rows, k] top ids and logprobs (k: the step's largest).
    Logits are made PROMPT_LOGPROBS_ROWS rows at a time: a whole prefill's [tokens, vocab] logits
    would need memory the KV store was sized without."""
    ids = upload([t for target in targets for t in target.token_ids], torch.long)
    k = max(target.k for target in targets)
    parts: list[list[torch.Tensor]] = []
    for start in range(0, len(hidden), PROMPT_LOGPROBS_ROWS):
        end = start + PROMPT_LOGPROBS_ROWS
        logprobs = torch.log_softmax(model.compute_logits(hidden[start:end]).float(), dim=-1)
        top = logprobs.topk(k, dim=-1)
        parts.append([logprobs.gather(1, ids[start:end, None])[:, 0], top.indices, top.values])
    return [torch.cat(column) for column in zip(*parts)]


def split_prompt_logprobs(targets: list[PendingLogprobs], host: list[torch.Tensor]) -> list[PendingLogprobs]:
    """Each target's rows of the step's prompt logprobs (host: prompt_logprobs' three tensors)."""
    row = 0
    for target in targets:
        target.values = [t[row : row + len(target.token_ids)] for t in host]
        row += len(target.token_ids)
    return targets


def logprob_messages(
    entries: list[PendingLogprobs] | None, rids: list[int] | None = None, token_ids: list[int] | None = None
) -> list[RequestLogprobs]:
    """Host tensors to messages; a sample's entry scores the token its request drew (rids[i] drew token_ids[i])."""
    if not entries:
        return []
    drawn = dict(zip(rids or [], token_ids or []))
    out = []
    for entry in entries:
        ids = entry.token_ids or [drawn[entry.rid]]
        chosen, top_ids, top_logprobs = entry.values
        out.append(
            RequestLogprobs(
                entry.rid,
                Logprobs(
                    entry.start,
                    list(ids),
                    [float(x) for x in chosen.reshape(-1).tolist()],
                    top_ids.reshape(len(ids), -1)[:, : entry.k].tolist(),
                    top_logprobs.reshape(len(ids), -1)[:, : entry.k].tolist(),
                ),
            )
        )
    return out
