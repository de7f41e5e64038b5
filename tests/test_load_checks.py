"""Single-process optimizers check a state dict before loading it, as the layer-wise loader
does (issue 8): another optimizer's dict, other shapes, renamed parameters or another routing
raise one `CheckpointMismatchError` listing every difference and leave the optimizer as it
was; the dicts that loaded before still load. Degenerate parameters (empty, listed twice) are
refused at construction.
"""

import copy

import pytest
import torch
from torch import nn

from orthoptim import SOAP, Muon, build_optimizer
from orthoptim.checkpoint import CheckpointMismatchError


class Net(nn.Module):
    def __init__(self, width=6, hidden=5, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(7, width)
        self.fc1 = nn.Linear(width, hidden, bias=False)
        self.fc2 = nn.Linear(hidden, width, bias=False)
        self.ln = nn.LayerNorm(width)


def loss(model):
    x = model.emb(torch.arange(7))
    return model.ln(model.fc2(torch.tanh(model.fc1(x)))).square().mean()


def stepped(opt, model, steps=2):
    for _ in range(steps):
        opt.zero_grad()
        loss(model).backward()
        opt.step()
    return opt


def matrices(model):
    return [(n, p) for n, p in model.named_parameters() if n.startswith("fc")]


def snapshot(opt):
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    state = {id(p): {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()}
             for p, st in opt.state.items()}  # fmt: skip
    return copy.deepcopy(groups), state


def assert_untouched(opt, before):
    groups, state = snapshot(opt)
    assert groups == before[0]
    assert state.keys() == before[1].keys()
    for i, st in state.items():
        for k, v in st.items():
            want = before[1][i][k]
            assert torch.equal(v, want) if torch.is_tensor(v) else v == want, k


def rejected(opt, sd, *expected):
    """Loading `sd` raises listing each of `expected`; nothing changes; step() still works."""
    before = snapshot(opt)
    with pytest.raises(CheckpointMismatchError) as info:
        opt.load_state_dict(sd)
    msg = str(info.value)
    for e in expected:
        assert e in msg, (e, msg)
    assert_untouched(opt, before)
    return info.value


def trained_muon(named=True, seed=0, **kw):
    model = Net(seed=seed, **kw)
    params = matrices(model) if named else [p for _, p in matrices(model)]
    return stepped(Muon(params, lr=0.02), model), model


def test_adamw_dict_into_muon_is_listed():
    muon, _ = trained_muon()
    other = Net()
    adamw = stepped(torch.optim.AdamW(matrices(other), lr=1e-3), other)
    err = rejected(
        muon,
        adamw.state_dict(),
        "hyper-parameter 'amsgrad' in the checkpoint, unknown here",
        "hyper-parameter 'ns_steps' here, missing from the checkpoint",
    )
    assert len(err.mismatches) > 3  # every difference, not the first


def test_soap_dict_into_muon_is_listed():
    muon, _ = trained_muon()
    other = Net()
    soap = stepped(SOAP(matrices(other), lr=1e-3), other)
    rejected(
        muon,
        soap.state_dict(),
        "hyper-parameter 'precondition_frequency' in the checkpoint, unknown here",
        "hyper-parameter 'lr_scale' here, missing from the checkpoint",
    )


def test_other_shapes_are_listed():
    muon, _ = trained_muon()
    other, _ = trained_muon(hidden=4)
    rejected(
        muon,
        other.state_dict(),
        "parameter fc1.weight: shape (4, 6) in the checkpoint, (5, 6) here",
        "parameter fc2.weight: shape (6, 4) in the checkpoint, (6, 5) here",
    )


def test_renamed_parameters_are_listed():
    muon, _ = trained_muon()
    sd = copy.deepcopy(muon.state_dict())
    sd["param_groups"][0]["param_names"] = ["a.weight", "fc2.weight"]
    rejected(
        muon,
        sd,
        "parameter a.weight: in the checkpoint, not in this model",
        "parameter fc1.weight: in this model, missing from the checkpoint",
    )


def test_reordered_parameters_are_listed():
    model = Net()
    a = stepped(Muon(matrices(model), lr=0.02), model)
    b = Muon(list(reversed(matrices(Net()))), lr=0.02)
    rejected(b, a.state_dict(), "param group 0: the same parameters in another order")


def test_changed_hyper_parameter_is_listed_scheduled_ones_are_not():
    muon, _ = trained_muon()
    sd = copy.deepcopy(muon.state_dict())
    sd["param_groups"][0].update(lr=0.5, momentum=0.9, weight_decay=0.1, ns_steps=3)
    err = rejected(muon, sd, "param group 0 (muon): ns_steps = 3 in the checkpoint, 5 here")
    assert len(err.mismatches) == 1, err.mismatches


def test_unnamed_dicts_are_checked_by_position():
    muon, _ = trained_muon(named=False)
    other, _ = trained_muon(named=False, hidden=4)
    rejected(
        muon,
        other.state_dict(),
        "parameter param_groups[0][0]: shape (4, 6) in the checkpoint, (5, 6) here",
        "names could not be checked",
    )
    model = Net()
    adamw = stepped(torch.optim.AdamW([p for _, p in matrices(model)], lr=1e-3), model)
    rejected(muon, adamw.state_dict(), "hyper-parameter 'amsgrad' in the checkpoint")
    one = Net()
    fewer = stepped(Muon([one.fc1.weight], lr=0.02), one)
    rejected(muon, fewer.state_dict(), "parameter param_groups[0][1]: in this model, missing")


def test_build_optimizer_dict_with_another_route_is_listed():
    model = Net()
    opt = stepped(build_optimizer(model, lr=0.02), model)
    other = Net()
    rerouted = build_optimizer(other, lr=0.02, route=lambda n, p: n == "fc1.weight")
    stepped(rerouted, other)
    rejected(
        opt,
        rerouted.state_dict(),
        "parameter fc2.weight: optimized by adamw in the checkpoint, by muon here",
    )
    soap_model = Net()
    soap = stepped(build_optimizer(soap_model, optimizer="soap", lr=1e-3), soap_model)
    rejected(opt, soap.state_dict(), "optimizers ['soap', 'adamw'] in the checkpoint")


def test_matching_dicts_still_load():
    # Muon (named and unnamed), SOAP, build_optimizer: saved, loaded into a fresh optimizer,
    # then both step the same
    for make in (
        lambda m: Muon(matrices(m), lr=0.02),
        lambda m: Muon([p for _, p in matrices(m)], lr=0.02),
        lambda m: SOAP(matrices(m), lr=1e-3),
        lambda m: build_optimizer(m, lr=0.02),
        lambda m: build_optimizer(m, optimizer="soap", lr=1e-3),
    ):
        a_model, b_model = Net(), Net()
        a = stepped(make(a_model), a_model)
        b_model.load_state_dict(a_model.state_dict())
        b = make(b_model)
        sd = copy.deepcopy(a.state_dict())
        for g in sd["param_groups"]:
            g["lr"] = g["lr"] * 0.5  # a scheduler's change is restored, not refused
        b.load_state_dict(sd)
        assert [g["lr"] for g in b.param_groups] == [g["lr"] for g in sd["param_groups"]]
        for g in a.param_groups:
            g["lr"] *= 0.5
        stepped(a, a_model, 1)
        stepped(b, b_model, 1)
        for (n, p), q in zip(a_model.named_parameters(), b_model.parameters()):
            assert torch.equal(p, q), n


@pytest.mark.parametrize("cls", [Muon, SOAP])
def test_empty_parameter_refused_at_construction(cls):
    empty = nn.Parameter(torch.zeros(0, 5))
    with pytest.raises(ValueError, match=r"w with shape \(0, 5\), which has no elements"):
        cls([("w", empty)])
    with pytest.raises(ValueError, match="no elements"):
        build_optimizer(nn.Linear(5, 0, bias=False), optimizer=cls.__name__.lower())


@pytest.mark.parametrize("cls", [Muon, SOAP])
def test_parameter_twice_refused_at_construction(cls):
    w = nn.Parameter(torch.randn(4, 5))
    with pytest.raises(ValueError, match="a.weight is b.weight again"):
        cls([("b.weight", w), ("a.weight", w)])
    with pytest.raises(ValueError, match="same tensor twice"):
        cls([w, w])
    model = Net()
    with pytest.raises(ValueError, match="fc1.weight is fc1.weight again"):
        build_optimizer(model, params=[*model.named_parameters(), ("fc1.weight", model.fc1.weight)])


def test_load_sharded_of_damaged_checkpoint_raises_an_exception(tmp_path):
    """DCP's CheckpointException is a BaseException: `except Exception` would miss it."""
    from orthoptim import checkpoint as ckpt

    model = Net()
    opt = stepped(build_optimizer(model, lr=0.02), model)
    path = tmp_path / "ckpt"
    ckpt.save_sharded(path, opt, model)
    for f in path.glob("*.distcp"):
        f.write_bytes(f.read_bytes()[:16])  # truncated data files, intact metadata
    fresh_model = Net(seed=1)
    fresh = build_optimizer(fresh_model, lr=0.02)
    before = {k: v.clone() for k, v in fresh_model.state_dict().items()}
    try:
        ckpt.load_sharded(path, fresh, fresh_model)
    except Exception as exc:  # the point: an Exception, not a BaseException
        assert isinstance(exc, ckpt.CheckpointLoadError), repr(exc)
        assert f"could not read checkpoint {path}" in str(exc), str(exc)
    else:
        raise AssertionError("a damaged checkpoint loaded")
    for k, v in fresh_model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not fresh.state
