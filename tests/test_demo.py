"""The embedded demo and the test factories: tokenizer, seeded models, PEFT-format adapters."""

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
import torch
from safetensors.torch import load_file

import app.demo as demo_module
from app.demo import DEMO_ADAPTERS, DEMO_VERSION, ensure_demo
from synthetic.adapters import LORA_MODULES, lora_scaling, write_peft_adapter
from synthetic.tokenizer import build_byte_tokenizer, save_tokenizer
from tests.factories import hf_greedy, hf_logits, make_adapter, make_model

REPO_ROOT = Path(__file__).resolve().parents[1]
TEXTS = [
    "",
    "hello world",
    "  leading, trailing and  double  spaces  ",
    "tabs\tand\nnewlines\r\n",
    "emoji 🦙🚀👩‍👩‍👧 and ünïcödé, 中文, עברית",
    "control \x00\x07\x1b bytes",
    "e\u0301 combining accent",
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_byte_tokenizer()


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return ensure_demo(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def demo_prompt(tokenizer) -> list[int]:
    messages = [{"role": "user", "content": "List the ten largest tables."}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)


def tree_bytes(root: Path) -> dict[str, bytes]:
    files = sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p.relative_to(root)): p.read_bytes() for p in files}


def assert_same_demo(a: Path, b: Path) -> None:
    """Two demo trees hold the same files and bytes, up to the model path each adapter names."""
    files_a, files_b = tree_bytes(a), tree_bytes(b)
    assert files_a.keys() == files_b.keys()
    for name in files_a:
        if name.endswith("adapter_config.json"):
            config_a, config_b = json.loads(files_a[name]), json.loads(files_b[name])
            assert config_a.pop("base_model_name_or_path") == str(a / "model")
            assert config_b.pop("base_model_name_or_path") == str(b / "model")
            assert config_a == config_b, name
        else:
            assert files_a[name] == files_b[name], name


def longest_run(tokens: list[int]) -> int:
    return max(len(list(group)) for _, group in itertools.groupby(tokens))


class TestByteTokenizer:
    @pytest.mark.parametrize("text", TEXTS)
    def test_encodes_to_utf8_bytes_and_decodes_back(self, tokenizer, text):
        ids = tokenizer.encode(text)
        assert ids == list(text.encode("utf-8"))
        assert tokenizer.decode(ids) == text

    def test_special_tokens_follow_the_bytes(self, tokenizer):
        assert len(tokenizer) == 259
        assert (tokenizer.bos_token, tokenizer.bos_token_id) == ("<|bos|>", 256)
        assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|eos|>", 257)
        assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|pad|>", 258)
        assert tokenizer.decode([104, 256, 105, 257], skip_special_tokens=True) == "hi"

    def test_chat_template_marks_roles_and_ends_turns_with_eos(self, tokenizer):
        messages = [
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": [{"type": "text", "text": "Hi 🦙"}]},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Bye"},
        ]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert text == (
            "<|bos|><|system|>\nBe terse.<|eos|><|user|>\nHi 🦙<|eos|>"
            "<|assistant|>\nHello.<|eos|><|user|>\nBye<|eos|><|assistant|>\n"
        )
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        assert ids[0] == tokenizer.bos_token_id
        assert ids.count(tokenizer.eos_token_id) == len(messages)
        assert ids[-len(b"<|assistant|>\n") :] == list(b"<|assistant|>\n")
        without = tokenizer.apply_chat_template(messages, tokenize=False)
        assert without == text.removesuffix("<|assistant|>\n")

    def test_chat_template_rejects_unknown_roles(self, tokenizer):
        with pytest.raises(jinja2.TemplateError, match="tool"):
            tokenizer.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)

    def test_loads_back_from_a_local_folder(self, tokenizer, tmp_path):
        from transformers import AutoTokenizer

        save_tokenizer(tokenizer, tmp_path)
        loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
        for text in TEXTS:
            assert loaded.encode(text) == tokenizer.encode(text)
            assert loaded.decode(loaded.encode(text)) == text
        assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (256, 257, 258)
        messages = [{"role": "user", "content": "hi"}]
        assert loaded.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        ) == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


class TestEnsureDemo:
    def test_second_call_returns_the_same_assets_without_rebuilding(self, demo, monkeypatch):
        root = demo.model_dir.parent
        before = {p: p.stat().st_mtime_ns for p in root.rglob("*")}
        builds = []
        monkeypatch.setattr(demo_module, "_build_demo", lambda *args: builds.append(args))
        again = ensure_demo(root.parent)
        assert builds == []
        assert again == demo
        assert {p: p.stat().st_mtime_ns for p in root.rglob("*")} == before

    def test_assets_are_complete_folders(self, demo):
        assert demo.model_dir.parent.name == DEMO_VERSION
        model_files = [
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "tokenizer.json",
        ]
        for name in model_files:
            assert (demo.model_dir / name).is_file(), name
        assert set(demo.adapters) == {spec.name for spec in DEMO_ADAPTERS}
        for path in demo.adapters.values():
            assert (path / "adapter_config.json").is_file()
            assert (path / "adapter_model.safetensors").is_file()
        # Nothing left behind by the build.
        assert [p.name for p in demo.model_dir.parent.parent.iterdir()] == [DEMO_VERSION]

    def test_concurrent_builders_leave_one_copy_identical_to_a_lone_build(self, demo, tmp_path):
        # Separate processes, as Ray replicas on one node would be; each builds the whole demo.
        code = "import sys; from app.demo import ensure_demo; ensure_demo(sys.argv[1])"
        procs = [
            subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=REPO_ROOT)
            for _ in range(2)
        ]
        try:
            # A hang guard: each takes about 10 s alone, both together on a loaded machine
            # minutes.
            assert [p.wait(timeout=600) for p in procs] == [0, 0]
        finally:
            for p in procs:
                p.kill()
        assert [p.name for p in tmp_path.iterdir()] == [DEMO_VERSION]
        assert_same_demo(demo.model_dir.parent, tmp_path / DEMO_VERSION)

    def test_a_builder_that_loses_the_rename_returns_the_winners_copy(self, tmp_path, monkeypatch):
        real_build = demo_module._build_demo

        def build_then_lose(staging: Path, final: Path) -> None:
            real_build(staging, final)
            winner = tmp_path / "winner"
            real_build(winner, final)
            (winner / "winner").touch()
            os.rename(winner, final)

        monkeypatch.setattr(demo_module, "_build_demo", build_then_lose)
        assets = ensure_demo(tmp_path)
        assert (assets.model_dir.parent / "winner").is_file()
        assert [p.name for p in tmp_path.iterdir()] == [DEMO_VERSION]  # our copy is gone

    def test_incomplete_leftover_is_replaced(self, demo, tmp_path):
        leftover = tmp_path / DEMO_VERSION / "model"
        leftover.mkdir(parents=True)
        (leftover / "config.json").write_text("{")  # an interrupted copy
        assets = ensure_demo(tmp_path)
        assert_same_demo(demo.model_dir.parent, assets.model_dir.parent)
        assert [p.name for p in tmp_path.iterdir()] == [DEMO_VERSION]

    def test_base_model_decodes_varied_in_vocabulary_tokens(self, demo, demo_prompt):
        tokens = hf_greedy(demo.model_dir, demo_prompt, 32)
        assert longest_run(tokens) <= 4
        assert len(set(tokens)) >= 16
        assert max(tokens) < 259  # padded vocabulary rows never win

    def test_each_adapter_loads_in_peft_and_changes_greedy_output(self, demo, demo_prompt):
        base = hf_greedy(demo.model_dir, demo_prompt, 8)
        outputs = {}
        for spec in DEMO_ADAPTERS:
            path = demo.adapters[spec.name]
            config = json.loads((path / "adapter_config.json").read_text())
            assert config["r"] == spec.rank
            assert set(config["target_modules"]) == set(spec.target_modules)
            assert config["use_rslora"] == spec.use_rslora
            outputs[spec.name] = hf_greedy(demo.model_dir, demo_prompt, 8, adapter_dir=path)
            assert outputs[spec.name] != base, spec.name
        assert len({tuple(tokens) for tokens in outputs.values()}) == len(DEMO_ADAPTERS)


@pytest.fixture(scope="module")
def small_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {
        "llama": make_model(root / "llama", "llama"),
        "qwen2": make_model(root / "qwen2", "qwen2"),
        "qwen3": make_model(root / "qwen3", "qwen3"),
        "llama-tied": make_model(root / "llama-tied", "llama", tie_word_embeddings=True),
    }


PROMPT = [256, *b"<|user|>\nWrite a haiku.", 257, *b"<|assistant|>\n"]


class TestWritePeftAdapter:
    @pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")
    def test_peft_loads_exactly_the_written_weights(self, small_models, tmp_path):
        from peft import PeftModel
        from peft.utils import get_peft_model_state_dict
        from transformers import AutoModelForCausalLM

        model_dir = small_models["qwen3"]  # head_dim != hidden / heads: q/o shapes differ
        targets = ["q_proj", "v_proj", "o_proj", "down_proj"]
        path = write_peft_adapter(
            model_dir, tmp_path, rank=4, lora_alpha=8, target_modules=targets, seed=3,
            use_rslora=True,
        )  # fmt: skip
        written = load_file(path / "adapter_model.safetensors")
        assert len(written) == 2 * 2 * len(targets)  # 2 layers, A and B

        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), path)
        loaded = get_peft_model_state_dict(model)
        assert loaded.keys() == written.keys()
        for key, tensor in written.items():
            assert torch.count_nonzero(tensor) == tensor.numel(), key
            assert torch.equal(loaded[key], tensor), key
        q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
        assert q_proj.lora_A["default"].weight.shape == (4, 64)
        assert q_proj.lora_B["default"].weight.shape == (128, 4)
        assert q_proj.scaling["default"] == pytest.approx(lora_scaling(4, 8, use_rslora=True))

    def test_config_reads_back_as_a_peft_lora_config(self, small_models, tmp_path):
        from peft import LoraConfig

        path = write_peft_adapter(
            small_models["llama"], tmp_path, rank=2, lora_alpha=5, target_modules=["k_proj"], seed=0
        )
        config = LoraConfig.from_pretrained(path)
        assert (config.peft_type, config.task_type) == ("LORA", "CAUSAL_LM")
        assert (config.r, config.lora_alpha, config.use_rslora) == (2, 5, False)
        assert set(config.target_modules) == {"k_proj"}
        assert config.base_model_name_or_path == str(small_models["llama"])

    @pytest.mark.parametrize("rank, alpha, rslora", [(1, 1, False), (8, 32, False), (16, 4, True)])
    def test_init_scale_sets_the_delta_size_whatever_rank_and_alpha(
        self, small_models, tmp_path, rank, alpha, rslora
    ):
        path = write_peft_adapter(
            small_models["llama"], tmp_path, rank=rank, lora_alpha=alpha,
            target_modules=["up_proj"], seed=1, use_rslora=rslora, init_scale=0.5,
        )  # fmt: skip
        weights = load_file(path / "adapter_model.safetensors")
        prefix = "base_model.model.model.layers.0.mlp.up_proj"
        a, b = weights[f"{prefix}.lora_A.weight"], weights[f"{prefix}.lora_B.weight"]
        x = torch.randn(64, 4096, generator=torch.Generator().manual_seed(0))  # unit RMS
        delta = lora_scaling(rank, alpha, rslora) * b @ a @ x
        assert delta.pow(2).mean().sqrt().item() == pytest.approx(0.5, rel=0.35)

    def test_rejects_modules_it_cannot_place(self, small_models, tmp_path):
        with pytest.raises(ValueError, match="lm_head"):
            write_peft_adapter(
                small_models["llama"], tmp_path, rank=2, lora_alpha=2,
                target_modules=["q_proj", "lm_head"], seed=0,
            )  # fmt: skip


class TestFactories:
    @pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "llama-tied"])
    def test_models_decode_varied_tokens_and_peft_adapters_change_them(
        self, small_models, tmp_path, arch
    ):
        model_dir = small_models[arch]
        base = hf_greedy(model_dir, PROMPT, 24)
        assert len(base) == 24
        assert len(set(base)) >= 6
        assert hf_logits(model_dir, PROMPT)[-1].argmax().item() == base[0]

        adapter = make_adapter(model_dir, tmp_path / "a", rank=4, target_modules=LORA_MODULES)
        assert (adapter / "adapter_model.safetensors").is_file()
        assert hf_greedy(model_dir, PROMPT, 24, adapter_dir=adapter) != base

    def test_make_adapter_is_seeded(self, small_models, tmp_path):
        kwargs = dict(rank=2, target_modules=["q_proj", "v_proj"])
        first = make_adapter(small_models["llama"], tmp_path / "a", seed=5, **kwargs)
        again = make_adapter(small_models["llama"], tmp_path / "b", seed=5, **kwargs)
        other = make_adapter(small_models["llama"], tmp_path / "c", seed=6, **kwargs)
        weights = [load_file(p / "adapter_model.safetensors") for p in (first, again, other)]
        key = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
        assert torch.equal(weights[0][key], weights[1][key])
        assert not torch.equal(weights[0][key], weights[2][key])

    def test_arch_features_are_in_the_weights(self, small_models):
        def keys(arch: str) -> set[str]:
            return set(load_file(small_models[arch] / "model.safetensors"))

        assert "model.layers.0.self_attn.q_proj.bias" in keys("qwen2")
        assert "model.layers.0.self_attn.q_proj.bias" not in keys("llama")
        assert "model.layers.0.self_attn.q_norm.weight" in keys("qwen3")
        assert "lm_head.weight" in keys("llama")
        assert "lm_head.weight" not in keys("llama-tied")
        q_proj = load_file(small_models["qwen3"] / "model.safetensors")[
            "model.layers.0.self_attn.q_proj.weight"
        ]
        assert q_proj.shape == (4 * 32, 64)
