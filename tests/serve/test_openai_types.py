"""OpenAI request bodies: what maps to SamplingParams and which field a 400
names for a body of the wrong shape. Values out of range are the engine
client's to reject (tests/serve/test_http_server.py: the same 400s, end to end)."""

import pytest

from kvstrata.api_server import openai_types as T


def _params(body: bytes, typ=T.CompletionRequest):
    return T.sampling_params(T.decode_request(body, typ))


def test_completion_maps_sampling_fields():
    req = T.decode_request(b'{"prompt":"hi","max_tokens":5,"temperature":0,"stop":"x","seed":3,"extra":1}',
                           T.CompletionRequest)
    p = T.sampling_params(req)
    assert (p.max_tokens, p.temperature, p.stop, p.seed) == (5, 0.0, ["x"], 3)
    assert T.completion_prompt(req) == "hi"


@pytest.mark.parametrize("body, param", [
    (b'{"prompt":"hi","max_tokens":"x"}', "max_tokens"),
    (b'{"max_tokens":3}', "prompt"),
    (b'{"prompt":"hi","stop":[1]}', "stop[0]"),
    (b'{"prompt":"hi","n":2}', "n"),
])
def test_validation_error_names_the_field(body, param):
    with pytest.raises(T.RequestValidationError) as e:
        req = T.decode_request(body, T.CompletionRequest)
        T.sampling_params(req)
    assert e.value.param == param


@pytest.mark.parametrize("body", [b'{"prompt":["a","b"]}', b'{"prompt":"x","echo":true}'])
def test_unsupported_prompts_name_the_prompt(body):
    req = T.decode_request(body, T.CompletionRequest)
    with pytest.raises(T.RequestValidationError) as e:
        T.completion_prompt(req)
    assert e.value.param in ("prompt", "echo")


def test_token_prompt_and_single_batch_prompt():
    assert T.completion_prompt(T.decode_request(b'{"prompt":[1,2]}', T.CompletionRequest)) == [1, 2]
    assert T.completion_prompt(T.decode_request(b'{"prompt":[[3]]}', T.CompletionRequest)) == [3]
    assert T.completion_prompt(T.decode_request(b'{"prompt":["x"]}', T.CompletionRequest)) == "x"


def test_plain_chat_format_and_role_check():
    """A checkpoint without a chat template gets the plain role-tagged format."""
    from kvstrata.api_server.server import _chat_prompt
    from kvstrata.text.tokenizer import ByteTokenizer

    req = T.decode_request(b'{"messages":[{"role":"system","content":"S"},'
                           b'{"role":"user","content":[{"type":"text","text":"U"}]}]}', T.ChatCompletionRequest)
    assert _chat_prompt(ByteTokenizer(), req.messages) == "<|system|>\nS\n<|user|>\nU\n<|assistant|>\n"
    bad = T.decode_request(b'{"messages":[{"role":"robot","content":"x"}]}', T.ChatCompletionRequest)
    with pytest.raises(T.RequestValidationError) as e:
        _chat_prompt(ByteTokenizer(), bad.messages)
    assert e.value.param == "messages[0].role"
