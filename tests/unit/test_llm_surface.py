"""The offline `LLM` as vLLM's: dict prompts, use_tqdm, get_tokenizer (against transformers on
an exported tokenizer), reset_prefix_cache, dtype= and seed=, the vLLM-only options refused
by name, RequestOutput.prompt and CompletionOutput.cumulative_logprob."""

from __future__ import annotations

import functools
import io
import math

import pytest
import torch
from tqdm import tqdm

from pagekv.kvnode.engine.llm import LLM
from pagekv.kvnode.engine.sampling_params import SamplingParams

TEXT = "The capital of France is"
GREEDY = SamplingParams(max_tokens=4, temperature=0)
TINY = dict(num_gpu_blocks=64, max_model_len=128, device="cpu")


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("pagekv-tiny", **TINY)


def run(llm: LLM, prompts, params=GREEDY, **kw):
    return llm.generate(prompts, params, use_tqdm=False, **kw)


# -- prompts -------------------------------------------------------------------------------------

def test_a_text_prompt_dict_is_its_text_not_its_key(llm):
    want = llm.tokenizer.encode(TEXT)
    (out,) = run(llm, {"prompt": TEXT})
    assert out.prompt_token_ids == want != llm.tokenizer.encode("prompt")
    assert out.prompt == TEXT
    assert out.outputs[0].token_ids == run(llm, TEXT)[0].outputs[0].token_ids


def test_a_token_prompt_dict_is_its_ids(llm):
    ids = [256, 5, 6, 7, 8]
    (out,) = run(llm, {"prompt_token_ids": ids})
    assert out.prompt_token_ids == ids and out.prompt is None
    assert out.outputs[0].token_ids == run(llm, [ids])[0].outputs[0].token_ids
    (named,) = run(llm, {"prompt_token_ids": ids, "prompt": "its text"})  # vLLM's TokensPrompt
    assert named.prompt_token_ids == ids and named.prompt == "its text"
    assert run(llm, ids)[0].prompt_token_ids == ids  # a bare list of ids is one prompt


def test_a_list_mixes_strings_dicts_and_token_lists_in_order(llm):
    ids = [256, 9, 9, 9]
    outs = run(llm, ["abc", {"prompt": TEXT}, ids, {"prompt_token_ids": ids[:2]}])
    assert [o.prompt_token_ids for o in outs] == [
        llm.tokenizer.encode("abc"), llm.tokenizer.encode(TEXT), ids, ids[:2]]
    assert [o.prompt for o in outs] == ["abc", TEXT, None, None]


def test_a_dict_cache_salt_keeps_its_blocks_apart(llm):
    long = "x" * 40
    run(llm, {"prompt": long})
    assert run(llm, {"prompt": long})[0].num_cached_tokens == 32
    assert run(llm, {"prompt": long, "cache_salt": "tenant-a"})[0].num_cached_tokens == 0


@pytest.mark.parametrize("prompts, error, says", [
    ({"prompt": TEXT, "multi_modal_data": {"image": b"..."}}, ValueError,
     r"multi_modal_data is not supported: PageKV serves text-only models"),
    ([TEXT, {"prompt_token_ids": [1, 2], "mm_processor_kwargs": {}}], ValueError,
     r"prompts\[1\]: mm_processor_kwargs is not supported"),
    ({"prompt": TEXT, "priority": 1}, ValueError, r"unknown key\(s\) 'priority'"),
    ({"text": TEXT}, ValueError, r"unknown key\(s\) 'text'"),
    ({}, ValueError, r"needs 'prompt' \(text\) or 'prompt_token_ids'"),
    ({"prompt": 5}, TypeError, r"\['prompt'\] must be a str"),
    ({"prompt_token_ids": "1 2 3"}, TypeError, r"\['prompt_token_ids'\] must be a non-empty"),
    ({"prompt_token_ids": []}, TypeError, r"\['prompt_token_ids'\] must be a non-empty"),
    (["ok", 3.5], TypeError, r"prompts\[1\] is a float"),
    ([["ok"]], TypeError, r"prompts\[0\] must be a non-empty list of int token ids"),
    (None, TypeError, r"prompts is a NoneType"),
])
def test_bad_prompts_are_refused_by_name_and_nothing_is_queued(llm, prompts, error, says):
    with pytest.raises(error, match=says):
        run(llm, prompts)
    assert not llm.engine.has_unfinished()


def test_a_prompt_the_engine_refuses_leaves_the_others_unqueued(llm):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        run(llm, ["fine", {"prompt_token_ids": [1, 10**6]}])
    assert not llm.engine.has_unfinished()
    assert run(llm, "fine")[0].finished  # and the engine serves on


# -- use_tqdm --------------------------------------------------------------------------------------

def test_use_tqdm_shows_finished_requests_by_default_and_none_when_false(llm, capsys):
    llm.generate(["a", "b", "c"], GREEDY)
    assert "Processed prompts" in capsys.readouterr().err
    llm.generate(["a", "b"], GREEDY, use_tqdm=False)
    assert capsys.readouterr().err == ""


def test_use_tqdm_takes_a_callable_made_like_tqdm(llm):
    buf = io.StringIO()
    llm.chat([[{"role": "user", "content": "hi"}]] * 2, GREEDY,
             chat_template="{% for m in messages %}{{ m.content }}{% endfor %}",
             use_tqdm=functools.partial(tqdm, file=buf))
    assert "Processed prompts" in buf.getvalue() and "2/2" in buf.getvalue()


# -- outputs ---------------------------------------------------------------------------------------

def test_cumulative_logprob_is_the_sum_of_the_sampled_tokens(llm):
    p = SamplingParams(max_tokens=6, temperature=1.0, seed=4, logprobs=1, n=2)
    out = run(llm, "abc", p)[0]
    for c in out.outputs:
        assert c.cumulative_logprob == pytest.approx(math.fsum(lp.logprob for lp in c.logprobs))
        assert c.cumulative_logprob < 0
    assert run(llm, "abc")[0].outputs[0].cumulative_logprob is None  # not asked (vLLM's)


def test_chat_outputs_carry_the_rendered_prompt(llm):
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    (out,) = llm.chat([{"role": "user", "content": "hi"}], GREEDY, chat_template=template,
                      use_tqdm=False)
    assert out.prompt == "<user>hi"
    assert out.prompt_token_ids == llm.tokenizer.encode("<user>hi", add_bos=False)


def test_reset_prefix_cache(llm):
    prompt = "y" * 40
    run(llm, prompt)
    assert run(llm, prompt)[0].num_cached_tokens == 32
    assert llm.reset_prefix_cache() is True
    assert run(llm, prompt)[0].num_cached_tokens == 0


# -- get_tokenizer -----------------------------------------------------------------------------------

def test_get_tokenizer_is_transformers_shaped(llm):
    tok = llm.get_tokenizer()
    assert tok.encode("hi") == [256, 104, 105] and tok.encode("hi", add_special_tokens=False) \
        == [104, 105]
    assert tok.decode([256, 104, 105]) == "<s>hi"  # transformers' default keeps specials
    assert tok.decode([256, 104, 105], skip_special_tokens=True) == "hi"
    assert tok("hi")["input_ids"] == [256, 104, 105] and len(tok) == tok.vocab_size == 258
    assert (tok.bos_token_id, tok.eos_token_id) == (256, 257)
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_get_tokenizer_matches_transformers_on_an_exported_tokenizer(tmp_path):
    transformers = pytest.importorskip("transformers")
    from pagekv.kvnode.engine.transformers_tokenizer import TransformersStyleTokenizer
    from pagekv.kvnode.model.loader import load_tokenizer
    from pagekv.proto.model_files.tokenizer_export import tokenizer_files, write_directory
    from tests.unit.test_tokenizer_export import CHATS, PRESET, TEXTS, ids_of, smollm2_file

    smollm2_file()
    write_directory(tokenizer_files(PRESET), tmp_path / "tok")
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    ours = TransformersStyleTokenizer(load_tokenizer(PRESET))
    for text in TEXTS:
        ids = theirs.encode(text)
        assert ours.encode(text) == ids
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(
            text, add_special_tokens=False)
        assert ours.decode(ids) == theirs.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(
            ids, skip_special_tokens=True)
    for chat in CHATS:
        for gen in (True, False):
            assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen) \
                == theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            want = ids_of(theirs.apply_chat_template(chat, add_generation_prompt=gen))
            assert ours.apply_chat_template(chat, add_generation_prompt=gen) == want
            assert ours.apply_chat_template(chat, add_generation_prompt=gen,
                                            return_dict=True)["input_ids"] == want
    assert ours.apply_chat_template(CHATS[:2], tokenize=False) == theirs.apply_chat_template(
        CHATS[:2], tokenize=False)


# -- dtype, seed, vLLM-only options ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["auto", "float32", "FLOAT", torch.float32])
def test_dtype_accepted_where_it_is_what_the_cpu_computes_in(dtype):
    assert LLM("pagekv-tiny", dtype=dtype, **TINY).engine.runner.dtype == torch.float32


@pytest.mark.parametrize("dtype, says", [
    ("float16", r"dtype='float16' is not supported on cpu: PageKV computes in float32 on CPU"),
    ("bfloat16", r"is not supported on cpu: .* use dtype='auto' or 'float32'"),
    (torch.float16, r"is not supported on cpu"),
    ("int8", r"dtype='int8' is not a dtype: use 'auto' or one of"),
])
def test_other_dtypes_are_refused_with_the_reason(dtype, says):
    with pytest.raises(ValueError, match=says):
        LLM("pagekv-tiny", dtype=dtype, **TINY)


def sampled(llm: LLM) -> list[list[int]]:
    p = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in run(llm, ["abc", "xyz", "abc"], p)]


def test_seed_makes_repeated_runs_reproducible():
    first = sampled(LLM("pagekv-tiny", seed=7, **TINY))
    assert sampled(LLM("pagekv-tiny", seed=7, **TINY)) == first
    assert sampled(LLM("pagekv-tiny", seed=8, **TINY)) != first
    assert first[0] != first[2]  # one stream for all: the same prompt twice draws anew
    own = SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    # A request's own seed wins over the LLM's.
    assert run(LLM("pagekv-tiny", seed=7, **TINY), "abc", own)[0].outputs[0].token_ids == \
        run(LLM("pagekv-tiny", seed=8, **TINY), "abc", own)[0].outputs[0].token_ids


@pytest.mark.parametrize("option, value, says", [
    ("tensor_parallel_size", 2, r"LLM\(tensor_parallel_size=2\) is not supported: a PageKV "
                                r"pod runs one model on one device"),
    ("tensor_parallel_size", True, r"tensor_parallel_size=True"),
    ("pipeline_parallel_size", 4, r"pipeline_parallel_size=4\) is not supported"),
    ("quantization", "awq", r"quantization='awq'\) is not supported: .*\.gguf file"),
    ("trust_remote_code", True, r"trust_remote_code=True\) is not supported: .* never a "
                                r"checkpoint's Python code"),
    ("tokenizer", "other/tokenizer", r"tokenizer='other/tokenizer'\) is not supported"),
])
def test_vllm_only_options_are_refused_by_name(option, value, says):
    with pytest.raises(ValueError, match=says):
        LLM("pagekv-tiny", **{option: value}, **TINY)


def test_vllm_only_options_at_their_default_are_accepted():
    llm = LLM("pagekv-tiny", tensor_parallel_size=1, pipeline_parallel_size=1,
              quantization=None, trust_remote_code=False, tokenizer="pagekv-tiny",
              enable_lora=True, enforce_eager=True, **TINY)  # (adapters: lora_modules)
    assert run(llm, "ok")[0].finished
    with pytest.raises(TypeError, match=r"unknown LLM option\(s\): \['no_such_option'\]"):
        LLM("pagekv-tiny", no_such_option=1, **TINY)


def test_the_dtype_flag_offers_exactly_the_names_check_dtype_knows():
    from pagekv.kvnode.engine.config import CHOICES, HELP
    from pagekv.kvnode.engine.model_dtype import DTYPE_NAMES

    assert CHOICES["dtype"] == ("auto", *sorted(DTYPE_NAMES))
    assert "seed" in HELP and "dtype" in HELP
