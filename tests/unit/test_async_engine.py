"""AsyncEngine: streaming from the loop thread, cancellation frees blocks."""

import asyncio

import pytest

from pagekv.kvnode.engine.async_engine import AsyncEngine
from pagekv.kvnode.engine.engine import Engine, RequestRejected
from pagekv.kvnode.engine.llm import LLM
from pagekv.kvnode.engine.sampling_params import SamplingParams

P = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture()
def aengine():
    eng = AsyncEngine(Engine(model="pagekv-tiny", num_gpu_blocks=64, max_model_len=256))
    eng.start()
    yield eng
    eng.shutdown()


def test_stream_equals_offline(aengine):
    offline = LLM("pagekv-tiny", num_gpu_blocks=64, max_model_len=256)
    want = [offline.generate([p], P)[0].outputs[0].token_ids for p in ([1, 2, 3], [4, 5, 6, 7])]

    async def one(rid, prompt):
        toks = []
        async for d in aengine.generate(rid, prompt, P):
            toks.extend(d.outputs[0].token_ids)
        return toks

    async def main():
        return await asyncio.gather(one("a", [1, 2, 3]), one("b", [4, 5, 6, 7]))

    assert asyncio.run(main()) == want


def test_cancel_aborts_and_frees(aengine):
    async def main():
        gen = aengine.generate("c", list(range(1, 40)),
                               SamplingParams(max_tokens=200, ignore_eos=True))
        async for _ in gen:
            break
        await gen.aclose()

    asyncio.run(main())
    free = aengine.call(lambda: aengine.engine.kv_manager.get_num_free_blocks())
    assert free == 64
    assert aengine.call(lambda: aengine.engine.has_unfinished()) is False


def test_rejection_reaches_caller(aengine):
    async def main():
        async for _ in aengine.generate("bad", [], P):
            pass

    with pytest.raises(RequestRejected, match="empty"):
        asyncio.run(main())


def test_build_constructs_the_engine_on_its_loop_thread():
    import threading

    built_on = []

    def factory():
        built_on.append(threading.current_thread().name)
        return Engine(model="pagekv-tiny", num_gpu_blocks=64, max_model_len=256)

    aengine = AsyncEngine.build(factory)
    aengine.start()
    try:
        async def one():
            return [t async for d in aengine.generate("b", [1, 2, 3], P)
                    for t in d.outputs[0].token_ids]

        assert len(asyncio.run(one())) == P.max_tokens
        assert built_on == ["engine-loop"] and aengine._thread.name == "engine-loop"
    finally:
        aengine.shutdown()


def test_build_reraises_a_failed_construction():
    def factory():
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine.build(factory)


def test_prompt_text_and_prompt_logprobs_stream_on_the_first_delta(aengine):
    async def main():
        p = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
        return [d async for d in aengine.generate("t", [256, 104, 105], p, prompt="hi")]

    deltas = asyncio.run(main())
    assert all(d.prompt == "hi" for d in deltas)
    first = deltas[0].prompt_logprobs
    assert first is not None and first[0] is None and [e.token_id for e in first[1:]] == [104, 105]
    assert all(len(e.top) == 2 for e in first[1:])
    assert all(d.prompt_logprobs is None for d in deltas[1:])
