"""``--chat-template`` (vLLM's flag: a file or a Jinja string), a request's ``chat_template`` under
``--trust-request-chat-template``, ``chat_template_kwargs`` and ``GET /props`` (llama-server's), through a
server over the scripted engine with the default model's tokenizer: which template each endpoint renders,
and every refusal in the API's error shape."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from srv_harness import ServerThread, assert_error

http = httpx.Client(timeout=30)

# A template unlike the model's own (ChatML): each turn as "[role] text", so a prompt shows which one rendered it.
SERVED = (
    "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
# A request's own: it also reads a variable the request sets through chat_template_kwargs.
ASKED = "{% for m in messages %}<{{ m.role }}|{{ m.content }}>{% endfor %}{{ greeting | default('') }}"
HI = [{"role": "user", "content": "Hi"}]


def prompt_text(eng: Any) -> str:
    return eng.tokenizer.decode(eng.prompts[-1])


@pytest.fixture
def served(fake_server: Any) -> Iterator[tuple[ServerThread, Any, Any]]:
    """A server whose --chat-template is SERVED."""
    srv, eng, ae = fake_server()
    srv.server.config.app.state.serving.chat_template = SERVED
    yield srv, eng, ae


def test_every_chat_endpoint_renders_the_served_template(served: tuple[ServerThread, Any, Any]) -> None:
    import anthropic
    import openai

    srv, eng, _ = served
    want = "[user] Hi\n[assistant] "
    oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    oai.chat.completions.create(model="fake-model", messages=HI, max_tokens=1)
    assert prompt_text(eng) == want
    oai.responses.create(model="fake-model", input="Hi", max_output_tokens=1)
    assert prompt_text(eng) == want
    claude = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)
    claude.messages.create(model="fake-model", messages=HI, max_tokens=1)
    assert prompt_text(eng) == want
    # What a prompt costs is counted through the same template.
    assert claude.messages.count_tokens(model="fake-model", messages=HI).input_tokens == len(eng.prompts[-1])
    ids = eng.tokenizer.encode(want, add_special_tokens=False)
    assert http.post(srv.url + "/tokenize", json={"messages": HI}).json()["tokens"] == ids
    assert http.post(srv.url + "/v1/chat/completions/render", json={"messages": HI}).json()["token_ids"] == ids


def test_props_shows_the_served_template(fake_server: Any) -> None:
    srv, eng, _ = fake_server()
    props = http.get(srv.url + "/props").json()
    assert props["chat_template"] == eng.tokenizer.chat_template  # the model's own, by default
    assert props["model_alias"] == "fake-model" and props["default_generation_settings"]["n_ctx"] == 256
    assert (props["bos_token"], props["eos_token"]) == (eng.tokenizer.bos_token, eng.tokenizer.eos_token)
    srv.server.config.app.state.serving.chat_template = SERVED
    assert http.get(srv.url + "/props").json()["chat_template"] == SERVED


def test_props_is_behind_the_api_key(fake_server: Any) -> None:
    srv, _, _ = fake_server(api_key="k")
    assert_error(http.get(srv.url + "/props"), 401)
    assert http.get(srv.url + "/props", headers={"Authorization": "Bearer k"}).status_code == 200


def test_a_request_template_needs_the_servers_trust(served: tuple[ServerThread, Any, Any]) -> None:
    srv, eng, _ = served
    for path in ("/v1/chat/completions", "/v1/chat/completions/render", "/tokenize"):
        r = http.post(
            srv.url + path,
            json={"messages": HI, "chat_template": ASKED, "max_tokens": 1}
            if "chat" in path
            else {"messages": HI, "chat_template": ASKED},
        )
        assert "--trust-request-chat-template" in assert_error(r, 400, "chat_template")["message"]
    assert eng.prompts == []


def test_a_trusted_request_template_renders_with_its_kwargs(served: tuple[ServerThread, Any, Any]) -> None:
    import openai

    srv, eng, _ = served
    srv.server.config.app.state.serving.trust_request_chat_template = True
    oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    extra = {"chat_template": ASKED, "chat_template_kwargs": {"greeting": "Bonjour"}}
    oai.chat.completions.create(model="fake-model", messages=HI, max_tokens=1, extra_body=extra)
    assert prompt_text(eng) == "<user|Hi>Bonjour"
    ids = eng.tokenizer.encode("<user|Hi>Bonjour", add_special_tokens=False)
    assert http.post(srv.url + "/tokenize", json={"messages": HI, **extra}).json()["tokens"] == ids
    assert http.post(srv.url + "/v1/chat/completions/render", json={"messages": HI, **extra}).json()["token_ids"] == ids
    # The next request without one gets the served template again.
    oai.chat.completions.create(model="fake-model", messages=HI, max_tokens=1)
    assert prompt_text(eng) == "[user] Hi\n[assistant] "


@pytest.mark.parametrize(
    ("template", "says"),
    [
        ("{% for m in messages %}{{ m.content }", "does not compile"),
        (
            "{% if messages %}{{ raise_exception('this template wants a system turn') }}{% endif %}",
            "this template wants a system turn",
        ),
        ("{{ messages[0].content.nope() }}", "cannot render"),
    ],
)
def test_a_bad_request_template_is_a_400_and_harms_nothing(
    served: tuple[ServerThread, Any, Any], template: str, says: str
) -> None:
    srv, eng, _ = served
    srv.server.config.app.state.serving.trust_request_chat_template = True
    for path, extra in (("/v1/chat/completions", {"max_tokens": 1}), ("/tokenize", {})):
        r = http.post(srv.url + path, json={"messages": HI, "chat_template": template, **extra})
        assert says in assert_error(r, 400, "chat_template")["message"]
    r = http.post(srv.url + "/v1/chat/completions", json={"messages": HI, "max_tokens": 1})
    assert r.status_code == 200 and prompt_text(eng) == "[user] Hi\n[assistant] "


def test_template_kwargs_name_the_template_field(shared_fake_server: Any) -> None:
    srv, _, _ = shared_fake_server
    r = http.post(
        srv.url + "/v1/chat/completions", json={"messages": HI, "chat_template_kwargs": {"chat_template": ASKED}}
    )
    assert "'chat_template'" in assert_error(r, 400, "chat_template_kwargs.chat_template")["message"]


def test_tokenize_takes_chat_template_kwargs(served: tuple[ServerThread, Any, Any]) -> None:
    srv, eng, _ = served
    srv.server.config.app.state.serving.chat_template = SERVED + "{{ greeting | default('') }}"
    ids = http.post(srv.url + "/tokenize", json={"messages": HI, "chat_template_kwargs": {"greeting": "Hola"}}).json()[
        "tokens"
    ]
    assert eng.tokenizer.decode(ids) == "[user] Hi\n[assistant] Hola"


# ------------------------------------------------------------------------------------- the flag


def test_the_flag_takes_a_file_or_a_template(serve_app: Any, tmp_path: Path) -> None:
    path = tmp_path / "chat.jinja"
    path.write_text(SERVED)
    for value in (str(path), SERVED):
        ctx = serve_app("--chat-template", value).state.serving
        assert (ctx.chat_template, ctx.trust_request_chat_template) == (SERVED, False)
    assert serve_app().state.serving.chat_template is None  # the model's own
    assert serve_app("--trust-request-chat-template").state.serving.trust_request_chat_template is True


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("no/such/template.jinja", "looks like a file path, but it cannot be read"),
        ("{% for m in messages %}{{ m.content }", "does not compile"),
        ("{{ raise_exception('needs a system turn') }}", "needs a system turn"),
    ],
)
def test_a_bad_flag_stops_the_start_before_the_model_loads(
    serve_app: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, value: str, says: str
) -> None:
    import servelm.scheduler.engine

    def no_engine(*_: Any, **__: Any) -> None:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(servelm.scheduler.engine, "Engine", no_engine)
    with caplog.at_level(logging.ERROR, logger="servelm"):
        assert serve_app("--chat-template", value, status=1) is None
    assert any("cannot start: --chat-template" in r.getMessage() and says in r.getMessage() for r in caplog.records), (
        caplog.text
    )


def test_the_shipped_qwen_coder_template_renders_tools_and_results(server_tokenizer: Any) -> None:
    # docs/templates/qwen2.5-coder-tools.jinja: the Qwen2.5-Coder files' own template with the call example's
    # braces single (the files double them, and the model copies them) and a line on when not to call.
    from servelm.server.chat_template import check_chat_template, load_chat_template

    text = load_chat_template(str(Path(__file__).parents[2] / "docs" / "templates" / "qwen2.5-coder-tools.jinja"))
    check_chat_template(text)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "Sunny"},
    ]
    prompt = server_tokenizer.apply_chat_template(
        messages, tools=tools, chat_template=text, tokenize=False, add_generation_prompt=True
    )
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in prompt
    assert "{{" not in prompt and "do not call any: answer in plain text" in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert prompt.endswith("<tool_response>\nSunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
