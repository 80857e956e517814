"""TRL's boolean ``scale_rewards`` (True = "group", False = "none", as trl.GRPOConfig maps them) in the TRL paths."""
import pytest
import torch

from treadle.grpo.trl_adapter import normalize_scale_rewards, trl_advantages, trl_options


def test_booleans_map_like_trl():
    assert normalize_scale_rewards(True) == "group" and normalize_scale_rewards(False) == "none"
    assert trl_options(True) == trl_options("group") and trl_options(False) == trl_options("none")
    trl = pytest.importorskip("trl")
    for value in (True, False):
        cfg = trl.GRPOConfig(output_dir="unused", scale_rewards=value, report_to=[], use_cpu=True)
        assert normalize_scale_rewards(value) == cfg.scale_rewards


def test_boolean_advantages_equal_the_string_ones():
    g = 4
    r = torch.tensor([1.0, 0.0, 0.5, 0.25, 3.0, 1.0, 2.0, 2.5])
    torch.testing.assert_close(trl_advantages(r, g, True), trl_advantages(r, g, "group"))
    torch.testing.assert_close(trl_advantages(r, g, False), trl_advantages(r, g, "none"))
    centred = r - r.view(-1, g).mean(1).repeat_interleave(g)  # "none": mean-centred, not divided by a std
    torch.testing.assert_close(trl_advantages(r, g, False), centred)


@pytest.mark.parametrize("bad", ["yes", 1, None, "Group"])
def test_other_values_are_refused(bad):
    with pytest.raises(ValueError, match="scale_rewards must be"):
        trl_options(bad)
