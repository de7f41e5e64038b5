"""MuonClip's QK-clip (Kimi K2): keep attention logits from growing without bound.

After each optimizer step, every attention head h whose largest pre-softmax logit m_h in the
step exceeded τ has its query rows scaled by γ_h^α and its key rows by γ_h^(1−α), with
γ_h = τ / m_h, so the head's logits (bilinear in q and k) shrink by exactly γ_h: the largest
becomes τ. Heads at or below τ are untouched.

Grouped-query attention (one key head shared by g query heads): the shared key head is scaled
by κ = (min_h γ_h)^(1−α) over its group and every query head of the group by γ_h / κ, so each
head's logits still shrink by exactly its own γ_h (1 for heads below τ).

The protocol a model implements (the built-in GPT does):
    `record_attention_logits(on)`  start keeping per-head max logits in training forwards;
    `attention_max_logits()`       {layer: tensor[n_head] or None}, then reset;
    `qk_clip_heads()`              {layer: QKHeads}: where each head's q and k rows live.

Distributed: the max logits seen by each rank are max-reduced first by the reducer QK-clip is
handed (`reduce_max`, by default the distributed optimizer's), and the scaling is applied on
every rank after the optimizer's parameter gather, so all replicas stay equal (the layer-wise
optimizer's fp32 master copy of a weight, when it keeps one, is scaled too).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn


@dataclass(frozen=True)
class QKHeads:
    """Where one attention layer's heads live: head h's query rows are
    `q_weight[q_row0 + h·head_dim : … + head_dim]`, key head j's rows likewise in `k_weight`
    from `k_row0` (q and k may be the same fused weight). Query head h uses key head
    h // (n_head / n_kv_head)."""

    q_weight: str
    k_weight: str
    n_head: int
    n_kv_head: int
    head_dim: int
    q_row0: int = 0
    k_row0: int = 0


def clip_factors(
    max_logits: Tensor, tau: float, alpha: float, n_kv_head: int
) -> tuple[Tensor, Tensor]:
    """(query factor per query head, key factor per key head) for one layer."""
    gamma = (tau / max_logits.double()).clamp(max=1.0)
    gamma = torch.where(torch.isfinite(gamma) & (gamma > 0), gamma, torch.ones_like(gamma))
    group_min = gamma.view(n_kv_head, -1).amin(dim=1)
    k_factor = group_min.pow(1.0 - alpha)
    q_factor = gamma / k_factor.repeat_interleave(gamma.numel() // n_kv_head)
    return q_factor, k_factor


class QKClip:
    """Apply QK-clip after `optimizer.step()`: `clip.step()` returns {"max_logit": the largest
    logit of the step over all heads and ranks, "clipped_heads": how many heads were scaled}.

    `tau` (τ, default 100) is the logit bound; `alpha` the share of the scaling put on the
    queries (0.5: √γ each). `optimizer` (optional) is waited for before the weights are edited
    (a layer-wise optimizer gathers asynchronously) and provides the reducer (its
    `reduce_max`) unless `reduce_max` is given: a function taking the per-head max logits of
    this rank (a CPU float tensor) to their max over every replica. Under an initialised
    process group of more than one rank one of the two is required (replicas that clip apart
    would drift apart). Turns logit recording on in the model.
    """

    def __init__(
        self,
        model: nn.Module,
        tau: float = 100.0,
        alpha: float = 0.5,
        optimizer: torch.optim.Optimizer | None = None,
        reduce_max: Callable[[Tensor], Tensor] | None = None,
    ) -> None:
        if not tau > 0:
            raise ValueError(f"QKClip tau must be > 0, got {tau}")
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"QKClip alpha must be in [0, 1], got {alpha}")
        for method in ("record_attention_logits", "attention_max_logits", "qk_clip_heads"):
            if not callable(getattr(model, method, None)):
                raise TypeError(
                    f"QKClip needs a model with {method}() (see orthoptim.optim.qk_clip's "
                    f"protocol); {type(model).__name__} has none"
                )
        self.model, self.tau, self.alpha, self.optimizer = model, float(tau), alpha, optimizer
        reduce_max = reduce_max or getattr(optimizer, "reduce_max", None)
        if reduce_max is None and dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError(
                "QKClip under a process group of several ranks needs optimizer= (a "
                "LayerwiseDistributedOptimizer or FSDPOptimizer) or reduce_max= (the max of "
                "each head's logit over the replicas), so that every replica clips alike"
            )
        self.reduce_max = reduce_max
        self.heads: dict[str, QKHeads] = dict(model.qk_clip_heads())
        self._check_heads()
        model.record_attention_logits(True)

    def _check_heads(self) -> None:
        named = dict(self.model.named_parameters())
        for layer, h in self.heads.items():
            if h.n_kv_head < 1 or h.n_head % h.n_kv_head:
                raise ValueError(
                    f"{layer}: n_kv_head ({h.n_kv_head}) must divide n_head ({h.n_head})"
                )
            for wname, row0, n in (
                (h.q_weight, h.q_row0, h.n_head),
                (h.k_weight, h.k_row0, h.n_kv_head),
            ):
                w = named.get(wname)
                if w is None:
                    raise ValueError(f"{layer}: qk_clip_heads names {wname!r}, not a parameter")
                if w.ndim != 2 or row0 + n * h.head_dim > w.shape[0]:
                    raise ValueError(
                        f"{layer}: {wname} (shape {tuple(w.shape)}) has no rows "
                        f"[{row0}, {row0 + n * h.head_dim}) for {n} heads of {h.head_dim}"
                    )

    def _gather_max_logits(self) -> dict[str, Tensor]:
        """Per layer, the max logit per head over this step's forwards on every rank."""
        seen = self.model.attention_max_logits()
        layers = list(self.heads)
        flat = torch.cat(
            [
                seen[layer].detach().float().cpu()
                if seen.get(layer) is not None
                else torch.full((self.heads[layer].n_head,), float("-inf"))
                for layer in layers
            ]
        )
        if self.reduce_max is not None:
            flat = self.reduce_max(flat).cpu()
        return dict(zip(layers, flat.split([self.heads[ly].n_head for ly in layers])))

    @torch.no_grad()
    def step(self) -> dict[str, float]:
        """Clip every head whose max logit exceeded τ since the last call. Collective when
        distributed: every rank must call it after the same optimizer step."""
        logits = self._gather_max_logits()
        wait = getattr(self.optimizer, "wait_for_params", None)
        if wait is not None:
            wait()
        named = dict(self.model.named_parameters())
        master = getattr(self.optimizer, "master_weight", lambda name: None)
        clipped = 0
        for layer, m in logits.items():
            h = self.heads[layer]
            over = m > self.tau
            if not bool(over.any()):
                continue
            clipped += int(over.sum())
            q_f, k_f = clip_factors(m, self.tau, self.alpha, h.n_kv_head)
            for wname, row0, factors in ((h.q_weight, h.q_row0, q_f), (h.k_weight, h.k_row0, k_f)):
                for w in (named[wname], master(wname)):
                    if w is None:
                        continue
                    rows = w[row0 : row0 + factors.numel() * h.head_dim]
                    scale = factors.repeat_interleave(h.head_dim).to(w.device, w.dtype)
                    scale = scale.unsqueeze(1)
                    rows.mul_(scale)
        top = max((float(m.max()) for m in logits.values()), default=float("-inf"))
        return {"max_logit": top, "clipped_heads": float(clipped)}
