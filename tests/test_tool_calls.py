"""Tool calls (chapter 10, issue 42): the parsers of each model family on outputs as those models write
them, read whole and streamed in any pieces (the deltas add up to the whole); the server streaming a call's
name once and its arguments in pieces through the real openai SDK; parallel calls; tools with a response
format. One bundled SmolLM2-135M serves the server tests (in-process engine, uvicorn on 127.0.0.1)."""
import json, random

import jsonschema
import openai
import pytest

from mini_infer import LLM
from mini_infer.plugins.tool_calls import ToolCalls, ToolCallStream
from mini_infer.plugins.tool_parsers import TOOL_PARSERS, get_tool_parser, parser_for_template
from mini_infer.serve.generation import merge_deltas
from mini_infer.serve.server import ServerThread, build_app

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "maxLength": 20}}, "required": ["tz"]}}}
Q = [{"role": "user", "content": "What is the weather in Paris?"}]
FUNCTIONS = {n: {} for n in ["get_weather", "get_time", "get_current_weather", "add", "multiply", "search",
                             "get_open_incidents"]}

# Answers as each family writes them (the formats of their chat templates; the last hermes one was recorded
# from SmolLM2-135M under the call grammar). (answer, content, [(name, arguments)]).
RECORDED = {
    "hermes": [  # Qwen2.5-Instruct, Hermes-2-Pro, SmolLM2 through the fallback prompt
        ('<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "San Francisco, CA", "unit": '
         '"fahrenheit"}}\n</tool_call>', None,
         [("get_current_weather", {"location": "San Francisco, CA", "unit": "fahrenheit"})]),
        ('I will look both up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
         '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n'
         '</tool_call>', "I will look both up.",
         [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"tz": "Europe/Paris"})]),
        ('<tool_call>\n{"arguments": {"a": 1, "b": 2}, "name": "add"}\n</tool_call>', None, [("add", {"a": 1, "b": 2})]),
        ('<tool_call>\n{"name": "send_email", "arguments": {}}\n</tool_call>',  # not one of the tools: text
         '<tool_call>\n{"name": "send_email", "arguments": {}}\n</tool_call>', []),
        ("The weather in Paris is mild.", "The weather in Paris is mild.", []),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>', None,
         [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ],
    "llama3_json": [  # Llama 3.1 / 3.2 / 3.3 Instruct (`<|python_tag|>` is a special token, often dropped)
        ('{"name": "get_current_weather", "parameters": {"location": "San Francisco, CA", "unit": "fahrenheit"}}',
         None, [("get_current_weather", {"location": "San Francisco, CA", "unit": "fahrenheit"})]),
        ('<|python_tag|>{"name": "search", "parameters": {"query": "mini-infer"}}', None,
         [("search", {"query": "mini-infer"})]),
        ('{"name": "search", "parameters": {"query": "a"}}; {"name": "get_open_incidents", "parameters": {}}', None,
         [("search", {"query": "a"}), ("get_open_incidents", {})]),
        ('{"name": "search", "parameters": {"query": "He said \\"hi {x}\\""}}', None,
         [("search", {"query": 'He said "hi {x}"'})]),
        ('{"name": "lookup", "parameters": {invalid json}', '{"name": "lookup", "parameters": {invalid json}', []),
        ("Paris is in France.", "Paris is in France.", []),
    ],
    "mistral": [  # Mistral-7B-Instruct-v0.3 (a JSON list) and tokenizers v11+ (name[ARGS]{...})
        ('[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", "format": '
         '"celsius"}}]', None, [("get_current_weather", {"location": "Paris, France", "format": "celsius"})]),
        ('[{"name": "add", "arguments": {"a": 3.5, "b": 4}}, {"name": "multiply", "arguments": {"a": 3, "b": 6}}]',
         None, [("add", {"a": 3.5, "b": 4}), ("multiply", {"a": 3, "b": 6})]),  # the special token dropped
        ('[TOOL_CALLS]add{"a": 3.5, "b": 4}[TOOL_CALLS]multiply{"a": 3, "b": 6}', None,
         [("add", {"a": 3.5, "b": 4}), ("multiply", {"a": 3, "b": 6})]),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}', None,
         [("get_weather", {"city": "Paris", "unit": "celsius"})]),
        ('Let me add them.[TOOL_CALLS] [{"arguments": {"a": 1, "b": 2}, "name": "add"}]', "Let me add them.",
         [("add", {"a": 1, "b": 2})]),
        ("[1, 2, 3]", "[1, 2, 3]", []),
    ],
}
CASES = [(name, *case) for name, cases in RECORDED.items() for case in cases]


def streamed(parser, text: str, rng: random.Random) -> list[dict]:
    "The deltas of `text` fed in random pieces of 1 to 8 characters."
    stream, deltas, i = ToolCallStream(parser), [], 0
    while i < len(text):
        j = min(len(text), i + rng.randint(1, 8))
        deltas += stream.feed(text[i:j], final=j == len(text))
        i = j
    return deltas


def calls_of(message: dict) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls", [])]


@pytest.mark.parametrize("name, text, content, calls", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_parsers_read_recorded_answers_whole_and_streamed(name, text, content, calls):
    parser = get_tool_parser(name)(FUNCTIONS)
    whole = merge_deltas(ToolCallStream(parser).feed(text, final=True))
    assert whole["content"] == content and calls_of(whole) == calls
    for seed in range(25):  # any split of the answer gives the same message
        deltas = streamed(parser, text, random.Random(seed))
        assert merge_deltas(deltas) | {"tool_calls": None} == whole | {"tool_calls": None}
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in merge_deltas(deltas).get("tool_calls", [])] \
            == [(c["function"]["name"], c["function"]["arguments"]) for c in whole.get("tool_calls", [])]
        names = [tc for d in deltas for tc in d.get("tool_calls", []) if "name" in tc["function"]]
        assert [tc["index"] for tc in names] == list(range(len(calls)))  # each name once, in order


def test_a_cut_call_is_still_a_call():
    "Its name was streamed as soon as it was written: an answer cut at max_tokens keeps it, arguments cut."
    parser = get_tool_parser("llama3_json")(FUNCTIONS)
    message = merge_deltas(ToolCallStream(parser).feed('{"name": "search", "parameters": {"query": "mi', final=True))
    assert message["content"] is None and message["tool_calls"][0]["function"] == \
        {"name": "search", "arguments": '{"query": "mi'}


def test_streamed_arguments_arrive_in_pieces():
    parser = get_tool_parser("hermes")(FUNCTIONS)
    text = RECORDED["hermes"][0][0]
    deltas = streamed(parser, text, random.Random(0))
    pieces = [tc["function"]["arguments"] for d in deltas for tc in d.get("tool_calls", [])
              if "name" not in tc["function"]]
    assert len(pieces) > 5 and "".join(pieces) == '{"location": "San Francisco, CA", "unit": "fahrenheit"}'


def test_content_streams_until_a_call_opens():
    parser = get_tool_parser("hermes")(FUNCTIONS)
    stream = ToolCallStream(parser)
    assert stream.feed("I will look") == [{"content": "I will look"}]
    assert stream.feed(" it up. <tool") == [{"content": " it up."}]  # a tag may be opening: held back
    assert stream.feed('_call>\n{"name": "get_weather", "arguments": {"ci')[0]["tool_calls"][0]["function"] == \
        {"name": "get_weather", "arguments": ""}


def test_parser_chosen_by_the_chat_template():
    assert parser_for_template("{% for m in messages %}{{ m.content }}{% endfor %}") == "hermes"
    assert parser_for_template("{{- '<|python_tag|>' }}{% if tools %}") == "llama3_json"
    assert parser_for_template("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert set(TOOL_PARSERS) >= {"hermes", "llama3_json", "mistral"}
    with pytest.raises(ValueError, match="choose from auto, hermes"):
        get_tool_parser("nope")


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral"])
def test_each_family_writes_what_it_reads(name):
    "A call written by the family (templates without tools, the grammar's shape) is read back."
    parser = get_tool_parser(name)(FUNCTIONS)
    text = parser.write("get_weather", '{"city": "Oslo", "unit": "celsius"}')
    assert calls_of(merge_deltas(ToolCallStream(parser).feed(text, final=True))) == \
        [("get_weather", {"city": "Oslo", "unit": "celsius"})]


def test_finish_reason_of_calls():
    """'tool_calls' when the model chose to call ('auto', 'required'); a function named by tool_choice finishes with
    'stop', as OpenAI's API and vLLM answer; an answer cut at max_tokens stays 'length'."""
    from mini_infer.serve.generation import final_reason
    text = get_tool_parser("hermes")(FUNCTIONS).write("get_weather", '{"city": "Oslo", "unit": "celsius"}')
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, want in [("auto", "tool_calls"), ("required", "tool_calls"), (named, "stop")]:
        stream = ToolCalls(None, [WEATHER], choice).stream()
        stream.feed(text, final=True)
        assert stream.called and final_reason("stop", stream.finishes_with_calls) == want, choice
        assert final_reason("length", stream.finishes_with_calls) == "length"
    answer = ToolCalls(None, [WEATHER], "auto").stream()
    answer.feed("It is sunny.", final=True)
    assert final_reason("stop", answer.finishes_with_calls) == "stop"


# ---- the server ----



@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_memory_gb=0.25)


@pytest.fixture(scope="module")
def client(llm):
    srv = ServerThread(build_app(llm, model_name="smollm2"))
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    srv.stop()


def _validates(call, tools=(WEATHER, TIME)):
    fn = {t["function"]["name"]: t["function"] for t in tools}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), fn["parameters"])


def test_sdk_stream_chunk_by_chunk(client):
    "Content streams until the call opens, then the call's id and name once, its arguments in pieces."
    said = r'Let me check that for you\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris", ' \
           r'"unit": "celsius"\}\}\n</tool_call>'
    say = {"role": "system", "content": "Before calling a function, say: Let me check that for you."}
    kw = dict(model="smollm2", messages=[say] + Q, tools=[WEATHER], temperature=0, max_tokens=80,
              extra_body={"structured_outputs": {"regex": said}})  # a call, or this text (which holds one)
    chunks = [c for c in client.chat.completions.create(**kw, stream=True)]
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [c.choices[0].delta for c in chunks[1:-1]]
    first_call = next(i for i, d in enumerate(deltas) if d.tool_calls)
    content = [d.content for d in deltas[:first_call]]
    assert len(content) > 3 and "".join(content) == "Let me check that for you."
    assert all(not d.content for d in deltas[first_call:])
    calls = [tc for d in deltas[first_call:] for tc in d.tool_calls]
    head, rest = calls[0], calls[1:]
    assert head.index == 0 and head.id.startswith("call_") and head.type == "function"
    assert head.function.name == "get_weather" and head.function.arguments == ""
    assert len(rest) > 3 and all(tc.function.name is None and tc.id is None for tc in rest)
    assert "".join(tc.function.arguments for tc in rest) == '{"city": "Paris", "unit": "celsius"}'
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Let me check that for you."
    assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls] == \
        [("get_weather", '{"city": "Paris", "unit": "celsius"}')]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_streamed_calls_equal_whole(client, choice):
    kw = dict(model="smollm2", messages=Q, tools=[WEATHER, TIME], tool_choice=choice, temperature=0, max_tokens=60,
              parallel_tool_calls=False)
    whole = client.chat.completions.create(**kw).choices[0]
    chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    merged = merge_deltas([c.choices[0].delta.model_dump(exclude_none=True) for c in chunks[1:]])
    named = isinstance(choice, dict)  # a function named by tool_choice finishes with "stop", as OpenAI's does
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason == ("stop" if named else "tool_calls")
    assert merged["content"] == whole.message.content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in merged["tool_calls"]] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    _validates(whole.message.tool_calls[0])


def test_parallel_tool_calls(client):
    ask = [{"role": "user", "content": "What is the weather in Paris and the time in Tokyo?"}]
    kw = dict(model="smollm2", messages=ask, tools=[WEATHER, TIME], tool_choice="required", temperature=0,
              max_tokens=120)
    several = client.chat.completions.create(**kw).choices[0]
    calls = several.message.tool_calls
    assert len(calls) >= 2 and len({c.id for c in calls}) == len(calls)
    for c in calls[:-1] if several.finish_reason == "length" else calls:  # a cut answer: its last call is cut
        _validates(c)
    stream = [tc for c in client.chat.completions.create(**kw, stream=True) if c.choices
              for tc in c.choices[0].delta.tool_calls or [] if tc.id]
    assert [tc.index for tc in stream] == list(range(len(calls)))
    one = client.chat.completions.create(**kw, parallel_tool_calls=False).choices[0]
    assert one.finish_reason == "tool_calls" and len(one.message.tool_calls) == 1
    _validates(one.message.tool_calls[0])


def test_tools_with_response_format(client, llm):
    "A call or an answer in the schema: both are what the grammar allows, nothing else is."
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 40}},
              "required": ["answer"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}}
    kinds = set()
    for ask in (Q, [{"role": "user", "content": "What is two plus two? Reply in JSON."}]):
        out = client.chat.completions.create(model="smollm2", messages=ask, tools=[WEATHER], response_format=fmt,
                                             parallel_tool_calls=False, temperature=0, max_tokens=60).choices[0]
        if out.message.tool_calls:
            assert out.finish_reason == "tool_calls" and out.message.content is None
            _validates(out.message.tool_calls[0])
        else:
            assert out.finish_reason == "stop"
            jsonschema.validate(json.loads(out.message.content), schema)
        kinds.add(bool(out.message.tool_calls))
    print("answered with", kinds)
    forced = client.chat.completions.create(model="smollm2", messages=Q, tools=[WEATHER], response_format=fmt,
                                            tool_choice="required", parallel_tool_calls=False,
                                            temperature=0, max_tokens=60).choices[0]
    assert forced.finish_reason == "tool_calls"
    _validates(forced.message.tool_calls[0])
    # the grammar itself: a call, or an answer in the schema, and nothing else
    from mini_infer.plugins.grammars import StructuredOutputsParams
    tools = ToolCalls(llm.tokenizer, [WEATHER], "auto")
    compiler = llm.engine.scheduler.constraints.compiler
    grammar = compiler(tools.structured_outputs(StructuredOutputsParams(json=schema)))
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>'
    for text, ok in [(call, True), ('{"answer": "It is sunny."}', True), ("It is sunny.", False),
                     ('{"answer": 5}', False), (call.replace("get_weather", "get_time"), False)]:
        m = compiler.xgr.GrammarMatcher(grammar)
        assert (m.accept_string(text) and m.is_completed()) == ok, text


# ---- the protocol: checked, rendered, the next turn ----

@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_required_and_named_calls_validate(client, choice):
    "Sampled, and each call valid: one call to an allowed function, its arguments in its schema."
    for seed in range(3):
        out = client.chat.completions.create(model="smollm2", messages=Q, tools=[WEATHER, TIME], tool_choice=choice,
                                             temperature=1.0, seed=seed, max_tokens=60, parallel_tool_calls=False)
        assert out.choices[0].finish_reason == ("stop" if isinstance(choice, dict) else "tool_calls")
        (call,) = out.choices[0].message.tool_calls
        fn = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]
        if isinstance(choice, dict):
            assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), fn["parameters"])


def test_tool_result_turn_and_none(client):
    first = client.chat.completions.create(model="smollm2", messages=Q, tools=[WEATHER], tool_choice="required",
                                           parallel_tool_calls=False, temperature=0, max_tokens=60).choices[0].message
    call = first.tool_calls[0]
    turn2 = Q + [first.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 18}'}]
    out = client.chat.completions.create(model="smollm2", messages=turn2, tools=[WEATHER], tool_choice="none",
                                         temperature=0, max_tokens=20).choices[0]
    assert out.finish_reason in ("stop", "length") and not out.message.tool_calls and out.message.content


def test_auto_parses_tool_call_tags():
    tools = ToolCalls(None, [WEATHER], "auto")
    content, calls = tools.parse('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>')
    assert content == "Let me check." and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "unit": "celsius"}
    assert tools.parse('<tool_call>{"name": "unknown", "arguments": {}}</tool_call>')[1] == []  # not a known tool
    assert tools.parse("It is sunny.") == ("It is sunny.", [])
    assert ToolCalls(None, [WEATHER], "none").parse('<tool_call>{"name": "get_weather"}</tool_call>')[1] == []


def test_tools_rendered_by_template_or_fallback(llm):
    from mini_infer.model.tokenizer import Tokenizer
    msgs = Q + [{"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                {"role": "tool", "content": "18C"}]
    fallback = llm.tokenizer.decode(ToolCalls(llm.tokenizer, [WEATHER]).prompt_ids(msgs), skip_special_tokens=False)
    assert "<tools>" in fallback and '"name": "get_weather"' in fallback and "<tool_response>\n18C" in fallback
    template = ("{% for t in tools or [] %}TOOL {{ t.function.name }}\n{% endfor %}{% for m in messages %}"
                "{{ m.role }}: {{ m.content }}{% for c in m.tool_calls or [] %}CALL {{ c.function.arguments.city }}{% endfor %}\n{% endfor %}")
    tok = Tokenizer(llm.tokenizer.tok, template, eos_token="<|im_end|>")
    text = tok.decode(ToolCalls(tok, [WEATHER]).prompt_ids(msgs))
    assert "TOOL get_weather" in text and "CALL Paris" in text and "<tools>" not in text  # arguments as a dict
    assert "TOOL" not in tok.decode(ToolCalls(tok, [WEATHER], "none").prompt_ids(msgs))


@pytest.mark.parametrize("kw, words", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, ["nope", "not in tools"]),
    ({"tools": [{"type": "web_search"}]}, ["tools[0]"]),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strnig"}}}]}, ["not a valid JSON schema"]),
    ({"tool_choice": "always"}, ["tool_choice must be"]),
])
def test_bad_tools_are_400s(client, kw, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2", messages=Q, max_tokens=5, **{"tools": [WEATHER], **kw})
    assert all(w in e.value.body["message"] for w in words), e.value.body


# ---- LangChain ----

def test_langchain_with_structured_output_and_bind_tools(client):
    langchain_openai = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel, Field
    ASK = "Reply with a JSON object for a fictional person: name and age."

    class Person(BaseModel):
        name: str = Field(max_length=20)
        age: int = Field(ge=0, le=120)

    chat = langchain_openai.ChatOpenAI(model="smollm2", base_url=str(client.base_url), api_key="none",
                                       temperature=0, max_tokens=60, max_retries=0)
    person = chat.with_structured_output(Person, method="json_schema").invoke(ASK)
    assert isinstance(person, Person)
    msg = chat.bind_tools([WEATHER], tool_choice="get_weather", parallel_tool_calls=False).invoke(Q[0]["content"])
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
    jsonschema.validate(msg.tool_calls[0]["args"], WEATHER["function"]["parameters"])
