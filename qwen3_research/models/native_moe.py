"""``model=native_moe``: torchtitan's Qwen3-MoE, the MoE variant of ``models.native`` (flavors
``models.flavors.MOE``; config.json ``model_type`` qwen3_moe for ``model.init_from`` and the export)."""

from qwen3_research.models.flavors import MOE
from qwen3_research.models.native import native_spec

BACKEND = native_spec("native_moe", MOE, moe=True, hf_model_type="qwen3_moe")
