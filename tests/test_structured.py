"""Structured outputs (chapter 10): every constrained answer that stops parses and validates; speculation and the
prefix cache do not change greedy answers; the server maps response_format / structured_outputs, refuses bad ones
with clear 400s and keeps serving; the real openai SDK against a real server on 127.0.0.1. One bundled SmolLM2-135M
serves every test (in-process engine, uvicorn in a thread)."""
import json, re

import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from pydantic import BaseModel, Field

from mini_infer import LLM
from mini_infer.engine.sampling import InvalidRequest, SamplingParams
from mini_infer.serve.server import ServerThread, build_app
from mini_infer.course.grammars import SCHEMA_SUITE
from mini_infer.plugins.structured import GrammarMasks, StructuredOutputsParams as SO

ASK = [{"role": "user", "content": "Reply with a JSON object for a fictional person: name and age."}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_memory_gb=0.25)


@pytest.fixture(scope="module")
def client(llm):
    srv = ServerThread(build_app(llm, model_name="smollm2"))
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    srv.stop()


def validates(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False


def suite_answers(llm, temperature=0.0, n_tokens=120):
    prompts = [[{"role": "user", "content": p + " Reply in JSON."}] for p, _ in SCHEMA_SUITE]
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=n_tokens, structured_outputs=SO(json=s))
              for i, (_, s) in enumerate(SCHEMA_SUITE)]
    return llm.chat(prompts, params)


# ---- the engine ----

def test_suite_answers_that_stop_validate(llm):
    for temperature in (0.0, 1.0):
        outs = suite_answers(llm, temperature)
        stopped = [(o, s) for o, (_, s) in zip(outs, SCHEMA_SUITE) if o.finish_reason == "stop"]
        bad = [o.text for o, s in stopped if not validates(o.text, s)]
        assert not bad, bad
        assert len(stopped) >= 0.9 * len(SCHEMA_SUITE), f"only {len(stopped)} of {len(SCHEMA_SUITE)} stopped"
    assert llm.engine.scheduler.constraints.rejected == 0


def test_mutation_without_masks_answers_break(llm, monkeypatch):
    "The mask is what makes the suite valid: with it removed, answers break and the matchers refuse tokens."
    monkeypatch.setattr(GrammarMasks, "__call__", lambda self, logits: logits)
    constraints = llm.engine.scheduler.constraints
    before = constraints.rejected
    outs = suite_answers(llm, 1.0, 40)
    invalid = sum(not validates(o.text, s) for o, (_, s) in zip(outs, SCHEMA_SUITE))
    assert invalid >= len(SCHEMA_SUITE) // 2 and constraints.rejected > before


_leaf = st.one_of(
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-1000, 1000), st.integers(0, 1000)),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 16)),
    st.just({"type": "boolean"}),
    st.lists(st.sampled_from(["red", "green", "blue", "cat", "dog", "x"]), min_size=1, max_size=4, unique=True)
      .map(lambda e: {"enum": e}),
)


def _obj(children):
    names = st.lists(st.sampled_from(["a", "b", "id", "name", "value", "items"]), min_size=1, max_size=3, unique=True)
    return names.flatmap(lambda ks: st.tuples(st.just(ks), st.lists(children, min_size=len(ks), max_size=len(ks)),
                                              st.integers(0, len(ks)))).map(
        lambda t: {"type": "object", "properties": dict(zip(t[0], t[1])), "required": list(t[0][:t[2]]),
                   "additionalProperties": False})


_schemas = st.recursive(_leaf, lambda c: st.one_of(
    _obj(c), st.builds(lambda it, n: {"type": "array", "items": it, "maxItems": n}, c, st.integers(1, 3))), max_leaves=6)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=_obj(_schemas), seed=st.integers(0, 2**16))
def test_random_schemas_validate(llm, schema, seed):
    out = llm.chat([ASK], SamplingParams(temperature=1.0, seed=seed, max_tokens=80, structured_outputs=SO(json=schema)))[0]
    if out.finish_reason == "stop":
        assert validates(out.text, schema), (schema, out.text)


def test_kinds_regex_choice_grammar_json_object(llm):
    kinds = [SO(regex=r"[A-Z][a-z]+ \d{4}"), SO(choice=["alpha", "beta", "gamma"]),
             SO(grammar='root ::= ("yes" | "no") "!"'), SO(json_object=True)]
    outs = llm.chat([ASK] * 4, [SamplingParams(temperature=1.0, seed=3, max_tokens=40, structured_outputs=k) for k in kinds])
    assert re.fullmatch(r"[A-Z][a-z]+ \d{4}", outs[0].text)
    assert outs[1].text in ("alpha", "beta", "gamma")
    assert outs[2].text in ("yes!", "no!")
    assert isinstance(json.loads(outs[3].text), dict)


def test_params_checked():
    with pytest.raises(InvalidRequest, match="exactly one"):
        SO(json=PERSON, regex="a")
    with pytest.raises(InvalidRequest, match="exactly one"):
        SO()
    with pytest.raises(InvalidRequest, match="choice"):
        SO(choice=[])


def test_bad_schema_is_invalid_request_and_engine_keeps_going(llm):
    with pytest.raises(InvalidRequest, match="invalid json") as e:
        llm.engine.add_request("hi", SamplingParams(structured_outputs=SO(json={"type": "strnig"})))
    assert e.value.param == "structured_outputs.json"
    with pytest.raises(InvalidRequest, match="invalid regex"):
        llm.engine.add_request("hi", SamplingParams(structured_outputs=SO(regex="(unclosed")))
    assert not llm.engine.has_unfinished()
    assert validates(llm.chat([ASK], SamplingParams(temperature=0, max_tokens=60, structured_outputs=SO(json=PERSON)))[0].text, PERSON)


def test_compiled_once_per_schema(llm):
    counters = llm.engine.scheduler.constraints.compiler.counters
    schema = {"type": "object", "properties": {"z": {"type": "integer"}}, "required": ["z"]}
    before = dict(counters)
    llm.chat([ASK] * 3, SamplingParams(temperature=0, max_tokens=20, structured_outputs=SO(json=schema)))
    assert counters["compiled"] == before["compiled"] + 1 and counters["cache_hits"] == before["cache_hits"] + 2


def test_speculative_with_grammar_equals_plain_greedy(llm):
    spec = LLM(kv_cache_memory_gb=0.25, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    schema = {"type": "object", "properties": {"people": {"type": "array", "maxItems": 4, "items": PERSON}},
              "required": ["people"]}
    ask = [{"role": "user", "content": "List four fictional people as JSON with name and age."}]
    params = SamplingParams(temperature=0, max_tokens=100, structured_outputs=SO(json=schema))
    plain, guessed = llm.chat([ask] * 3, params), spec.chat([ask] * 3, params)
    assert [o.token_ids for o in guessed] == [o.token_ids for o in plain]
    stats = spec.engine.stats()
    assert stats["spec_decode_num_draft_tokens_total"] > 0 and stats["spec_decode_num_accepted_tokens_total"] > 0
    assert spec.engine.scheduler.constraints.rejected == 0


def test_prefix_cache_unaffected(llm):
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=SO(json=PERSON))
    first = llm.chat([ASK], params)[0]
    second = llm.chat([ASK], params)[0]
    assert second.token_ids == first.token_ids and second.num_cached_tokens > 0


# ---- the server ----

FMT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}


def test_response_format_streamed_equals_whole(client):
    whole = client.chat.completions.create(model="smollm2", messages=ASK, response_format=FMT, temperature=0, max_tokens=60)
    chunks = list(client.chat.completions.create(model="smollm2", messages=ASK, response_format=FMT, temperature=0,
                                                 max_tokens=60, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert validates(whole.choices[0].message.content, PERSON) and streamed == whole.choices[0].message.content
    obj = client.chat.completions.create(model="smollm2", messages=ASK, response_format={"type": "json_object"},
                                         temperature=0, max_tokens=60)
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_sdk_parse_with_pydantic(client):
    class Person(BaseModel):
        name: str = Field(max_length=20)
        age: int = Field(ge=0, le=120)

    out = client.chat.completions.parse(model="smollm2", messages=ASK, response_format=Person, temperature=0.7,
                                        seed=1, max_tokens=60)
    assert isinstance(out.choices[0].message.parsed, Person)


def test_extra_body_structured_outputs(client):
    out = client.chat.completions.create(model="smollm2", messages=ASK, temperature=0, max_tokens=10,
                                         extra_body={"structured_outputs": {"choice": ["red", "blue"]}})
    assert out.choices[0].message.content in ("red", "blue")
    text = client.completions.create(model="smollm2", prompt="The year was", max_tokens=10, temperature=0,
                                     extra_body={"structured_outputs": {"regex": r" \d{4}\."}})
    assert re.fullmatch(r" \d{4}\.", text.choices[0].text)


@pytest.mark.parametrize("kw, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}},
     ["invalid json", "strnig"]),
    ({"extra_body": {"guided_json": PERSON}}, ["guided_json", "structured_outputs"]),
    ({"extra_body": {"guided_choice": ["a"]}}, ["guided_choice", "structured_outputs"]),
    ({"response_format": {"type": "yaml"}}, ["response_format.type"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, ["schema"]),
    ({"extra_body": {"structured_outputs": {"jsn": {}}}}, ["structured_outputs takes"]),
    ({"extra_body": {"structured_outputs": {"json": PERSON, "regex": "a"}}}, ["exactly one"]),
    ({"response_format": {"type": "json_object"}, "extra_body": {"structured_outputs": {"regex": "a"}}}, ["only one of"]),
])
def test_bad_requests_are_400s_and_server_keeps_serving(client, kw, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=5, **kw)
    assert all(w in e.value.body["message"] for w in words), e.value.body
    assert client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=2).choices[0].finish_reason == "length"
