"""Ollama's API (server/ollama_*.py) driven by the real ``ollama`` Python client and LangChain's
``ChatOllama``, unchanged, over the scripted engine: what they parse, the options that reach
sampling, and the refusals. The answers are the scripted model's, checked against its script."""

from __future__ import annotations

import json
from typing import Any

import httpx
import ollama
import pytest
from srv_harness import FakeEngine

MODEL = "fake-model"


@pytest.fixture
def client(shared_fake_server: Any) -> ollama.Client:
    srv, _, _ = shared_fake_server
    return ollama.Client(host=srv.url)


@pytest.fixture
def engine(shared_fake_server: Any) -> FakeEngine:
    return shared_fake_server[1]


def test_chat_answers_as_ollama_does_streamed_and_not(
    client: ollama.Client, engine: FakeEngine, shared_fake_server: Any
) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    r = client.chat(model=MODEL, messages=messages, options={"num_predict": 5}, stream=False)
    assert r.message.role == "assistant" and r.message.content == engine.expected_text(5)
    assert r.done and r.done_reason == "length" and r.eval_count == 5
    # The same conversation through the OpenAI endpoint: the same prompt tokens.
    openai = httpx.post(
        f"{shared_fake_server[0].url}/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 5}
    ).json()
    assert r.prompt_eval_count == openai["usage"]["prompt_tokens"]
    assert r.total_duration is not None and r.total_duration >= (r.eval_duration or 0) > 0
    parts = list(client.chat(model=MODEL, messages=messages, options={"num_predict": 6}, stream=True))
    assert "".join(p.message.content or "" for p in parts) == engine.expected_text(6)
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert (
        parts[-1].done_reason == "length"
        and parts[-1].eval_count == 6
        and parts[-1].prompt_eval_count == openai["usage"]["prompt_tokens"]
    )


def test_generate_through_the_template_and_raw(client: ollama.Client, engine: FakeEngine) -> None:
    r = client.generate(
        model=MODEL, prompt="Why is the sky blue?", system="Answer briefly.", options={"num_predict": 4}
    )
    assert r.response == engine.expected_text(4) and r.done_reason == "length"
    rendered = engine.tokenizer.decode(engine.prompts[-1])
    assert (
        "Answer briefly." in rendered and "<|im_start|>user\nWhy is the sky blue?" in rendered
    )  # the chat template's turns
    streamed = list(
        client.generate(model=MODEL, prompt="Plain text", raw=True, options={"num_predict": 3}, stream=True)
    )
    assert "".join(p.response for p in streamed) == engine.expected_text(3)
    assert engine.prompts[-1] == engine.tokenizer.encode("Plain text")  # raw: the prompt as it is
    loaded = client.generate(model=MODEL, prompt="")  # no prompt: Ollama's "load the model"
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""


def test_options_reach_sampling(client: ollama.Client, engine: FakeEngine) -> None:
    options = {"temperature": 0.3, "top_p": 0.8, "top_k": 7, "min_p": 0.05, "seed": 11, "num_predict": 3,
               "stop": ["zzz"], "repeat_penalty": 1.2, "presence_penalty": 0.1, "frequency_penalty": 0.2, "num_ctx": 4096}  # fmt: skip
    client.chat(model=MODEL, messages=[{"role": "user", "content": "x"}], options=options)
    p = engine.last_params
    got = (
        p.temperature,
        p.top_p,
        p.top_k,
        p.min_p,
        p.seed,
        p.max_tokens,
        p.stop,
        p.repetition_penalty,
        p.presence_penalty,
        p.frequency_penalty,
    )
    assert got == (0.3, 0.8, 7, 0.05, 11, 3, ["zzz"], 1.2, 0.1, 0.2)
    client.chat(model=MODEL, messages=[{"role": "user", "content": "x"}], options={"num_predict": -1, "temperature": 0})
    assert engine.last_params.max_tokens is None


def test_format_and_tools_reach_the_serving_path(client: ollama.Client, engine: FakeEngine) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    client.chat(model=MODEL, messages=[{"role": "user", "content": "x"}], format=schema, options={"num_predict": 2})
    spec = engine.last_params.structured_output
    assert spec is not None and spec.kind == "json" and json.loads(spec.value) == schema
    client.generate(model=MODEL, prompt="x", format="json", options={"num_predict": 2})
    spec = engine.last_params.structured_output
    assert spec is not None and spec.kind == "json" and json.loads(spec.value) in ({}, {"type": "object"})

    def get_weather(city: str) -> str:
        """Get the weather in a city.

        Args:
          city: the city
        """
        return "sunny"

    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"},
    ]
    client.chat(model=MODEL, messages=history, tools=[get_weather], options={"num_predict": 2})
    rendered = engine.tokenizer.decode(engine.prompts[-1])
    assert "get_weather" in rendered and '"city": "Paris"' in rendered and "sunny" in rendered


def test_model_endpoints(client: ollama.Client, shared_fake_server: Any) -> None:
    tags = client.list()
    assert [m.model for m in tags.models] == [MODEL]
    ps = client.ps()
    assert [m.model for m in ps.models] == [MODEL] and ps.models[0].context_length == 256
    show = client.show(MODEL)
    assert "<|im_start|>" in (show.template or "") and show.capabilities == ["completion", "tools"]
    assert show.modelinfo is not None and any(k.endswith(".context_length") for k in show.modelinfo)
    version = httpx.get(f"{shared_fake_server[0].url}/api/version").json()["version"]
    assert version == httpx.get(f"{shared_fake_server[0].url}/version").json()["version"]


@pytest.mark.parametrize("call", ["pull", "push", "delete", "create", "copy"])
def test_registry_operations_are_refused_clearly(client: ollama.Client, call: str) -> None:
    with pytest.raises(ollama.ResponseError) as e:
        if call == "copy":
            client.copy(MODEL, "other")
        elif call == "create":
            client.create(model="other", from_=MODEL)
        else:
            getattr(client, call)(MODEL)
    assert e.value.status_code == 501 and "model files named at start-up" in e.value.error


def test_bad_requests_are_ollama_errors(client: ollama.Client, engine: FakeEngine) -> None:
    added = len(engine.added)
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=MODEL, messages=[{"role": "user", "content": "what is this?", "images": [b"\x89PNG\r\n"]}])
    assert e.value.status_code == 400 and "Images are not supported" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="llama3:latest", messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 404 and "llama3:latest" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model=MODEL, prompt="x", suffix="y")
    assert e.value.status_code == 400 and "suffix" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model=MODEL, input="x")  # a generative model
    assert e.value.status_code == 400
    assert len(engine.added) == added


def test_langchain_chat_ollama(shared_fake_server: Any) -> None:
    from langchain_core.messages import HumanMessage, SystemMessage
    from langchain_ollama import ChatOllama

    srv, engine, _ = shared_fake_server
    llm = ChatOllama(model=MODEL, base_url=srv.url, num_predict=5, temperature=0)
    answer = llm.invoke([SystemMessage("Be brief."), HumanMessage("Hello")])
    assert answer.content == engine.expected_text(5)
    assert answer.usage_metadata is not None and answer.usage_metadata["output_tokens"] == 5
    streamed = "".join(str(c.content) for c in llm.stream("Hello"))
    assert streamed == engine.expected_text(5)
