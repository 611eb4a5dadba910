"""Between the wire and the engine: a request's sampling parameters and id in, its
completions and usage out, the same for Generate and GenerateStream."""

from __future__ import annotations

from pagekv.kvnode.engine.sampling_params import SamplingParams
from pagekv.proto.medium import Medium
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
        )
    except ValueError as e:
        raise BadRequest(str(e)) from e


class Completions:
    """One request's engine deltas turned into what a client sees, the same for Generate and
    GenerateStream. The engine already leaves a stop token's text out and reports each
    completion's finish_reason once."""

    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = {}
        self.texts: dict[int, list[str]] = {}
        self.finish: dict[int, int] = {}

    def pieces(self, delta) -> list[tuple[int, list[int], str, int]]:
        """(index, new token ids, new text, finish reason) for each completion that moved."""
        out = []
        for c in delta.outputs:
            if not (c.token_ids or c.text or c.finish_reason):
                continue
            self.tokens.setdefault(c.index, []).extend(c.token_ids)
            self.texts.setdefault(c.index, []).append(c.text)
            reason = FINISH.get(c.finish_reason, pb.FINISH_REASON_UNSPECIFIED)
            if c.finish_reason is not None:
                self.finish[c.index] = reason
            out.append((c.index, list(c.token_ids), c.text, reason))
        return out

    def completion(self, index: int) -> pb.Completion:
        return pb.Completion(index=index, token_ids=self.tokens.get(index, []),
                             text="".join(self.texts.get(index, [])),
                             finish_reason=self.finish.get(index, pb.FINISH_REASON_UNSPECIFIED))

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
    )
