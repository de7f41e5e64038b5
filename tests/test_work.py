"""A step's forward and backward work beyond 6·N·D (`orthoptim.plan.work`), against the real
model: the flops torch's counter sees in the built-in GPT's forward and backward, the
activation all-reduces DTensor issues under tensor parallelism over real gloo ranks, the
saved activations the memory plan counts. No test here times anything."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from orthoptim.plan import Layout, expand, load_hardware, make_plan
from orthoptim.plan.model import train_model
from orthoptim.plan.work import activation_bytes_per_token, flops_per_token, work_figures
from orthoptim.train.model import CONFIGS, GPT

from distributed import run_ranks


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_flops_per_token_are_what_the_real_forward_and_backward_count(name: str) -> None:
    """FlopCounterMode over the GPT's forward and backward (attention on its math path,
    whose products the counter sees; the CPU flash kernel it does not count) counts
    `flops_per_token` × tokens exactly, less 6 × the norms' weights per token: the 6·N
    convention counts every non-embedding parameter, the norms' too."""
    cfg, desc = CONFIGS[name], train_model(name)
    torch.manual_seed(0)
    model, batch = GPT(cfg), 2
    idx = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(idx[:, :-1], idx[:, 1:]).backward()
    tokens = batch * cfg.seq_len
    vectors = sum(u.numel for u in expand(desc) if len(u.shape) == 1)
    counted = counter.get_total_flops()
    assert flops_per_token(desc, cfg.seq_len) * tokens - 6 * vectors * tokens == counted
    without_attention = counter.get_flop_counts()["Global"][torch.ops.aten.mm]
    assert counted - without_attention > 0  # the attention products are in the count


def test_the_activations_are_the_memory_plans() -> None:
    """The bytes the step-time model prices are the saved activations the memory plan holds
    (one micro-batch, no pipeline), per token, which tests/test_activations.py checks
    against what the real forward saves."""
    desc = train_model("tiny")
    layout = Layout(dp=1, micro_batch=2)
    plan = make_plan(desc, load_hardware("h200"), layout)
    stage = plan["memory_per_rank"]["activations"]["per_stage"][0]
    tokens = layout.micro_batch * desc.seq_len
    assert activation_bytes_per_token(desc, 4) * tokens == pytest.approx(
        stage["per_micro_batch"], rel=1e-12
    )
    work = work_figures(desc, layout, 8 * tokens)  # 8 micro-batches on the one GPU
    assert work["activation_bytes_per_gpu"] == pytest.approx(8 * stage["per_micro_batch"])


def _tp_collectives(rank: int, world: int) -> dict[str, int]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    from orthoptim.train.model import parallelize

    cfg = CONFIGS["tiny"]
    torch.manual_seed(0)
    model = parallelize(GPT(cfg), init_device_mesh("cpu", (world,)))
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1))
    with CommDebugMode() as forward:
        loss = model(idx[:, :-1], idx[:, 1:])
    with CommDebugMode() as backward:
        loss.backward()
    dist.barrier()
    all_reduce = torch.ops.c10d_functional.all_reduce
    return {
        "forward": forward.get_comm_counts()[all_reduce],
        "backward": backward.get_comm_counts()[all_reduce],
        "total": forward.get_total_counts() + backward.get_total_counts(),
    }


def test_tensor_parallel_all_reduces_are_the_ones_dtensor_issues() -> None:
    """Over 2 real gloo ranks, the tensor-parallel GPT's forward issues the plan's
    forward all-reduces and its backward the backward ones, and nothing else; one per split
    linear layer."""
    counted = run_ranks(_tp_collectives, 2)
    (tp,) = work_figures(train_model("tiny"), Layout(dp=1, tp=2), 1024)["collectives"]
    assert tp["kind"] == "all_reduce" and tp["group"] == 2
    for c in counted:
        assert (c["forward"], c["backward"]) == (tp["forward_calls"], tp["backward_calls"])
        assert c["total"] == c["forward"] + c["backward"] == tp["split_linears"]
    (fused,) = work_figures(train_model("tiny-moe"), Layout(dp=1, tp=2), 1024)["collectives"]
    assert fused["backward_calls"] == 2 * CONFIGS["tiny-moe"].n_layer  # qkv and gate/up


def test_no_sequence_length_no_work_figures() -> None:
    """A description without a sequence length (and none given) prices nothing it cannot
    count: the step-time model falls back to the 6·N·D rate."""
    desc = train_model("tiny")
    work = work_figures(replace(desc, seq_len=0), Layout(dp=1), 1024)
    assert work["attention_flops_per_gpu"] == work["activation_bytes_per_gpu"] == 0
