"""Real clients against the real server on 127.0.0.1 (issue 42): the OpenAI Agents SDK running a two-step
tool-using agent, over chat completions and over the Responses API, and LangChain's tool-calling agent. (The
openai SDK's streaming chat.completions with tools, checked chunk by chunk: tests/test_tool_calls.py.)
A 135M model rarely decides to call a tool by itself, so each agent asks for a call on its first turn
(`tool_choice="required"`, as a client may) and lets the model answer after the tool's result."""
import pytest
from openai import AsyncOpenAI

from mini_infer import LLM
from mini_infer.serve.server import ServerThread, build_app

ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def base_url():
    srv = ServerThread(build_app(LLM(kv_cache_memory_gb=0.25), model_name="smollm2"))
    yield srv.url + "/v1"
    srv.stop()


def get_weather(city: str) -> str:
    "The current weather of a city."
    CALLS.append(city)
    return f"18 degrees and cloudy in {city}"


CALLS: list[str] = []


@pytest.mark.parametrize("api", ["chat_completions", "responses"])
def test_openai_agents_sdk_two_step_agent(base_url, api):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)  # no traces sent anywhere
    client = AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0)
    model = (agents.OpenAIChatCompletionsModel if api == "chat_completions" else agents.OpenAIResponsesModel)(
        model="smollm2", openai_client=client)
    settings = agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=60)
    agent = agents.Agent(name="weather", instructions="Answer with the weather tool.", model=model,
                         tools=[agents.function_tool(get_weather)], model_settings=settings)
    CALLS.clear()
    result = agents.Runner.run_sync(agent, ASK, max_turns=4)
    kinds = [item.type for item in result.new_items]
    # the SDK lifts tool_choice after the call (reset_tool_choice), so the second turn answers
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"], kinds
    assert CALLS and CALLS[0] and isinstance(result.final_output, str) and result.final_output


def test_langchain_tool_calling_agent(base_url):
    pytest.importorskip("langchain")
    from langchain.agents import create_agent
    from langchain.agents.middleware import wrap_model_call
    from langchain_core.messages import AIMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @wrap_model_call
    def call_then_answer(request, handler):
        "The first turn must call a tool; once a result is in, the model answers."
        answered = any(isinstance(m, ToolMessage) for m in request.messages)
        return handler(request.override(tool_choice="none" if answered else "required"))

    model = ChatOpenAI(model="smollm2", base_url=base_url, api_key="none", temperature=0, max_tokens=60,
                       max_retries=0, model_kwargs={"parallel_tool_calls": False})
    agent = create_agent(model, tools=[tool(get_weather)], middleware=[call_then_answer])
    CALLS.clear()
    messages = agent.invoke({"messages": [{"role": "user", "content": ASK}]})["messages"]
    assert [type(m).__name__ for m in messages] == ["HumanMessage", "AIMessage", "ToolMessage", "AIMessage"]
    assert messages[1].tool_calls[0]["name"] == "get_weather" and CALLS
    assert isinstance(messages[-1], AIMessage) and messages[-1].content and not messages[-1].tool_calls
