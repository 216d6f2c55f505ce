"""The HTTP side of disaggregation: a request's `kv_transfer_params` on a prefill or decode
instance (the engine side is quill/disagg).

A prefill instance (`quill serve --role prefill`) takes `{"do_remote_decode": true}`: it
computes the prompt and the first token only, keeps the prompt's KV under a lease, and answers
with `kv_transfer_params` saying where a decode instance fetches it. A decode instance (`--role
decode`) takes those with `do_remote_prefill`: its engine fetches the KV (or, if that fails,
computes the prompt itself) and goes on from the first token, so its reply is the whole reply.
The split carries one sequence (one prompt, n = 1, no echo); the router sends anything else
whole to one instance.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from quill.contract.plan import RemoteKV
from quill.contract.sampling_params import SamplingParams
from quill.server.context import ServerContext
from quill.server.errors import bad_request
from quill.server.generation import Generation
from quill.server.protocol import KVTransferParams

_PARAM = "kv_transfer_params"


@dataclass
class KVTransfer:
    """What a request's kv_transfer_params ask of this instance."""

    lease_s: float | None = None  # a prefill instance's request: hold the KV this long
    remote: RemoteKV | None = None  # a decode instance's: the KV is there

    def scheduling(self) -> dict:
        """The engine's add_request arguments for it."""
        return {"kv_lease_s": self.lease_s, "remote_kv": self.remote}

    def sampling_params(self, params: SamplingParams) -> SamplingParams:
        """A prefill instance samples the first token only (and ends it by length, not by a
        minimum it cannot reach)."""
        if self.lease_s is None:
            return params
        return dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))

    def reply(self, gen: Generation) -> dict | None:
        """The reply's kv_transfer_params: where the decode instance fetches the prompt's KV
        (None if no lease was taken: the reply ended at its first token)."""
        if self.lease_s is None:
            return None
        remote = gen.finished[0].kv_transfer
        if remote is None:
            return None
        return {
            "remote_host": remote.host,
            "remote_port": remote.port,
            "remote_request_id": remote.request_id,
            "remote_block_ids": remote.block_ids,
            "num_tokens": remote.num_tokens,
            "first_token_id": remote.first_token_id,
        }


def kv_transfer(
    ctx: ServerContext,
    params: KVTransferParams | None,
    num_prompts: int,
    n: int,
    stream: bool,
    echo: bool = False,
    scores_prompt: bool = False,
) -> KVTransfer | None:
    """The request's disaggregation, checked against this instance's role; 400 else."""
    if params is None or not (params.do_remote_decode or params.do_remote_prefill):
        return None
    wanted = "prefill" if params.do_remote_decode else "decode"
    if ctx.role != wanted:
        flag = "do_remote_decode" if params.do_remote_decode else "do_remote_prefill"
        raise bad_request(
            f"kv_transfer_params.{flag} needs a {wanted} instance (quill serve --role "
            f"{wanted}); this one's role is {ctx.role}",
            _PARAM,
        )
    if num_prompts != 1 or n != 1 or echo:
        raise bad_request(
            "kv_transfer_params carry one sequence: one prompt, n = 1, no echo", _PARAM
        )
    if scores_prompt:
        raise bad_request(
            "kv_transfer_params carry a generated reply: not prompt_logprobs or max_tokens 0 "
            "(scoring a prompt is one instance's prefill)",
            _PARAM,
        )
    if params.do_remote_decode:
        if stream:
            raise bad_request("a prefill instance's reply is not streamed (stream: false)", _PARAM)
        return KVTransfer(lease_s=ctx.kv_lease_s)
    return KVTransfer(
        remote=RemoteKV(
            params.remote_host,
            params.remote_port,
            params.remote_request_id,
            list(params.remote_block_ids),
            params.num_tokens,
            params.first_token_id,
        )
    )
