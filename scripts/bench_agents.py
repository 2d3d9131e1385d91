"""Agents on a small real model: servelm against llama.cpp's llama-server on the same GGUF file, one server
at a time, at temperature 0, through the clients agents use.

    .venv/bin/python scripts/bench_agents.py [--model FILE] [--chat-template FILE | --as-stored] [--servers servelm llama]
                                             [--llama-server PATH] [--json OUT.json]

Checks, each run not streamed and streamed:
- the six steps of an agent: (1) "auto" calls the right tool with the right argument; (2) the answer uses
  the tool's result sent back; (3) a streamed call (streamed in both runs); (4) ``tool_choice: "required"``;
  (5) a named tool; (6) a plain question is answered without a call (OpenAI SDK);
- three agent loops, each a call, the tool run here, its result sent back and an answer that uses it: the
  OpenAI SDK on /v1/chat/completions, the Anthropic SDK's tool_use / tool_result on /v1/messages, and
  LangChain's ``ChatOpenAI.bind_tools``.

servelm runs with ``--tool-call-parser hermes --enable-auto-tool-choice`` (Qwen2.5's format), llama-server
with ``--jinja`` (its own reading of the template), both with the file's own chat template (servelm corrects its
known quirks unless ``--as-stored``: server/template_fixes.py) or both with
``--chat-template`` (llama-server's ``--chat-template-file``). The default
model is Qwen2.5-Coder-1.5B-Instruct Q4_K_M; llama-server is the one scripts/bench_vs_llama_cpp.sh builds.
Pass counts print side by side; every answer goes to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

CACHE = Path(os.environ.get("SERVELM_CACHE", Path.home() / ".cache" / "servelm"))
MODEL = CACHE / "models" / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
LLAMA = CACHE / "peers" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp" / "build" / "bin" / "llama-server"
PORT = 18150

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "description": "The city's name"}},
    "required": ["city"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Get the current weather in a city", "parameters": CITY},
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "Get the current local time in a city", "parameters": CITY},
    },
]
ASK = "What is the weather like in Paris right now?"
RESULT = "Sunny, 22 degrees Celsius"  # the tool's answer; the model's final answer must carry the 22
PLAIN = "Say hello in French, one word."
MAX_TOKENS = 200

Check = tuple[bool, Any]  # passed, and what the model answered


def get_weather(city: str) -> str:
    """The tool the loops run."""
    return RESULT if "paris" in city.lower() else "unknown city"


def right_call(calls: list[tuple[str, str]]) -> bool:
    if not calls:
        return False
    name, arguments = calls[0]
    try:
        args = json.loads(arguments)
    except ValueError:
        return False
    return name == "get_weather" and isinstance(args, dict) and "paris" in str(args.get("city", "")).lower()


# ------------------------------------------------------------------------------ OpenAI SDK: the six steps


def chat(client: Any, model: str, stream: bool, messages: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    """One chat completion as {content, calls: [(name, arguments)], finish}, joined from the deltas when streamed."""
    kw = {"model": model, "messages": messages, "tools": TOOLS, "temperature": 0, "max_tokens": MAX_TOKENS, **kw}
    if not stream:
        choice = client.chat.completions.create(**kw).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
        return {"content": choice.message.content, "calls": calls, "finish": choice.finish_reason}
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or ():
            name, args = calls.get(d.index, ("", ""))
            fn = d.function
            calls[d.index] = (name + ((fn and fn.name) or ""), args + ((fn and fn.arguments) or ""))
        finish = choice.finish_reason or finish
    return {"content": content or None, "calls": [calls[i] for i in sorted(calls)], "finish": finish}


def six_steps(client: Any, model: str, stream: bool) -> dict[str, Check]:
    ask = [{"role": "user", "content": ASK}]
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})},
    }
    answered = [
        *ask,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": RESULT},
    ]
    named = {"type": "function", "function": {"name": "get_weather"}}
    steps: dict[str, Callable[[], Check]] = {
        "1 auto: right tool and argument": lambda: judge(right_call, chat(client, model, stream, ask)),
        "2 answer from the tool's result": lambda: judge(
            lambda r: "22" in (r or ""), chat(client, model, stream, answered), "content"
        ),
        "3 a streamed call": lambda: judge(right_call, chat(client, model, True, ask)),
        "4 required": lambda: judge(right_call, chat(client, model, stream, ask, tool_choice="required")),
        "5 a named tool": lambda: judge(right_call, chat(client, model, stream, ask, tool_choice=named)),
        "6 a plain answer, no call": lambda: judge(
            lambda r: not r["calls"] and "bonjour" in (r["content"] or "").lower(),
            chat(client, model, stream, [{"role": "user", "content": PLAIN}]),
            None,
        ),
    }
    return {name: attempt(step) for name, step in steps.items()}


def judge(ok: Callable[[Any], bool], answer: dict[str, Any], field: str | None = "calls") -> Check:
    return ok(answer if field is None else answer[field]), answer


def attempt(step: Callable[[], Check]) -> Check:
    try:
        return step()
    except Exception as e:  # a server that refuses a request fails that check, the run goes on
        return False, f"{type(e).__name__}: {e}"[:300]


# ------------------------------------------------------------------------------ the three loops


def openai_loop(client: Any, model: str, stream: bool) -> Check:
    messages: list[dict[str, Any]] = [{"role": "user", "content": ASK}]
    first = chat(client, model, stream, messages)
    if not right_call(first["calls"]):
        return False, first
    name, arguments = first["calls"][0]
    call = {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": get_weather(**json.loads(arguments))},
    ]
    final = chat(client, model, stream, messages)
    return "22" in (final["content"] or ""), [first, final]


def anthropic_loop(base_url: str, model: str, stream: bool) -> Check:
    import anthropic

    client = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    tools = [
        {
            "name": t["function"]["name"],
            "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"],
        }
        for t in TOOLS
    ]
    messages: list[dict[str, Any]] = [{"role": "user", "content": ASK}]

    def ask() -> Any:
        kw = {
            "model": model,
            "max_tokens": MAX_TOKENS,
            "tools": tools,
            "messages": messages,
            "extra_body": {"temperature": 0},
        }
        if not stream:
            return client.messages.create(**kw)
        with client.messages.stream(**kw) as s:
            return s.get_final_message()

    first = ask()
    uses = [b for b in first.content if b.type == "tool_use"]
    seen = [b.model_dump(exclude_none=True) for b in first.content]
    if not uses or not right_call([(uses[0].name, json.dumps(uses[0].input))]):
        return False, seen
    messages += [
        {"role": "assistant", "content": seen},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": get_weather(**uses[0].input)}],
        },
    ]
    final = ask()
    text = "".join(b.text for b in final.content if b.type == "text")
    return "22" in text, [seen, text]


def langchain_loop(base_url: str, model: str, stream: bool) -> Check:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather_tool(city: str) -> str:
        """Get the current weather in a city"""
        return get_weather(city)

    get_weather_tool.name = "get_weather"
    llm = ChatOpenAI(
        base_url=base_url + "/v1",
        api_key="unused",
        model=model,
        temperature=0,
        max_tokens=MAX_TOKENS,
        max_retries=0,
        timeout=600,
    )
    agent = llm.bind_tools([get_weather_tool])

    def ask(messages: list[Any]) -> Any:
        if not stream:
            return agent.invoke(messages)
        whole = None
        for chunk in agent.stream(messages):
            whole = chunk if whole is None else whole + chunk
        return whole

    messages: list[Any] = [HumanMessage(ASK)]
    first = ask(messages)
    calls = first.tool_calls
    if not right_call([(c["name"], json.dumps(c["args"])) for c in calls]):
        return False, {"content": first.content, "tool_calls": calls}
    messages += [first, ToolMessage(get_weather_tool.invoke(calls[0]["args"]), tool_call_id=calls[0]["id"])]
    final = ask(messages)
    return "22" in str(final.content), [calls, final.content]


# ------------------------------------------------------------------------------ servers


def serve(
    kind: str, model: Path, template: Path | None, llama: Path, log: Path, as_stored: bool = False
) -> subprocess.Popen[bytes]:
    port = str(PORT)
    if kind == "servelm":
        argv = [
            sys.executable,
            "-m",
            "servelm.server.cli",
            "serve",
            "--model",
            str(model),
            "--port",
            port,
            "--no-access-log",
            "--tool-call-parser",
            "hermes",
            "--enable-auto-tool-choice",
            "--max-model-len",
            "8192",
            "--max-num-seqs",
            "4",
        ]
    else:
        argv = [
            str(llama),
            "-m",
            str(model),
            "--jinja",
            "-nr",
            "-t",
            "2",
            "-c",
            "8192",
            "--host",
            "127.0.0.1",
            "--port",
            port,
        ]
    if template is not None:
        argv += ["--chat-template" if kind == "servelm" else "--chat-template-file", str(template)]
    elif as_stored and kind == "servelm":
        argv.append("--chat-template-as-stored")
    proc = subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(900):
        if proc.poll() is not None:
            raise SystemExit(f"{kind} exited at start-up: see {log}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise SystemExit(f"{kind} did not become healthy: see {log}")


def run_checks(base_url: str) -> dict[str, dict[str, Check]]:
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    out: dict[str, dict[str, Check]] = {}
    for stream in (False, True):
        mode = "streamed" if stream else "not streamed"
        out[f"six steps, {mode}"] = six_steps(client, model, stream)
        out[f"loops, {mode}"] = {
            "OpenAI SDK": attempt(lambda: openai_loop(client, model, stream)),
            "Anthropic SDK (/v1/messages)": attempt(lambda: anthropic_loop(base_url, model, stream)),
            "LangChain bind_tools": attempt(lambda: langchain_loop(base_url, model, stream)),
        }
        for name, (ok, _) in [*out[f"six steps, {mode}"].items(), *out[f"loops, {mode}"].items()]:
            print(f"   {mode:12} {name:34} {'pass' if ok else 'FAIL'}", flush=True)
    return out


def table(results: dict[str, dict[str, dict[str, Check]]]) -> str:
    servers = list(results)
    groups = list(next(iter(results.values())))
    lines = ["| check | " + " | ".join(servers) + " |", "| --- |" + " --- |" * len(servers)]
    for group in groups:
        names = list(results[servers[0]][group])
        counts = [f"**{sum(ok for ok, _ in results[s][group].values())}/{len(names)}**" for s in servers]
        lines.append(f"| {group} | " + " | ".join(counts) + " |")
        for name in names:
            lines.append(
                f"| &nbsp; {name} | "
                + " | ".join("pass" if results[s][group][name][0] else "fail" for s in servers)
                + " |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--chat-template", type=Path, default=None, help="served instead of the file's own")
    ap.add_argument(
        "--as-stored",
        action="store_true",
        help="servelm serves the file's template as stored (--chat-template-as-stored), not as corrected",
    )
    ap.add_argument("--servers", nargs="+", default=["servelm", "llama"], choices=["servelm", "llama"])
    ap.add_argument("--llama-server", type=Path, default=LLAMA)
    ap.add_argument("--json", type=Path, default=Path("/tmp/bench_agents.json"))
    args = ap.parse_args()
    results: dict[str, dict[str, dict[str, Check]]] = {}
    for kind in args.servers:
        name = "servelm" if kind == "servelm" else "llama-server"
        print(
            f"== {name} on {args.model.name}, chat template {args.chat_template or ('of the file' + (' as stored' if args.as_stored else ''))}",
            flush=True,
        )
        proc = serve(
            kind,
            args.model,
            args.chat_template,
            args.llama_server,
            args.json.with_suffix(f".{kind}.log"),
            args.as_stored,
        )
        try:
            started = time.monotonic()
            results[name] = run_checks(f"http://127.0.0.1:{PORT}")
            print(f"   {time.monotonic() - started:.0f} s", flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    args.json.write_text(json.dumps(results, indent=1, default=str))
    print(table(results))


if __name__ == "__main__":
    main()
