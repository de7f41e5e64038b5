"""The deprecation policy (CHANGELOG.md) kept: a name whose meaning changed keeps working for a
release and says, once, what changed and how to say the intended meaning without a warning."""

from __future__ import annotations

import math
import re
import warnings

import pytest
import torch
from torch import nn

from orthoptim import Muon
from orthoptim.optim import muon
from orthoptim.optim.muon import lr_scale_factor


@pytest.fixture
def fresh_process(monkeypatch):
    """As if no lr_scale warning had been given yet in this process."""
    monkeypatch.setattr(muon, "_WARNED", set())


def _step(lr_scale: str, rows: int = 16, cols: int = 64) -> tuple[Muon, torch.Tensor]:
    w = nn.Parameter(torch.zeros(rows, cols))
    opt = Muon([w], lr=1.0, momentum=0.0, nesterov=False, lr_scale=lr_scale)
    w.grad = torch.randn(rows, cols)
    opt.step()
    return opt, w.detach()


def test_spectral_warns_once_naming_the_old_meaning_and_the_quiet_spellings(fresh_process):
    with pytest.warns(FutureWarning) as record:
        opt, w = _step("spectral")
        _step("spectral")
        lr_scale_factor("spectral", 4, 2)
    assert len(record) == 1  # once per process, not per optimizer, group or step
    (warning,) = record
    message = str(warning.message)
    for part in ("lr_scale='spectral'", "0.1.0", "'unit_rms_norm'", "'sqrt_max_dim'"):
        assert part in message, message
    assert "warnings.filterwarnings" in message
    assert warning.filename == __file__  # points at the caller, not into orthoptim
    # still the new meaning, √max(rows, cols), stored under the spelling that does not warn
    assert opt.param_groups[0]["lr_scale"] == "sqrt_max_dim"
    assert lr_scale_factor("spectral", 16, 64) == 8.0
    O = w / -8.0  # a step of lr 1 from zero is -scale·orthogonalize(G)
    torch.testing.assert_close(torch.linalg.svdvals(O), torch.ones(16), atol=0.3, rtol=0)


@pytest.mark.parametrize(
    ("name", "factor"),
    [("sqrt_max_dim", math.sqrt(64)), ("unit_rms_norm", math.sqrt(16 / 64)), ("keller", 1.0)],
)
def test_the_names_that_say_what_they_mean_never_warn(fresh_process, name, factor):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt, _ = _step(name)
        assert lr_scale_factor(name, 16, 64) == pytest.approx(factor)
        # a checkpoint's param group carries the stored name back in: still quiet
        opt.load_state_dict(opt.state_dict())
        opt.step()


def test_the_filter_the_warning_suggests_silences_it(fresh_process):
    shown = re.search(r"filterwarnings\((.*)\)", _spectral_message()).group(1)
    assert shown == "'ignore', message=\"lr_scale='spectral'\""
    muon._WARNED.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message="lr_scale='spectral'")
        _step("spectral")


def _spectral_message() -> str:
    with pytest.warns(FutureWarning) as record:
        lr_scale_factor("spectral", 2, 2)
    return str(record[0].message)


def test_a_checkpoint_that_stored_spectral_loads_into_sqrt_max_dim():
    """0.1.0 stored √max(rows, cols) as lr_scale "spectral": such a checkpoint loads into an
    optimizer built with the quiet spelling, and steps with the same scale."""
    p = nn.Parameter(torch.randn(4, 8, dtype=torch.float64))
    p.grad = torch.randn(4, 8, dtype=torch.float64)
    saved = Muon([p], lr_scale="sqrt_max_dim")
    saved.step()
    sd = saved.state_dict()
    sd["param_groups"][0]["lr_scale"] = "spectral"  # as 0.1.0 wrote it
    loaded = Muon([nn.Parameter(p.detach().clone())], lr_scale="sqrt_max_dim")
    loaded.load_state_dict(sd)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        assert lr_scale_factor(loaded.param_groups[0]["lr_scale"], 4, 8) == math.sqrt(8)


def test_state_view_layout_is_metadata_with_one_warning(monkeypatch):
    """`StateView.layout()` (before 0.2) is `metadata()` now: calling it, or a subclass that
    still defines it, works and warns once per process, naming `metadata`."""
    from orthoptim.optim import state

    monkeypatch.setattr(state, "_WARNED_LAYOUT", [])
    opt = torch.optim.SGD([{"params": [nn.Parameter(torch.zeros(2, 3))], "param_names": ["w"]}])
    view = state.StateView(opt)
    with pytest.warns(FutureWarning, match=r"StateView.layout\(\) is now StateView.metadata"):
        old = view.layout()
    assert old == view.metadata() and old["shapes"] == {"w": [2, 3]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        view.layout()  # once per process

        class Own(state.StateView):
            def layout(self):
                return {"format": "own"}

    assert Own(opt).metadata() == {"format": "own"}
    monkeypatch.setattr(state, "_WARNED_LAYOUT", [])
    with pytest.warns(FutureWarning, match="define metadata"):

        class Again(state.StateView):
            def layout(self):
                return {}
