"""Qwen3 and Llama 3.2 (issue 48) against transformers, with random weights of the real 0.6B's and 1B's layer
shapes (2 layers, a 4096-token vocabulary): every layer's output and the logits of a folder `save_pretrained`
wrote, loaded as `LLM(path)` loads it; the whole engine's greedy tokens on 8 prompts against `generate`, in a
batch of 16 with prefix caching and n-gram speculation, and one request at a time in plain PyTorch."""
import json
import pytest
import torch
transformers = pytest.importorskip("transformers")
from mini_infer import LLM, SamplingParams
from mini_infer.model.families import QKNormAttention, Qwen3Config
from mini_infer.model.loader import load_safetensors
from mini_infer.model.model import Attention, ContiguousKVCache, ContiguousStep, ModelConfig, rope_frequencies

VOCAB = 4096
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
FAMILIES = {  # the real configs (Qwen/Qwen3-0.6B, meta-llama/Llama-3.2-1B), layers and vocabulary reduced
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(
        hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=40960, tie_word_embeddings=True,
        attention_bias=False)),
    "llama3.2": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=True,
        rope_scaling=LLAMA3_ROPE)),
}


# each family's special tokens (ids 0.. in this order), its BOS and its turn-ending tokens (generation_config's)
SPECIALS = {
    "qwen3": (["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"],
              None, ["<|im_end|>", "<|endoftext|>"]),
    "llama3.2": (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                  "<|eom_id|>", "<|python_tag|>"], "<|begin_of_text|>", ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]),
}


def write_tokenizer(family: str, folder):
    "A small byte-level BPE with the family's special tokens, as the family's tokenizer files spell them."
    from tokenizers import Tokenizer as HFTok, decoders, models, pre_tokenizers, trainers
    specials, bos, eos = SPECIALS[family]
    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["What is the weather in Oslo today? The capital of France is Paris.", '{"name": "get_weather", '
              '"arguments": {"city": "Oslo"}}', "You may call one or more functions to assist with the user query."]
    tok.train_from_iterator(corpus * 20, trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": bos, "eos_token": eos[0]}))
    return [specials.index(t) for t in eos]


def tiny_hf(family: str, scale: float = 2.0):
    "Random weights in the family's real layer shape, two layers, scaled up for decisive argmaxes."
    cfg_cls, model_cls, kw = FAMILIES[family]
    specials, bos, eos = SPECIALS[family]
    torch.manual_seed(0)
    hf = model_cls(cfg_cls(vocab_size=VOCAB, num_hidden_layers=2, bos_token_id=bos and specials.index(bos),
                           eos_token_id=[specials.index(t) for t in eos], **kw)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(scale)
    return hf


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
    "A folder as `save_pretrained` writes it, with the family's tokenizer files; and transformers' model."
    out = tmp_path_factory.mktemp(request.param)
    hf = tiny_hf(request.param)
    hf.save_pretrained(out)
    write_tokenizer(request.param, out)
    return request.param, out, hf


def test_config_and_layers_match_transformers(checkpoint):
    family, folder, hf = checkpoint
    model = load_safetensors(folder, "cpu", torch.float32, max_positions=256)
    cfg = model.config
    if family == "qwen3":
        assert isinstance(cfg, Qwen3Config) and cfg.head_dim == 128 != cfg.hidden_size // cfg.num_attention_heads
        assert all(isinstance(layer.self_attn, QKNormAttention) for layer in model.model.layers)
        assert model.model.layers[0].self_attn.qkv_proj.bias is None      # no q/k/v bias
    else:
        assert type(cfg) is ModelConfig and cfg.rope_scaling["rope_type"] == "llama3"
        assert type(model.model.layers[0].self_attn) is Attention
        scaled, plain = rope_frequencies(cfg), 1 / 500000.0 ** (torch.arange(0, 64, 2) / 64)
        assert torch.allclose(scaled, hf.model.rotary_emb.inv_freq, rtol=1e-6)
        assert (scaled[-4:] / plain[-4:]).sub(1 / 32).abs().max() < 1e-6     # the slowest divided by `factor`
    assert cfg.tie_word_embeddings and model.model.embed_tokens is None  # one table
    outs = []
    hooks = [layer.register_forward_hook(lambda m, a, o: outs.append(o.clone())) for layer in model.model.layers]
    ids = torch.randint(0, VOCAB, (29,), generator=torch.Generator().manual_seed(1))
    cache = ContiguousKVCache(cfg, 64)
    logits = torch.cat([model(ContiguousStep.tokens(ids[:11], 0, False), cache),
                        model(ContiguousStep.tokens(ids[11:], 11, False), cache)])
    for h in hooks:
        h.remove()
    with torch.no_grad():
        ref = hf(ids[None], output_hidden_states=True)
    scale = ref.logits.abs().max().item()
    assert scale > 1                                    # not a model whose outputs are all near zero
    assert (logits - ref.logits[0]).abs().max().item() <= 1e-5 * scale
    want = ref.hidden_states[1][0]                      # the first layer's output (the last is after the norm)
    got = torch.cat([outs[0], outs[2]])
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


# prompts that share a 20-token prefix (the prefix cache), and some that repeat themselves
PROMPTS = ([[(7 * i + 3 * j) % 4000 + 5 for j in range(n)] for i, n in enumerate((5, 17, 30, 9))]
           + [[(11 * j) % 4000 + 7 for j in range(20)] + [100 + i] * (2 * i + 1) for i in range(4)])
N = 12


def hf_greedy(hf, prompts, n: int) -> list[list[int]]:
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, len(p):]
                .tolist() for p in prompts]


def test_engine_greedy_equals_transformers(checkpoint):
    "16 requests (each prompt twice) in one batch, prefix caching, n-gram speculation; then one at a time."
    family, folder, hf = checkpoint
    # two more prompts that repeat the model's own words: a prompt, its greedy continuation, the prompt again
    echo = [p + g + p for p, g in zip(PROMPTS[:2], hf_greedy(hf, PROMPTS[:2], 16))]
    prompts = PROMPTS[2:] + echo
    want = hf_greedy(hf, prompts, N)
    params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    spec = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, disable_by_batch_size=None)
    with LLM(str(folder), device="cpu", dtype=torch.float32, block_size=4, max_num_seqs=16, max_model_len=128,
             enable_prefix_caching=True, speculative_config=spec, prefill_dtype="float32") as llm:
        outs = llm.generate(prompts + prompts, params)
        assert [o.token_ids for o in outs] == want + want
        assert sum(o.num_cached_tokens for o in outs) >= 8 * 4     # prompts' blocks came from the cache
        st = llm.engine.stats()
        # guesses were verified and, random weights rarely repeating themselves, rolled back: the tokens held
        assert st["spec_decode_num_draft_tokens_total"] > 0
    with LLM(str(folder), device="cpu", dtype=torch.float32, block_size=4, max_num_seqs=1, max_model_len=128,
             enable_prefix_caching=False, backend="torch") as llm:
        assert [o.token_ids for o in llm.generate(prompts, params)] == want


# ---- served: each family's chat template (excerpts of the real ones: the parts that matter here), its arguments,
# and the tool-call parser the template asks for ----

QWEN3_TEMPLATE = (  # Qwen3's: tools in <tools></tools>, calls as hermes <tool_call> JSON; `enable_thinking`
    "{%- if tools %}<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the user query."
    "\n\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\nFor each function call, return "
    "a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n{%- endif %}'
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}{%- endif %}")
LLAMA32_TEMPLATE = (  # Llama 3.2's: JSON calls with "parameters", <|python_tag|>, turns ended by <|eot_id|>
    "{{- bos_token }}{%- if tools %}<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, "
    "please respond with a JSON for a function call with its proper arguments that best answers the given prompt."
    '\n\nRespond in the format {"name": function name, "parameters": dictionary of argument name and its value}.'
    "{% for t in tools %}\n\n{{ t | tojson }}{% endfor %}<|eot_id|>{%- endif %}"
    "{%- for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{%- endfor %}{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}")
TEMPLATES = {"qwen3": (QWEN3_TEMPLATE, "hermes"), "llama3.2": (LLAMA32_TEMPLATE, "llama3_json")}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Oslo", "Paris"]}}, "required": ["city"],
    "additionalProperties": False}}}


def test_served_with_its_template_and_tool_parser(checkpoint):
    "The template's arguments (`enable_thinking`) reach it; a required call is read by the family's parser."
    from openai import OpenAI
    from mini_infer.plugins.tool_parsers import parser_for_template
    from mini_infer.serve.server import ServerThread, build_app
    family, folder, _ = checkpoint
    template, parser = TEMPLATES[family]
    assert parser_for_template(template) == parser
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": template}))
    with LLM(str(folder), device="cpu", dtype=torch.float32, block_size=4, max_model_len=512) as llm:
        assert llm.tokenizer.chat_template == template
        stops = [llm.tokenizer.token_to_id(t) for t in SPECIALS[family][2]]
        assert set(stops) <= set(llm.tokenizer.eos_token_ids)          # every turn-ending token stops
        srv = ServerThread(build_app(llm, family))
        try:
            c = OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
            msgs = [{"role": "user", "content": "Weather in Oslo?"}]
            ask = lambda **kw: c.chat.completions.create(model=family, messages=msgs, max_tokens=1, extra_body={
                "return_token_ids": True, **kw}).model_extra["prompt_token_ids"]
            text = lambda ids: llm.tokenizer.decode(ids, skip_special_tokens=False)
            if family == "qwen3":
                assert "<think>\n\n</think>" in text(ask(chat_template_kwargs={"enable_thinking": False}))
                assert "<think>" not in text(ask())
            r = c.chat.completions.create(model=family, messages=msgs, tools=[WEATHER], tool_choice="required",
                                          max_tokens=100, temperature=0)
            call = r.choices[0].message.tool_calls[0]
            assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Oslo", "Paris")
            assert r.choices[0].finish_reason == "tool_calls"
        finally:
            srv.stop()
