"""What one client may ask of a frontend: bounds checked before any work is spent on a request.

    body bytes        Content-Length and the bytes actually read         413 (request_too_large)
    JSON values       array elements and object members, before parsing  400 naming the top-level field
    prompt chars      each prompt or chat message text, before tokenizing 400 naming the field
    prompt tokens × n a request's prompts' tokens, each times n, summed  400 naming `n` (or the prompts)
                      (as each prompt's first sample is accepted: choices.py)
    stop strings      how many, and how long each                         400 naming `stop`
    logprobs          top logprobs per token (vLLM's --max-logprobs)      400 naming `logprobs`/`top_logprobs`
    connections       open per frontend (http_protocol.ConnectionCap)     503 beyond it
    header timeout    a connection must send a request's headers within   closed
    body timeout      ... and then its body within                        closed
    keep-alive        idle time between requests                          closed

A tokenizer worker serves every request routed to it in turn, so a prompt of 48 MB (or 200,000 stop
strings, matched on every token) would stall everyone else on that worker: those bounds must hold before
the request leaves the frontend. Likewise a frontend parses each body in one call that holds the GIL, about a
microsecond per JSON value: their count bounds how long one body can hold up every other client of that
frontend (frontend/body_parse.py). Flags: launch.py (`add_http_limit_args`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from common.flags import LIMITS, flag_group
from common.sampling_params import MAX_LOGPROBS

PROMPT_CHARS_PER_TOKEN = 32  # the default prompt bound: no tokenizer's tokens average more characters


@dataclass(frozen=True, slots=True)
class HttpLimits:
    max_request_body_bytes: int = 16 * 2**20
    max_request_json_values: int = 32768
    max_prompt_chars: int | None = None  # None: PROMPT_CHARS_PER_TOKEN per token of context
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_logprobs: int = MAX_LOGPROBS
    max_connections: int = 1024
    timeout_headers_s: float = 10.0
    timeout_body_s: float = 30.0  # 16 MiB (the default body bound) at 4.5 Mbit/s
    timeout_keep_alive_s: float = 5.0
    request_timeout_s: float | None = None  # a request still unfinished after this long is ended
    # None: a running batch of whole contexts (the context times --max-num-seqs): a request may ask for no more
    # prompt tokens, counted once per sample, than the engine could hold running at once.
    max_request_prompt_tokens: int | None = None

    def prompt_chars(self, max_model_len: int) -> int:
        return self.max_prompt_chars if self.max_prompt_chars is not None else PROMPT_CHARS_PER_TOKEN * max_model_len

    def request_prompt_tokens(self, max_model_len: int, max_num_seqs: int) -> int:
        if self.max_request_prompt_tokens is not None:
            return self.max_request_prompt_tokens
        return max_model_len * max_num_seqs

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> HttpLimits:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


def add_http_limit_args(parser: argparse.ArgumentParser) -> None:
    d = HttpLimits()
    g = flag_group(parser, LIMITS)
    g.add_argument(
        "--max-request-body-bytes", type=int, default=d.max_request_body_bytes, help="larger bodies get a 413"
    )
    g.add_argument(
        "--max-request-json-values",
        type=int,
        default=d.max_request_json_values,
        help="JSON values (array elements, object members) per request body, counted before it is parsed: a body "
        "costs the frontend about a microsecond of parsing per value, during which it serves nobody else; a "
        "prompt of token ids has one value per token",
    )
    g.add_argument(
        "--max-prompt-chars",
        type=int,
        default=d.max_prompt_chars,
        help=f"characters per prompt (or per chat request), checked before tokenizing "
        f"(default: {PROMPT_CHARS_PER_TOKEN} per token of context)",
    )
    g.add_argument(
        "--max-request-prompt-tokens",
        type=int,
        default=d.max_request_prompt_tokens,
        help="prompt tokens one request may ask for, each prompt's counted once per sample (times n), summed over "
        "its prompts; beyond it a 400 names n (or the prompts) (default: the context times --max-num-seqs)",
    )
    g.add_argument("--max-stop-strings", type=int, default=d.max_stop_strings, help="stop strings per request")
    g.add_argument(
        "--max-stop-string-chars", type=int, default=d.max_stop_string_chars, help="characters per stop string"
    )
    g.add_argument(
        "--max-logprobs",
        type=_at_least_zero,
        default=d.max_logprobs,
        help="most log probabilities per token a request may ask for: completions' logprobs (with echo, the "
        "prompt's too), chat's top_logprobs (vLLM's flag; -1, vLLM's 'no cap', is not taken)",
    )
    g.add_argument(
        "--max-connections",
        type=int,
        default=d.max_connections,
        help="open HTTP connections per frontend process; requests beyond them get a 503",
    )
    g.add_argument(
        "--timeout-headers",
        dest="timeout_headers_s",
        type=float,
        default=d.timeout_headers_s,
        help="seconds a connection has to send a request's headers before it is closed (slowloris)",
    )
    g.add_argument(
        "--timeout-body",
        dest="timeout_body_s",
        type=float,
        default=d.timeout_body_s,
        help="seconds a request has, after its headers, to send its whole body before the connection is closed",
    )
    g.add_argument(
        "--timeout-keep-alive",
        dest="timeout_keep_alive_s",
        type=float,
        default=d.timeout_keep_alive_s,
        help="seconds an idle keep-alive connection stays open",
    )
    g.add_argument(
        "--request-timeout",
        dest="request_timeout_s",
        type=float,
        default=d.request_timeout_s,
        help="seconds a generation may run before it is ended with an error (default: no limit)",
    )


def _at_least_zero(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value
