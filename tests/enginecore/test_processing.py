"""The client-side processors over a real EngineCore: every check of a
request's fields (once, naming the field; nothing queued), tokenizing long
text off the loop, and the output side (text deltas, stop strings that end
the stream and abort the request in the engine, EOS text left out)."""

from __future__ import annotations

import threading

import msgspec
import pytest
from engine_fakes import EOS, FakeRunner

from kvstrata.config import CacheConfig, EngineConfig, ModelConfig
from kvstrata.enginecore.builder import build_engine_core
from kvstrata.enginecore.engine_core import EngineCore
from kvstrata.enginecore.processing import (
    InputProcessor,
    ModelFacts,
    OutputProcessor,
    validate_request,
)
from kvstrata.enginecore.request import EngineRequest
from kvstrata.errors import RequestError
from kvstrata.text.prompts import INLINE_CHARS, ChatPrompt, SegmentedPrompt
from kvstrata.text.tokenizer import ByteTokenizer
from kvstrata.types import RequestOutput, SamplingParams


def inputs_of(core: EngineCore) -> InputProcessor:
    """The input processor a client of ``core`` holds (AsyncEngine builds the same)."""
    return InputProcessor(ModelFacts(max_model_len=core.max_model_len, vocab_size=core.vocab_size),
                          core.tokenizer)


def req(rid: str, prompt=(5, 6, 7, 8, 9), **params) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_token_ids=list(prompt),
                         sampling_params=SamplingParams(**{"max_tokens": 3, **params}))


def run_client(core: EngineCore, *reqs: EngineRequest, max_steps: int = 200) -> dict[str, list[RequestOutput]]:
    """What a client does with the core: queue, then pass every output
    through the request's OutputProcessor until its stream ends, aborting
    the request in the engine when a stop string ended it."""
    procs = {r.request_id: OutputProcessor(core.tokenizer, r) for r in reqs}
    for r in reqs:
        core.add_request(r)
    outs: dict[str, list[RequestOutput]] = {}
    for _ in range(max_steps):
        for o in core.step():
            proc = procs[o.request_id]
            if proc.finished:
                continue  # the client's stream already ended
            outs.setdefault(o.request_id, []).append(proc.process(o))
            if proc.engine_still_running:
                core.abort_requests([o.request_id])
        if not core.has_work():
            return outs
    raise AssertionError("engine did not drain")


BAD_INPUTS = [
    ("prompt", dict(prompt=[])),
    ("prompt", dict(prompt=[3] * 257)),
    ("prompt", dict(prompt=[3, -1])),
    ("prompt", dict(prompt=[3, 64])),
    ("prompt", dict(prompt=[3, 1.5])),
    ("max_tokens", dict(max_tokens=0)),
    ("temperature", dict(temperature=-0.5)),
    ("top_p", dict(top_p=0.0)),
    ("top_p", dict(top_p=1.5)),
    ("top_k", dict(top_k=-2)),
    ("min_tokens", dict(min_tokens=5, max_tokens=2)),
]


@pytest.mark.parametrize("field,bad", BAD_INPUTS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_INPUTS)])
async def test_bad_input_names_the_field_and_others_keep_running(make_core, field, bad):
    core = make_core()
    inputs = inputs_of(core)
    good = await inputs.process([5, 6, 7, 8, 9], SamplingParams(max_tokens=2), request_id="good")
    prompt = bad.pop("prompt", (5, 6, 7))
    with pytest.raises(RequestError) as info:
        await inputs.process(list(prompt), SamplingParams(**{"max_tokens": 3, **bad}), request_id="bad")
    assert info.value.field == field and field in str(info.value)
    assert isinstance(info.value, ValueError)
    outs = run_client(core, good)
    assert "bad" not in core.scheduler.requests
    assert outs["good"][-1].finish_reason == "length"


@pytest.mark.parametrize("field,value", [("cache_salt", ""), ("lora_name", 3), ("priority", "high"),
                                         ("request_id", "")])
def test_bad_request_fields_name_the_field(make_core, field, value):
    core = make_core()
    facts = inputs_of(core).facts
    with pytest.raises(RequestError) as info:
        validate_request(msgspec.structs.replace(req("r"), **{field: value}), facts)
    assert info.value.field == field


def test_context_is_capped_by_the_pool(make_core):
    core = make_core(num_blocks=5)  # 4 usable blocks of 4 tokens
    assert core.max_model_len == 16
    with pytest.raises(RequestError, match="max_model_len=16"):
        validate_request(req("long", [3] * 17), inputs_of(core).facts)


async def test_text_prompts_need_a_tokenizer_and_must_not_be_empty(make_core):
    inputs = inputs_of(make_core())
    with pytest.raises(RequestError, match="no tokenizer"):
        await inputs.process("text needs a tokenizer")
    with pytest.raises(RequestError, match="prompt: must not be empty"):
        await InputProcessor(inputs.facts, ByteTokenizer()).process("")
    with pytest.raises(RequestError, match="prompt: must be a str or a list"):
        await inputs.process({"not": "a prompt"})  # type: ignore[arg-type]


class _RecordingTokenizer(ByteTokenizer):
    __slots__ = ("threads",)

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[str] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.threads.append(threading.current_thread().name)
        return super().encode(text, add_special_tokens)


async def test_long_text_prompts_are_tokenized_off_the_loop():
    tok = _RecordingTokenizer()
    inputs = InputProcessor(ModelFacts(max_model_len=1 << 20, vocab_size=258), tok)
    short = await inputs.process("x" * INLINE_CHARS, request_id="short")
    long = await inputs.process("y" * (INLINE_CHARS + 1), request_id="long")
    assert len(short.prompt_token_ids) == INLINE_CHARS + 1  # BOS + bytes
    assert len(long.prompt_token_ids) == INLINE_CHARS + 2
    main = threading.current_thread().name
    assert tok.threads[0] == main and tok.threads[1] != main


def test_stop_string_spanning_tokens_ends_the_request(make_core):
    text = b"hi END more"
    runner = FakeRunner(tokenizer=ByteTokenizer(), script={"s": list(text)})
    core = make_core(runner)
    outs = run_client(core, req("s", [104, 105], max_tokens=20, stop=["END"]))["s"]
    assert "".join(o.text_delta for o in outs) == "hi "
    assert (outs[-1].finish_reason, outs[-1].stop_reason) == ("stop", "END")
    assert sum(len(o.new_token_ids) for o in outs) == len(b"hi END")
    assert "s" not in core.scheduler.requests  # the client aborted it in the engine


def test_eos_text_is_not_rendered(make_core):
    runner = FakeRunner(tokenizer=ByteTokenizer(), script={"e": [ord("o"), ord("k"), EOS]})
    core = make_core(runner)
    outs = run_client(core, req("e", [104], max_tokens=20))["e"]
    assert "".join(o.text_delta for o in outs) == "ok"
    assert (outs[-1].finish_reason, outs[-1].stop_reason) == ("stop", None)


def test_null_executor_streams_text(kv_managers):
    config = EngineConfig(executor="null", model=ModelConfig(), cache=CacheConfig(num_blocks=64))
    core = build_engine_core(config)
    kv_managers.append(core.kv)
    prompt = core.tokenizer.encode("Hello")
    outs = run_client(core, EngineRequest(request_id="n", prompt_token_ids=prompt,
                                          sampling_params=SamplingParams(max_tokens=5)))["n"]
    text = "".join(o.text_delta for o in outs)
    assert len(text) == 5 and text.isalpha() and outs[-1].finish_reason == "length"


# -- the output processor alone ---------------------------------------------------------


def _outs(rid: str, chunks: list[list[int]], last: dict | None = None) -> list[RequestOutput]:
    outs = [RequestOutput(request_id=rid, new_token_ids=c) for c in chunks]
    if last is not None:
        outs[-1] = msgspec.structs.replace(outs[-1], finished=True, **last)
    return outs


def test_a_stop_string_on_a_length_stop_wins_and_needs_no_abort():
    proc = OutputProcessor(ByteTokenizer(), req("r", [104], max_tokens=4, stop=["ab"]))
    a, b = _outs("r", [[ord("x")], [ord("a"), ord("b"), ord("c")]], last={"finish_reason": "length"})
    assert proc.process(a).text_delta == "x"
    out = proc.process(b)
    assert (out.text_delta, out.finished, out.finish_reason, out.stop_reason) == ("", True, "stop", "ab")
    assert out.new_token_ids == [ord("a"), ord("b"), ord("c")]  # the engine's tokens, as they came
    assert proc.finished and not proc.engine_still_running


def test_include_stop_str_and_min_tokens_apply_on_the_client():
    proc = OutputProcessor(ByteTokenizer(), req("r", [104], max_tokens=9, stop=["a"], min_tokens=2,
                                                include_stop_str_in_output=True))
    deltas = [proc.process(o) for o in _outs("r", [[ord("a")], [ord("b")], [ord("a")], [ord("z")]])[:3]]
    assert [d.text_delta for d in deltas] == ["a", "b", "a"]  # the first "a" is within min_tokens
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("stop", "a")
    assert proc.engine_still_running


def test_outputs_without_tokens_or_tokenizer_pass_through():
    abort = RequestOutput(request_id="r", finished=True, finish_reason="abort")
    proc = OutputProcessor(ByteTokenizer(), req("r", stop=["x"]))
    assert proc.process(abort) is abort and proc.finished and not proc.engine_still_running
    plain = OutputProcessor(None, req("r", stop=["x"]))
    out = RequestOutput(request_id="r", new_token_ids=[ord("x")])
    assert plain.process(out) is out and not plain.finished


async def test_conversations_and_blend_segments_take_the_same_text_path():
    """A ChatPrompt is rendered and tokenized by the processor (the plain
    format here); a SegmentedPrompt's spans and ratio become the request's BlendSpec."""
    inputs = InputProcessor(ModelFacts(max_model_len=256, vocab_size=258), ByteTokenizer())
    chat = await inputs.process(ChatPrompt(messages=[{"role": "user", "content": "hi"}]), request_id="c")
    assert chat.prompt_token_ids == ByteTokenizer().encode("<|user|>\nhi\n<|assistant|>\n")
    seg = await inputs.process(SegmentedPrompt(prompt="head AAA mid BBB q", segments=["AAA", "BBB"],
                                               recompute_ratio=0.5), SamplingParams(max_tokens=2), request_id="s")
    blend = seg.sampling_params.blend
    assert blend is not None and blend.recompute_ratio == 0.5 and seg.sampling_params.max_tokens == 2
    assert [bytes(seg.prompt_token_ids[s:e]).decode() for s, e in blend.segments] == ["AAA", "BBB"]
    with pytest.raises(RequestError) as info:
        await inputs.process(SegmentedPrompt(prompt="head AAA", segments=["ZZZ"]), request_id="bad")
    assert info.value.field == "blend.segments[0]"
