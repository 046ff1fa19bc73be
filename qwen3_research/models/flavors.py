"""Model sizes by name. Pure data (no torch import) so configs validate fast.

Our small sizes keep the real Qwen3 vocabulary (151,936 rows, as the released checkpoints)
so the real tokenizer works unchanged; the named sizes are torchtitan's own configs.

``model=native`` takes every flavor of ``FLAVORS``: the dense ones (``DENSE``) and the mixtures of experts
(``MOE``), one name space as torchtitan's Qwen3 has one (names unique across both: the small MoE sizes are
``tiny_moe`` and ``debug_moe``). ``model=native_moe`` is a preset of it that picks ``tiny_moe``.
"""

from dataclasses import dataclass
from typing import Optional

QWEN3_VOCAB = 151936


@dataclass(frozen=True)
class Flavor:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int  # dense FFN width, or per-expert width for MoE
    vocab_size: int = QWEN3_VOCAB
    num_experts: int = 0
    top_k: int = 0
    rope_theta: float = 1_000_000.0
    max_seq_len: int = 4096
    tie_embeddings: bool = True
    torchtitan_name: Optional[str] = None  # build from torchtitan's registry instead
    rms_norm_eps: float = 1e-6
    norm_topk_prob: bool = True  # MoE: renormalise the top-k routing weights (torchtitan's route_norm)


DENSE = {
    "tiny": Flavor(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, hidden_dim=384),
    # tiny's dimensions, untied and 6 layers deep: what pipeline parallel can split on CPU (parallelism.pp refuses
    # tied embeddings) into 2 or 4 ranks of one or two stages each (6 layers + embedding + lm_head = 8 units)
    "tiny_untied": Flavor(dim=128, n_layers=6, n_heads=4, n_kv_heads=2, head_dim=32, hidden_dim=384,
                          tie_embeddings=False),
    "debug": Flavor(dim=256, n_layers=8, n_heads=8, n_kv_heads=4, head_dim=32, hidden_dim=768),
    "0.6B": Flavor(1024, 28, 16, 8, 128, 3072, max_seq_len=40960, torchtitan_name="0.6B"),
    "1.7B": Flavor(2048, 28, 16, 8, 128, 6144, max_seq_len=40960, torchtitan_name="1.7B"),
    "4B": Flavor(2560, 36, 32, 8, 128, 9728, max_seq_len=40960, torchtitan_name="4B"),
    "8B": Flavor(4096, 36, 32, 8, 128, 12288, max_seq_len=40960, tie_embeddings=False, torchtitan_name="8B"),
    "14B": Flavor(5120, 40, 40, 8, 128, 17408, max_seq_len=40960, tie_embeddings=False, torchtitan_name="14B"),
    "32B": Flavor(5120, 64, 64, 8, 128, 25600, max_seq_len=40960, tie_embeddings=False, torchtitan_name="32B"),
}

MOE = {
    "tiny_moe": Flavor(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, hidden_dim=128,
                       num_experts=8, top_k=2, tie_embeddings=False),
    "debug_moe": Flavor(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32, hidden_dim=128,
                        num_experts=64, top_k=8, tie_embeddings=False),
    # The smallest MoE the NKI Library MoE kernels take (kernels=nki_moe on one Trainium rank): hidden 1024
    # (moe_cte: 512..8192, a multiple of 512; H/LNC=512 a multiple of 32 for blockwise_mm_bwd), expert width
    # 512 (I % 16 == 0, I/LNC = 256 a multiple of 32), 8 experts (E % LNC == 0; inside moe_cte's documented
    # 8..64), head_dim 128 (even, for rope_hf). Checked in code: tests/test_nki_contract.py.
    "nki_debug": Flavor(dim=1024, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=128, hidden_dim=512,
                        num_experts=8, top_k=2, tie_embeddings=False),
    "30B-A3B": Flavor(2048, 48, 32, 4, 128, 768, num_experts=128, top_k=8, max_seq_len=40960,
                      tie_embeddings=False, torchtitan_name="30B-A3B"),
    "235B-A22B": Flavor(4096, 94, 64, 4, 128, 1536, num_experts=128, top_k=8, rope_theta=5_000_000.0,
                        max_seq_len=40960, tie_embeddings=False, torchtitan_name="235B-A22B"),
}

# model=native's flavors: the whole Qwen3 family in one name space.
FLAVORS = {**DENSE, **MOE}
assert len(FLAVORS) == len(DENSE) + len(MOE), "a flavor name is both dense and MoE"

# The backend name and flavor names the MoE models had before model=native took them (model.backend=native_moe,
# a separate backend until issue 32): old checkpoints, plans and run directories name them; ``registry.canonical``
# reads them as model=native and these flavors ("auto" without model.init_from was native_moe's default, tiny).
NATIVE_MOE_RENAMES = {"tiny": "tiny_moe", "debug": "debug_moe", "auto": "tiny_moe"}

# model.flavor=auto without model.init_from (with it: the checkpoint's architecture, ``from_hf``).
DEFAULT_FLAVOR = "tiny"
