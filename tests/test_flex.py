"""model.attention=flex: masks built as torchtitan builds them; refused where it cannot train."""

from __future__ import annotations

import pytest

from tests.conftest import FAST, run_cli


def test_flex_on_cpu_is_refused_with_one_line(tmp_path):
    proc = run_cli(FAST + ["model.attention=flex", "device=cpu"], run_dir=tmp_path / "r")
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1]
    assert last == ("config error: model.attention=flex needs device cuda (FlexAttention has no cpu training kernels: "
                    "no backward on CPU); this run's device is cpu: use model.attention=sdpa")
    assert not (tmp_path / "r").exists(), "refused after Hydra made the run directory"


@pytest.mark.feature("FlexAttention with a BlockMask (forward on CPU)")
@pytest.mark.slow
def test_flex_forward_with_torchtitans_masks_equals_sdpa_on_cpu():
    """FlexAttention's forward runs on CPU: with the BlockMask from titan.flex_attention_masks (torchtitan's
    get_attention_masks) the logits equal the causal SDPA model's to 1e-5 (measured here: ~7e-7); without
    the mask torchtitan's flex layer cannot run at all (the crash issue 14 reports)."""
    import torch

    from qwen3_research import titan
    from qwen3_research.models import flavors

    flavor = flavors.DENSE["tiny"]
    with torch.device("cpu"):
        flex = titan.build_model(titan.qwen3_model_config(flavor, "flex", "cuda"))  # "cuda" keeps flex
        sdpa = titan.build_model(titan.qwen3_model_config(flavor, "sdpa", "cpu"))
    torch.manual_seed(0)
    titan.init_weights(flex, torch.device("cpu"))
    sdpa.load_state_dict(flex.state_dict())
    x = torch.randint(0, flavor.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    masks = titan.flex_attention_masks(flex, 2, 32, torch.device("cpu"))
    assert type(masks).__name__ == "BlockMask" and tuple(masks.shape) == (2, 1, 32, 32)
    with torch.no_grad():
        want = sdpa(x)
        got = flex(x, attention_masks=masks)
    diff = (want - got).abs().max().item()
    print("max |flex - sdpa| =", diff)
    assert diff < 1e-5
