"""Every plug-in the installed package registers satisfies its kind's written contract
(`mini_infer.engine.contracts`), built the way the engine builds it, on a tiny model."""
import pytest
import torch
from mini_infer.engine import contracts
from mini_infer.engine.registry import KINDS, lookup, names, register
from mini_infer.engine.engine import EngineConfig, LLMEngine
from test_quant import NoText, tiny_model


def test_every_kind_has_a_protocol_and_plugins():
    for kind, protocol in KINDS.items():
        assert protocol.__doc__, f"{kind}: the contract says what it is for"
        assert names(kind), f"no plug-in of kind {kind!r} is registered"


def test_the_engines_own_defaults_are_registered():
    assert {"torch"} <= set(names("backend")) and {"plain"} <= set(names("kv_manager"))
    assert "fcfs" in names("policy")


@pytest.mark.parametrize("name", names("backend"))
def test_backends(name):
    cls = lookup("backend", name)
    backend = cls()
    assert isinstance(backend, contracts.ComputeBackend), name
    if cls.available(torch.device("cpu"), torch.float32):
        model = tiny_model()
        run_step = backend.prepare(model, EngineConfig(enforce_eager=True))
        assert callable(run_step)
        attention = backend.attention()
        assert isinstance(attention, contracts.AttentionBackend), name
        assert backend.reserve(run_step, attention, 4) >= 0
        for layer in model.linear_layers():
            assert isinstance(layer.method, contracts.LinearMethod), (name, type(layer.method))


@pytest.mark.parametrize("name", names("kv_manager"))
def test_kv_managers(name):
    assert isinstance(lookup("kv_manager", name)(8, 4), contracts.KVManager)


@pytest.mark.parametrize("name", names("policy"))
def test_policies(name):
    assert callable(lookup("policy", name))


@pytest.mark.parametrize("name", names("linear_method"))
def test_linear_methods(name):
    model = tiny_model()
    lookup("linear_method", name)(model, EngineConfig())
    for layer in model.linear_layers():
        assert isinstance(layer.method, contracts.LinearMethod), (name, type(layer.method))


@pytest.mark.parametrize("name", names("attention"))
def test_attention_formats(name):
    from mini_infer.engine.attention import TorchAttention
    assert isinstance(lookup("attention", name)(TorchAttention()), contracts.AttentionBackend)


@pytest.mark.parametrize("name", names("model"))
def test_model_families(name):
    family = lookup("model", name)()
    assert isinstance(family, contracts.ModelFamily), name
    assert hasattr(family.config_class, "from_dict") and family.config_class.__doc__


@pytest.mark.parametrize("name", names("constraints"))
def test_constraints(name):
    pytest.importorskip("xgrammar")
    model = tiny_model()
    eng = LLMEngine(model, NoText(), num_blocks=16, block_size=4, backend="torch", structured_outputs=name)
    assert isinstance(eng.scheduler.constraints, contracts.Constraints)


@pytest.mark.parametrize("name", names("proposer"))
def test_proposers(name):
    model = tiny_model()
    spec = {"method": name, "num_speculative_tokens": 2}
    if name == "draft_model":
        spec["model"] = model  # the target drafts for itself: the contract, not the speed
    try:
        eng = LLMEngine(model, NoText(), num_blocks=16, block_size=4, backend="torch", speculative_config=spec)
    except (ValueError, TypeError) as e:   # a draft model by name needs a loadable checkpoint
        pytest.skip(f"{name}: {e}")
    assert isinstance(eng.scheduler.proposer, contracts.Proposer)
    assert eng.scheduler.proposer.sampler is not None, "a proposer brings the sampler that verifies it"


@pytest.mark.parametrize("name", names("executor"))
def test_executors_have_the_engines_face(name):
    cls = lookup("executor", name)
    for member in ("add_request", "step", "abort", "has_unfinished", "stats", "close"):
        assert callable(getattr(cls, member, None)), (name, member)


def test_the_plain_engine_has_the_engines_face():
    assert isinstance(LLMEngine(tiny_model(), NoText(), num_blocks=16, block_size=4, backend="torch"),
                      contracts.Engine)


def test_unknown_names_fail_with_the_choices():
    with pytest.raises(ValueError, match="choose from .*plain"):
        lookup("kv_manager", "no_such_manager")
    with pytest.raises(ValueError, match="unknown plug-in kind"):
        register("no_such_kind", "x")
    with pytest.raises(ValueError, match="int8"):
        EngineConfig(quantization="int4")


def test_a_plugin_of_ones_own_runs_in_the_engine():
    "Registering is all it takes: a policy of ours, chosen by name, orders the engine's queue."
    seen = []

    @register("policy", "test_newest_first")
    def newest_first(waiting, kv):
        seen.append(len(waiting))
        return type(waiting)(reversed(waiting))

    eng = LLMEngine(tiny_model(), NoText(), num_blocks=32, block_size=4, backend="torch",
                    policy="test_newest_first", max_num_seqs=1)
    from mini_infer import SamplingParams
    for p in ([1, 2, 3], [4, 5, 6]):
        eng.add_request(p, SamplingParams(max_tokens=2, temperature=0))
    order = []
    while eng.has_unfinished():
        order += [o.request_id for o in eng.step() if o.finished]
    assert seen and len(order) == 2
