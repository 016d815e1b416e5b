"""Adapters whose config gives some modules their own rank and alpha (`rank_pattern`,
`alpha_pattern`), with and without rsLoRA, against transformers + PEFT (CPU, float32).

The patterns use PEFT's key rules: a key is a regex for the end of a module's dotted name (a
layer's module by its path, every layer's by its name, "^model..." anchored at the start, an
alternation "a|b" naming both), and the first key in the config's order wins where several match.
"""

import pytest
import torch

from replicas.adapters.loader import load_adapter
from replicas.request import Request
from tests.factories import hf_greedy, hf_logits, make_adapter, reference_model
from tests.replicas.conftest import adapter_logits, greedy, make_engine, run_to_completion

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = [61, 150, 7, 12, 250, 3, 44, 9, 5, 17, 200]
RANK_PATTERN = {
    "^model.layers.1.self_attn.q_proj": 12,  # one layer's module, anchored at the start
    "v_proj": 2,  # every layer's v_proj
    "gate_proj|up_proj": 6,  # an alternation: both names
    "layers.0.mlp.down_proj": 8,  # one layer's module, by the end of its path
}
ALPHA_PATTERN = {
    "down_proj": 2,  # saved before the next key (PEFT writes keys sorted): it wins for layer 1
    "model.layers.1.mlp.down_proj": 11,
    "k_proj|up_proj": 5,
    "o_proj": 20,
    "layers.0.self_attn.q_proj": 3,
}


@pytest.fixture(scope="module", params=[False, True], ids=["lora", "rslora"])
def patterned(request, models, tmp_path_factory):
    path = tmp_path_factory.mktemp("patterned")
    return make_adapter(
        models["llama"],
        path,
        rank=4,
        lora_alpha=8,
        target_modules=ALL,
        use_rslora=request.param,
        rank_pattern=RANK_PATTERN,
        alpha_pattern=ALPHA_PATTERN,
        seed=7,
    )


def test_each_module_has_peft_rank_and_scaling(models, patterned):
    """Module by module: our rank and B * scaling (per-module scaling folded into B) equal
    PEFT's `r` and `lora_B * scaling`, so a mismatch names its module."""
    engine = make_engine(models["llama"])
    ours = load_adapter("p", patterned, engine.spec, max_lora_rank=16)
    peft = reference_model(models["llama"], patterned)
    seen, scalings = 0, set()
    for name, module in peft.named_modules():
        if not hasattr(module, "lora_B") or "default" not in module.lora_B:
            continue
        parts = name.split(".")
        layer, target = int(parts[parts.index("layers") + 1]), parts[-1]
        a, b = ours.modules[layer, target]
        assert a.shape[0] == module.r["default"], name
        ref = module.lora_B["default"].weight * module.scaling["default"]
        torch.testing.assert_close(b.float() * ours.scaling, ref, rtol=1e-6, atol=0, msg=name)
        torch.testing.assert_close(a.float(), module.lora_A["default"].weight, msg=name)
        scalings.add(round(module.scaling["default"], 6))
        seen += 1
    assert seen == len(ours.modules) == 2 * len(ALL)
    assert len(scalings) >= 5  # the patterns gave modules many different scalings


def test_logits_and_greedy_tokens_equal_peft(models, patterned):
    engine = make_engine(models["llama"], adapters=(("p", str(patterned)),))
    ours = adapter_logits(engine, "p", PROMPT)
    ref = hf_logits(models["llama"], PROMPT, adapter_dir=patterned)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)

    engine = make_engine(models["llama"], adapters=(("p", str(patterned)),))
    results = run_to_completion(
        engine,
        [Request("p", PROMPT, greedy(10), "p"), Request("base", PROMPT[:5], greedy(10))],
    )
    assert results["p"][0] == hf_greedy(models["llama"], PROMPT, 10, adapter_dir=patterned)
    assert results["base"][0] == hf_greedy(models["llama"], PROMPT[:5], 10)
