"""Between the wire and the engine: a request's sampling parameters and id in, its
completions and usage out, the same for Generate and GenerateStream."""

from __future__ import annotations

from typing import Any, TypedDict

from pagekv.kvnode.engine.outputs import TokenLogprobs
from pagekv.kvnode.engine.sampling_params import SamplingParams
from pagekv.proto.medium import PEER_SHARE, Medium
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.requests import BadRequest

FINISH = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}


def engine_request_id(rid: str) -> str:
    """The engine's id for a client's request id. The engine names the extra samples of an
    n>1 request `<id>#<i>`, so a client id such as "x#1" would share block tables with the
    second sample of request "x" (and corrupt both): escape '#' (and '%', to stay one-to-one)
    so that no client id can take that form."""
    if "#" in rid or "%" in rid:
        return rid.replace("%", "%25").replace("#", "%23")
    return rid


def to_sampling_params(sp: pb.SamplingParams, room: int) -> SamplingParams:
    """Proto → engine parameters; unset fields take the server defaults (max_tokens: the
    `room` left in max_model_len). SamplingParams' own checks become BadRequest."""
    try:
        return SamplingParams(
            max_tokens=sp.max_tokens if sp.HasField("max_tokens") else max(1, room),
            temperature=sp.temperature if sp.HasField("temperature") else 1.0,
            top_p=sp.top_p if sp.HasField("top_p") else 1.0,
            top_k=sp.top_k if sp.HasField("top_k") and sp.top_k > 0 else 0,
            seed=sp.seed if sp.HasField("seed") else None,
            n=sp.n or 1,
            stop_token_ids=list(sp.stop_token_ids),
            ignore_eos=sp.ignore_eos,
            stop=list(sp.stop),
            min_tokens=sp.min_tokens,
            presence_penalty=sp.presence_penalty if sp.HasField("presence_penalty") else 0.0,
            frequency_penalty=sp.frequency_penalty if sp.HasField("frequency_penalty") else 0.0,
            repetition_penalty=(sp.repetition_penalty if sp.HasField("repetition_penalty")
                                else 1.0),
            logprobs=sp.logprobs if sp.HasField("logprobs") else None,
            min_p=sp.min_p if sp.HasField("min_p") else 0.0,
            prompt_logprobs=sp.prompt_logprobs if sp.HasField("prompt_logprobs") else None,
            skip_special_tokens=(sp.skip_special_tokens if sp.HasField("skip_special_tokens")
                                 else True),
        )
    except ValueError as e:
        raise BadRequest(str(e)) from e


def token_logprobs(lp: TokenLogprobs) -> pb.TokenLogprobs:
    return pb.TokenLogprobs(sampled=pb.Logprob(token_id=lp.token_id, logprob=lp.logprob),
                            top=[pb.Logprob(token_id=t, logprob=v) for t, v in lp.top])


class StopReasonFields(TypedDict, total=False):
    """The `stop_reason` oneof of a Completion or GenerateChunk: at most one of the two."""

    stop_string: str
    stop_token_id: int


def stop_reason_fields(reason: str | int | None) -> StopReasonFields:
    """The `stop_reason` oneof of a Completion or GenerateChunk, as keyword arguments."""
    if isinstance(reason, str):
        return {"stop_string": reason}
    if isinstance(reason, int):
        return {"stop_token_id": reason}
    return {}


def prompt_logprobs(entries: list[TokenLogprobs | None]) -> list[pb.TokenLogprobs]:
    """The engine's prompt logprobs (entry 0 None: nothing precedes the first token) as the
    wire carries them: entry j is prompt token j + 1."""
    return [token_logprobs(lp) for lp in entries[1:] if lp is not None]


class Completions:
    """One request's engine deltas turned into what a client sees, the same for Generate and
    GenerateStream. The engine already leaves a stop token's text out and reports each
    completion's finish_reason once. The prompt's logprobs (one delta carries them) go out
    on the first piece from that delta on, so before any other chunk of the request."""

    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = {}
        self.texts: dict[int, list[str]] = {}
        self.finish: dict[int, pb.FinishReason] = {}
        self.logprobs: dict[int, list[pb.TokenLogprobs]] = {}
        self.stop: dict[int, StopReasonFields] = {}  # once finished
        self.prompt_logprobs: list[pb.TokenLogprobs] = []
        self.prompt_logprobs_pending = False  # arrived, not yet in a piece

    def pieces(self, delta) -> list[dict[str, Any]]:
        """For each completion that moved, the fields of its GenerateChunk but request_id:
        index, new token ids, new text, finish reason, the new tokens' logprobs (when asked
        for), once finished what stopped it, and on the first one the prompt's logprobs."""
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = prompt_logprobs(delta.prompt_logprobs)
            self.prompt_logprobs_pending = True
        out = []
        for c in delta.outputs:
            if not (c.token_ids or c.text or c.finish_reason):
                continue
            self.tokens.setdefault(c.index, []).extend(c.token_ids)
            self.texts.setdefault(c.index, []).append(c.text)
            logprobs = [token_logprobs(lp) for lp in c.logprobs or ()]
            if logprobs:
                self.logprobs.setdefault(c.index, []).extend(logprobs)
            reason = FINISH.get(c.finish_reason, pb.FINISH_REASON_UNSPECIFIED)
            piece: dict[str, Any] = dict(index=c.index, token_ids=list(c.token_ids),
                                         text=c.text, finish_reason=reason, logprobs=logprobs)
            if c.finish_reason is not None:
                self.finish[c.index] = reason
                self.stop[c.index] = stop_reason_fields(c.stop_reason)
                piece.update(self.stop[c.index])
            piece["prompt_logprobs"] = self.take_prompt_logprobs()
            out.append(piece)
        return out

    def take_prompt_logprobs(self) -> list[pb.TokenLogprobs]:
        """The prompt's logprobs for a chunk, once: [] before they arrive and after."""
        if not self.prompt_logprobs_pending:
            return []
        self.prompt_logprobs_pending = False
        return self.prompt_logprobs

    def completion(self, index: int) -> pb.Completion:
        return pb.Completion(index=index, token_ids=self.tokens.get(index, []),
                             text="".join(self.texts.get(index, [])),
                             finish_reason=self.finish.get(index, pb.FINISH_REASON_UNSPECIFIED),
                             logprobs=self.logprobs.get(index, []),
                             prompt_logprobs=self.prompt_logprobs if index == 0 else [],
                             **self.stop.get(index, {}))

    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens.values())


def usage(prompt_tokens: int, delta, completion_tokens: int) -> pb.Usage:
    """The request's token counts, its cache hits split by the tier they came from."""
    by = delta.cached_tokens_by_tier
    return pb.Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        cached_tokens=delta.num_cached_tokens,
        cached_tokens_gpu=by.get(Medium.GPU, 0),
        cached_tokens_cpu=by.get(Medium.CPU, 0),
        cached_tokens_disk=by.get(Medium.DISK, 0),
        cached_tokens_peer=by.get(PEER_SHARE, 0),
        kv_pull_ms=delta.kv_pull_s * 1e3,
        kv_pull_fallback=delta.kv_pull_fallback,
    )
