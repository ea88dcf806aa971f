"""OpenAI's Responses API (`/v1/responses`, issue 42) through the openai SDK's `client.responses` against a real
server on 127.0.0.1: text and its streamed events, instructions, function tools with a round trip, `text.format`
json_schema, an answer cut at max_output_tokens, and clear 400s. Oracle: the same request as a chat completion."""
import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from mini_infer import LLM
from mini_infer.serve.server import ServerThread, build_app

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"]}}
ASK = "What is the capital of France?"
SYSTEM = "You answer in one short sentence."


@pytest.fixture(scope="module")
def client():
    srv = ServerThread(build_app(LLM(kv_cache_memory_gb=0.25), model_name="smollm2"))
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    srv.stop()


def test_text_and_instructions_match_chat(client):
    r = client.responses.create(model="smollm2", input=ASK, instructions=SYSTEM, max_output_tokens=30, temperature=0)
    chat = client.chat.completions.create(model="smollm2", max_tokens=30, temperature=0, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}])
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "completed"
    assert r.output_text == chat.choices[0].message.content and r.output[0].type == "message"
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    bare = client.responses.create(model="smollm2", input=ASK, max_output_tokens=30, temperature=0)
    assert bare.usage.input_tokens != r.usage.input_tokens  # the instructions replaced the default system turn


def test_stream_events(client):
    kw = dict(model="smollm2", input=[{"role": "user", "content": [{"type": "input_text", "text": ASK}]}],
              max_output_tokens=30, temperature=0)
    events = list(client.responses.create(**kw, stream=True))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    whole = client.responses.create(**kw)
    assert len(deltas) > 3 and "".join(deltas) == whole.output_text == events[-1].response.output_text


def test_function_tool_round_trip(client):
    kw = dict(model="smollm2", tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, temperature=0,
              max_output_tokens=60)
    first = client.responses.create(input="What is the weather in Paris?", **kw)
    (call,) = [o for o in first.output if o.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and first.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    events = list(client.responses.create(input="What is the weather in Paris?", stream=True, **kw))
    added = [e.item for e in events if e.type == "response.output_item.added"]
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert [i.type for i in added] == ["function_call"] and added[0].name == "get_weather"
    assert len(pieces) > 3 and "".join(pieces) == call.arguments
    turn2 = ["What is the weather in Paris?", call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": '{"celsius": 18, "sky": "cloudy"}'}]
    turn2[0] = {"role": "user", "content": turn2[0]}
    second = client.responses.create(model="smollm2", input=turn2, tools=[WEATHER], tool_choice="none",
                                     temperature=0, max_output_tokens=30)
    assert second.output_text and not [o for o in second.output if o.type == "function_call"]


def test_text_format_json_schema(client):
    class Person(BaseModel):
        name: str = Field(max_length=20)
        age: int = Field(ge=0, le=120)

    ask = "Reply with a JSON object for a fictional person: name and age."
    parsed = client.responses.parse(model="smollm2", input=ask, text_format=Person, temperature=0,
                                    max_output_tokens=60)
    assert isinstance(parsed.output_parsed, Person)
    schema = Person.model_json_schema()
    raw = client.responses.create(model="smollm2", input=ask, temperature=0.7, max_output_tokens=60,
                                  text={"format": {"type": "json_schema", "name": "person", "schema": schema}})
    jsonschema.validate(json.loads(raw.output_text), schema)


def test_cut_at_max_output_tokens(client):
    r = client.responses.create(model="smollm2", input="Tell me a long story.", max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5


@pytest.mark.parametrize("kw, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input[0].content[0]"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": [{"type": "computer_call"}]}, "input[0]"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
])
def test_bad_requests_are_400s(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**{"model": "smollm2", "input": ASK, **kw})
    assert e.value.body["param"] == param, e.value.body
    assert client.responses.create(model="smollm2", input=ASK, max_output_tokens=2).status == "incomplete"
