"""Model shapes the benchmarks and the simulator's calibration build, as config.json contents.

`ModelSpec.from_dict(LLAMA3_8B)` is the engine's view of the same shape.
"""

from __future__ import annotations

LLAMA3_8B = {
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
    "eos_token_id": 128001,
}
# The same architecture at toy size: `--smoke` runs of GPU benchmarks, on CPU.
TINY = {
    **LLAMA3_8B,
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "eos_token_id": 1,
}
