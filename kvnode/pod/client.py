"""`pagekv generate` — one Generate call to a router or a pod (they serve the same API)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Sequence

import grpc

from pagekv.proto.credentials import (
    API_TOKEN_ENV,
    TlsFiles,
    add_client_tls_arguments,
    add_token_argument,
    bearer,
    tls_from,
    token_from,
)
from pagekv.proto.grpc_security import open_channel
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc


def make_request(prompt: str | Sequence[int], *, max_tokens: int | None = None,
                 temperature: float | None = None, top_p: float | None = None,
                 top_k: int | None = None, seed: int | None = None, n: int = 1,
                 stop_token_ids: Sequence[int] = (), ignore_eos: bool = False,
                 cache_salt: str | None = None, request_id: str | None = None,
                 stop: Sequence[str] = (), min_tokens: int = 0,
                 presence_penalty: float | None = None, frequency_penalty: float | None = None,
                 repetition_penalty: float | None = None, logprobs: int | None = None,
                 pin_ttl_s: int = 0, pin_tokens: int = 0, one_shot: bool = False,
                 session_id: str = "", lora_name: str = "") -> pb.GenerateRequest:
    """A GenerateRequest; None leaves a field unset, so the server's default applies.
    `pin_ttl_s` > 0 pins the prompt's first `pin_tokens` (0: all of it) for that long;
    `one_shot` and `session_id`: README "Cache control"; `lora_name`: a LoRA adapter."""
    sp = pb.SamplingParams(n=n, ignore_eos=ignore_eos, stop_token_ids=list(stop_token_ids),
                           stop=[stop] if isinstance(stop, str) else list(stop),
                           min_tokens=min_tokens)
    for name, value in (("max_tokens", max_tokens), ("temperature", temperature),
                        ("top_p", top_p), ("top_k", top_k), ("seed", seed),
                        ("presence_penalty", presence_penalty),
                        ("frequency_penalty", frequency_penalty),
                        ("repetition_penalty", repetition_penalty), ("logprobs", logprobs)):
        if value is not None:
            setattr(sp, name, value)
    req = pb.GenerateRequest(sampling=sp, cache_salt=cache_salt or "",
                             request_id=request_id or "", one_shot=one_shot,
                             session_id=session_id, lora_name=lora_name)
    if pin_ttl_s:
        req.cache_control.ttl_s = pin_ttl_s
        req.cache_control.tokens = pin_tokens
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(int(t) for t in prompt)
    return req


class Client:
    """A pod or the router over gRPC (they serve the same API): `generate` returns the whole
    GenerateResponse, `stream` yields GenerateChunks. Keywords as in `make_request`.

    `tls`: dial over TLS (`TlsFiles(ca=...)`; add `cert`/`key` for a server that requires
    client certificates). `token`: the server's --api-token, sent as a bearer token."""

    def __init__(self, address: str = "127.0.0.1:50050", timeout: float = 120.0, *,
                 tls: TlsFiles | None = None, token: str | None = None) -> None:
        self.timeout = timeout
        self._channel = open_channel(address, tls)
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._metadata = bearer(token) if token else None

    def generate(self, prompt: str | Sequence[int], **kwargs) -> pb.GenerateResponse:
        return self._stub.Generate(make_request(prompt, **kwargs), timeout=self.timeout,
                                   metadata=self._metadata)

    def stream(self, prompt: str | Sequence[int], **kwargs) -> Iterator[pb.GenerateChunk]:
        yield from self._stub.GenerateStream(make_request(prompt, **kwargs),
                                             timeout=self.timeout, metadata=self._metadata)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def chat_token_ids(model: str, user: str, system: str | None = None) -> list[int]:
    """A one-turn conversation rendered with `model`'s chat template and tokenized here, as
    the model's pods would (no torch: pagekv.proto.model_files), ready to send as token ids."""
    from pagekv.proto.model_files import prompt_tokenizer
    from pagekv.proto.model_files.chat import apply_chat_template

    tok = prompt_tokenizer(model)
    messages = [{"role": "system", "content": system}] if system else []
    text = apply_chat_template(tok, [*messages, {"role": "user", "content": user}],
                               add_generation_prompt=True)
    return tok.encode(text, add_bos=False)  # the template writes its own special tokens


def build_request(args: argparse.Namespace) -> pb.GenerateRequest:
    if args.chat:
        prompt: str | list[int] = chat_token_ids(args.model, args.prompt, args.system)
    elif args.token_ids:
        prompt = [int(t) for t in args.prompt.split(",")]
    else:
        prompt = args.prompt
    return make_request(prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                        top_p=args.top_p, top_k=args.top_k, seed=args.seed, n=args.n,
                        stop_token_ids=args.stop_token_ids, ignore_eos=args.ignore_eos,
                        cache_salt=args.cache_salt, request_id=args.request_id,
                        stop=args.stop, min_tokens=args.min_tokens,
                        presence_penalty=args.presence_penalty,
                        frequency_penalty=args.frequency_penalty,
                        repetition_penalty=args.repetition_penalty, logprobs=args.logprobs,
                        pin_ttl_s=args.pin_ttl_s, pin_tokens=args.pin_tokens,
                        one_shot=args.one_shot, session_id=args.session_id,
                        lora_name=args.lora_name)


def add_cache_control_arguments(p: argparse.ArgumentParser) -> None:
    """A request's retention asks (README "Cache control")."""
    p.add_argument("--pin-ttl-s", type=int, default=0,
                   help="keep the prompt cached this many seconds (pool, DRAM, SSD); every hit "
                        "starts it again; 0: no pin")
    p.add_argument("--pin-tokens", type=int, default=0,
                   help="with --pin-ttl-s: only the prompt's first tokens (0: all of it)")
    p.add_argument("--one-shot", action="store_true",
                   help="the prompt will not come back: its blocks go first and never below "
                        "the pool")
    p.add_argument("--session-id", default="",
                   help="a conversation: its turns stay on one pod, its blocks kept between "
                        "turns")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="prompt text (or comma-separated ids with --token-ids)")
    p.add_argument("--router", default="127.0.0.1:50050", help="router or pod address")
    p.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop-token-ids", type=lambda v: [int(t) for t in v.split(",") if t],
                   default=[], help="comma-separated token ids that end a completion")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="a stop string (repeatable): the completion ends before it")
    p.add_argument("--min-tokens", type=int, default=0,
                   help="no stop (EOS, stop tokens or strings) before this many tokens")
    p.add_argument("--presence-penalty", type=float, default=None)
    p.add_argument("--frequency-penalty", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="return each token's logprob and the top K (see --json)")
    p.add_argument("--request-id", default=None, help="default: the server makes one")
    p.add_argument("-n", type=int, default=1)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--cache-salt", default=None)
    add_cache_control_arguments(p)
    p.add_argument("--lora-name", default="",
                   help="the LoRA adapter to answer with (a pod's --lora-modules name)")
    p.add_argument("--token-ids", action="store_true")
    p.add_argument("--chat", action="store_true",
                   help="the prompt is a user message: render it with --model's chat template "
                        "(the answer stops at the model's end of turn)")
    p.add_argument("--system", default=None, help="with --chat: a system message")
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="with --chat: the model whose tokenizer and template to use (the one "
                        "the pods serve)")
    p.add_argument("--json", action="store_true", help="print the whole response as JSON")
    p.add_argument("--timeout", type=float, default=120.0)
    add_client_tls_arguments(p)
    add_token_argument(p, "--api-token", API_TOKEN_ENV, "the server's --api-token")


def main(args: argparse.Namespace) -> int:
    from google.protobuf.json_format import MessageToDict

    req = build_request(args)
    token = token_from(args.api_token, API_TOKEN_ENV)
    metadata = bearer(token) if token else None
    with open_channel(args.router, tls_from(args)) as channel:
        stub = pb_grpc.GenerationStub(channel)
        try:
            if args.stream:
                last = None
                later: dict[int, list[str]] = {}  # n > 1: completions 1.. print at the end
                for chunk in stub.GenerateStream(req, timeout=args.timeout, metadata=metadata):
                    if chunk.index == 0:
                        sys.stdout.write(chunk.text)
                        sys.stdout.flush()
                    else:
                        later.setdefault(chunk.index, []).append(chunk.text)
                    last = chunk
                print()
                for i in sorted(later):
                    print("".join(later[i]))
                if last is not None:
                    u = last.usage
                    print(f"[served_by={last.served_by} prompt={u.prompt_tokens} "
                          f"cached={u.cached_tokens} (gpu={u.cached_tokens_gpu} "
                          f"cpu={u.cached_tokens_cpu} disk={u.cached_tokens_disk})]",
                          file=sys.stderr)
                return 0
            resp = stub.Generate(req, timeout=args.timeout, metadata=metadata)
        except grpc.RpcError as e:
            print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(MessageToDict(resp), indent=2))
    else:
        for c in resp.completions:
            print(c.text)
        u = resp.usage
        print(f"[served_by={resp.served_by} prompt={u.prompt_tokens} cached={u.cached_tokens} "
              f"(gpu={u.cached_tokens_gpu} cpu={u.cached_tokens_cpu} disk={u.cached_tokens_disk})"
              f"{' routed: ' + resp.routing.reason if resp.routing.chosen_pod else ''}]",
              file=sys.stderr)
    return 0
