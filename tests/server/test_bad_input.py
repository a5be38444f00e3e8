"""Bad input gets an OpenAI-style 4xx error naming the problem, and the server keeps serving."""

import httpx
import pytest
from conftest import SERVER_FLAGS, LiveServer, wait_pages_free

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]


def check(resp, status, fragment, param=None):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert fragment in err["message"], err["message"]
    if param is not None:
        assert err["param"] == param


CASES = [
    ("malformed json", CHAT, b'{"messages": [', 400, "not valid JSON", None),
    ("non-utf8 bytes", CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, "not valid JSON", None),
    ("messages wrong type", CHAT, {"messages": "hi"}, 422, "messages", "messages"),
    ("max_tokens wrong type", COMP, {"prompt": "hi", "max_tokens": "many"}, 422, "valid integer", "max_tokens"),
    ("missing prompt", COMP, {"max_tokens": 3}, 422, "prompt: Field required", "prompt"),
    ("unknown model", CHAT, {"model": "gpt-9", "messages": MSG}, 404, "The model `gpt-9` does not exist", "model"),
    ("empty messages", CHAT, {"messages": []}, 400, "at least 1 item", "messages"),
    ("unknown role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role", None),
    ("max_tokens < 1", COMP, {"prompt": "hi", "max_tokens": 0}, 400, "greater than or equal to 1", "max_tokens"),
    ("max_tokens beyond context", COMP, {"prompt": "hi", "max_tokens": 500}, 400,
     "maximum context length is 128 tokens", "max_tokens"),
    ("prompt too long", COMP, {"prompt": list(range(1, 200)), "max_tokens": 1}, 400,
     "maximum context length is 128 tokens", "prompt"),
    ("temperature < 0", CHAT, {"messages": MSG, "temperature": -1}, 400, "greater than or equal to 0", "temperature"),
    ("top_p = 0", CHAT, {"messages": MSG, "top_p": 0}, 400, "greater than 0", "top_p"),
    ("top_p > 1", CHAT, {"messages": MSG, "top_p": 1.5}, 400, "less than or equal to 1", "top_p"),
    ("top_k < -1", CHAT, {"messages": MSG, "top_k": -2}, 400, "greater than or equal to -1", "top_k"),
    ("n < 1", CHAT, {"messages": MSG, "n": 0}, 400, "greater than or equal to 1", "n"),
    ("logprobs > 20", COMP, {"prompt": "hi", "logprobs": 21}, 400, "less than or equal to 20", "logprobs"),
    ("top_logprobs > 20", CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, 400,
     "less than or equal to 20", "top_logprobs"),
    ("token outside vocab", COMP, {"prompt": [10 ** 7], "max_tokens": 1}, 400, "outside the vocabulary", "prompt"),
    ("negative token echoed", COMP, {"prompt": [5, -3], "max_tokens": 1, "echo": True}, 400, "outside the vocabulary",
     "prompt"),
    ("empty prompt list", COMP, {"prompt": [], "max_tokens": 1}, 400, "must not be empty", "prompt"),
    ("json response format", CHAT, {"messages": MSG, "response_format": {"type": "json_object"}}, 400,
     "not supported", "response_format"),
    ("penalties", CHAT, {"messages": MSG, "presence_penalty": 0.5}, 400, "not supported", "presence_penalty"),
    ("logit_bias", CHAT, {"messages": MSG, "logit_bias": {"5": -100}}, 400, "logit_bias is not supported", "logit_bias"),
    ("best_of", COMP, {"prompt": "hi", "best_of": 3}, 400, "best_of is not supported", "best_of"),
    ("stream_options without stream", CHAT, {"messages": MSG, "stream_options": {"include_usage": True}}, 400,
     "only allowed with stream=true", "stream_options"),
    ("echo with logprobs", COMP, {"prompt": "hi", "max_tokens": 1, "echo": True, "logprobs": 1}, 400,
     "echo with logprobs", "echo"),
]


def test_null_means_the_default(live):
    """Clients that send unset fields as null (OpenAI's spec allows it for n, stream, echo,
    logprobs, ...) get the defaults; harmless values of unsupported fields pass."""
    with httpx.Client(base_url=live.url, timeout=30) as c:
        r = c.post(CHAT, json={"messages": MSG, "max_tokens": 2, "n": None, "stream": None, "logprobs": None,
                               "ignore_eos": None, "add_generation_prompt": None, "logit_bias": None, "best_of": 1})
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 1 and r.json()["choices"][0]["logprobs"] is None
        r = c.post(COMP, json={"prompt": "hi", "max_tokens": 2, "echo": None, "n": None, "logit_bias": {}})
        assert r.status_code == 200 and not r.json()["choices"][0]["text"].startswith("hi"), r.text


@pytest.mark.parametrize("name,path,body,status,fragment,param", CASES, ids=[c[0] for c in CASES])
def test_bad_request(live, name, path, body, status, fragment, param):
    with httpx.Client(base_url=live.url, timeout=30) as c:
        if isinstance(body, bytes):
            r = c.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = c.post(path, json=body)
        check(r, status, fragment, param)
        ok = c.post(COMP, json={"prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200
    assert wait_pages_free(live.engine)


def test_oversized_body(live):
    with httpx.Client(base_url=live.url, timeout=30) as c:
        r = c.post(COMP, json={"prompt": "x" * 70000, "max_tokens": 1})
        check(r, 413, "exceeds the 65536-byte limit")


def test_unknown_route_is_404(live):
    with httpx.Client(base_url=live.url, timeout=30) as c:
        check(c.get("/v1/nothing"), 404, "Not Found")


def test_api_key(tiny_ckpt):
    srv = LiveServer(["--model", str(tiny_ckpt), "--api-key", "sekret"] + SERVER_FLAGS)
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            check(c.get("/v1/models"), 401, "API key")
            check(c.post(COMP, json={"prompt": "hi"}, headers={"Authorization": "Bearer wrong"}), 401, "API key")
            assert c.get("/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
            assert c.get("/health").status_code == 200          # health needs no key, like vLLM
    finally:
        srv.stop()
