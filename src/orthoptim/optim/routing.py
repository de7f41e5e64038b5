"""Which optimizer each parameter of a model gets, and why.

`ModelRoute(model)` is the default rule of `build_optimizer`, the layer-wise optimizer and the
FSDP optimizer (one rule, so they route identically). It asks the model first, then looks at
module types, then at names:

1. `get_input_embeddings()` / `get_output_embeddings()` where the model has them (Hugging Face
   models), tied weights included → AdamW. An input module that is not a lookup table (a ViT
   patch convolution) is routed by its shape: it is a dense map over pixels, so Muon.
2. every `nn.Embedding` weight (and anything tied to it) → AdamW.
3. Linear layers named like a head (`HEAD_NAMES`, Hugging Face's `score` and `qa_outputs`
   included) → AdamW. When neither the model nor a name gives a head, the last matrix in
   module order (of two or more; the root's own raw parameters are not ordered) is taken for
   it when it is a Linear outside the repeated blocks and either its output size is an
   `nn.Embedding`'s vocabulary or the model has no `nn.Embedding` (a ResNet's `fc`). Other
   Linears whose output size happens to equal the vocabulary stay matrices.
4. vectors → AdamW: fewer than 2 dims, or one dim > 1 (a `(1, 1, d)` class token).
5. raw `nn.Parameter` tables (not a torch layer's weight: registered on a user module, a
   plain `nn.Module()`, an `nn.ParameterDict` or `nn.ParameterList`) named like an embedding,
   positional table or unembedding (`pos_emb`, `W_E`, `W_pos`, `W_U`, `position_embeddings`)
   → AdamW, as are raw biases (`b_Q`, `*bias*`) and a raw 3-D parameter with a leading 1
   (a table broadcast over the batch).
6. 3-D parameters: an expert stack [E, out, in] only when the model says so (its
   `expert_params()` lists the name, or a part of the name starts with "expert"); other 3-D
   weights (TransformerLens' per-head `W_Q`) go to Muon one slice at a time, but are never
   split across ranks as experts; a `Conv1d` weight [out, in, k] goes to AdamW (Muon's matrix
   view would take it for `out` matrices).
7. every other matrix (2-D, and ≥4-D conv weights seen as (out, in·k…)) → the matrix optimizer.

`explain_routing(model)` prints each parameter, its shape, where it goes and why, and marks
the weights stored [in, out] (`stored_in_out`: Hugging Face's `Conv1D`), which Muon steps as
their [out, in] transpose.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

from torch import nn

from orthoptim._validate import check_choice
from orthoptim.optim.registry import OPTIMIZER_NAMES, OptimizerName

HEAD_NAMES = frozenset(
    {"lm_head", "head", "output", "output_layer", "classifier", "unembed", "score", "qa_outputs"}
)
# Names of raw-parameter tables; matched against the last part of the name, lower-cased.
TABLE_NAME = re.compile(r"emb|^w_?(e|pos|u)$|^wte$|^wpe$|(^|_)pos(_|$)|(^|_)(cls|class)_token$")
BIAS_NAME = re.compile(r"^b_|bias")  # per-head biases such as TransformerLens' b_Q [heads, d]
_CONTAINERS = (nn.ModuleList, nn.ModuleDict)
_CONVS = (nn.Conv1d, nn.ConvTranspose1d)


@dataclass(frozen=True)
class Decision:
    """Where one parameter goes: `matrix` (True: the matrix optimizer), `reason` (one line),
    `expert` (a 3-D expert stack whose slices may be owned by different ranks)."""

    matrix: bool
    reason: str
    expert: bool = False


@dataclass(frozen=True)
class RoutingRow:
    """One row of `explain_routing`: parameter name, shape, optimizer ("muon", "soap",
    "adamw", or "-" for a frozen parameter), the reason, and whether the weight is stored
    [in, out] (`stored_in_out`)."""

    name: str
    shape: tuple[int, ...]
    optimizer: str
    reason: str
    in_out: bool = False


def _is_in_out_layer(module: nn.Module) -> bool:
    """Hugging Face's `transformers.pytorch_utils.Conv1D` (known by name: transformers is not
    imported for it), whose weight is [in, out] and whose forward is x·W + b."""
    cls = type(module)
    return cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers")


def stored_in_out(model: nn.Module) -> frozenset[str]:
    """Names of the 2-D weights `model` stores as [in, out] rather than torch's [out, in]:
    those of Hugging Face `Conv1D` layers (GPT-2's c_attn, c_fc, c_proj). Shapes read by
    LR scales are those of the map, [out, in] (`Muon(transposed=...)`)."""
    ids = {
        id(m.weight)
        for m in model.modules()
        if _is_in_out_layer(m) and isinstance(getattr(m, "weight", None), nn.Parameter)
    }
    return frozenset(n for n, p in model.named_parameters() if id(p) in ids and p.ndim == 2)


def _asked(model: nn.Module, method: str) -> nn.Module | None:
    """`model.<method>()` when the model has it and answers with a module, else None."""
    fn = getattr(model, method, None)
    if not callable(fn):
        return None
    try:
        module = fn()
    except (NotImplementedError, AttributeError):
        return None
    return module if isinstance(module, nn.Module) else None


def _in_blocks(model: nn.Module, module_name: str) -> bool:
    """Whether module `module_name` sits inside a ModuleList/ModuleDict (repeated blocks)."""
    parts = module_name.split(".")
    return any(
        isinstance(model.get_submodule(".".join(parts[:i])), _CONTAINERS)
        for i in range(1, len(parts))
    )


# torch modules that hold parameters without being a layer: what they hold is raw
_HOLDERS = (nn.Module, nn.ParameterDict, nn.ParameterList, nn.ModuleDict, nn.ModuleList)


def _is_raw(owner: nn.Module) -> bool:
    """Whether a parameter registered on `owner` is a raw `nn.Parameter` (not the weight of a
    torch layer): on a user module, a plain `nn.Module()` or an `nn.ParameterDict` / `List`."""
    return type(owner) in _HOLDERS or not type(owner).__module__.startswith("torch.nn")


class ModelRoute:
    """The default routing rule of `model`: `route(name, param)` is True for the matrix
    optimizer, False for AdamW; `decision(name, param)` adds the reason and whether the
    parameter is an expert stack. Decisions are made once, at construction (see the module
    docstring for the rules)."""

    def __init__(self, model: nn.Module) -> None:
        self._fixed: dict[int, str] = {}  # id(param) → reason it goes to AdamW
        self._owner: dict[int, nn.Module] = {}
        self._declared_experts = self._expert_declaration(model)
        for module in model.modules():
            for p in module.parameters(recurse=False):
                self._owner.setdefault(id(p), module)
        self._input_module = _asked(model, "get_input_embeddings")
        inputs = self._input_module.modules() if self._input_module is not None else ()
        self._input_ids = {id(m) for m in inputs}
        self._find_heads(model, declared=self._find_embeddings(model))

    @staticmethod
    def _expert_declaration(model: nn.Module) -> frozenset[str]:
        spec = getattr(model, "expert_params", None)
        return frozenset(spec()) if callable(spec) else frozenset()

    def _fix(self, p: nn.Parameter, reason: str) -> None:
        self._fixed.setdefault(id(p), reason)

    def _find_embeddings(self, model: nn.Module) -> bool:
        """Fix the model's embedding tables to AdamW; True when the model declared its head."""
        if isinstance(self._input_module, nn.Embedding):
            self._fix(self._input_module.weight, "input embedding (model.get_input_embeddings())")
        out = _asked(model, "get_output_embeddings")
        weight = getattr(out, "weight", None)
        declared = isinstance(weight, nn.Parameter)
        if declared:
            tied = id(weight) in self._fixed
            self._fixed[id(weight)] = (
                "input embedding tied to the output head (get_output_embeddings())"
                if tied
                else "output head (model.get_output_embeddings())"
            )
        for module in model.modules():
            if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
                self._fix(module.weight, "nn.Embedding (a lookup table)")
        return declared

    def _find_heads(self, model: nn.Module, declared: bool) -> None:
        """Fix the output head(s) to AdamW: named ones, else the last Linear (rule 3)."""
        linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        found = declared
        for name, m in linears:
            if name.rsplit(".", 1)[-1] in HEAD_NAMES:
                self._fix(m.weight, f"output head (a Linear named {name.rsplit('.', 1)[-1]!r})")
                found = True
        if found:
            return
        # Matrices in module order. The root's own parameters are left out: torch lists them
        # before every submodule's, wherever the forward uses them.
        submodules = list(model.modules())[1:]
        matrices = [p for m in submodules for p in m.parameters(recurse=False) if p.ndim >= 2]
        if len(matrices) < 2:  # a lone Linear is the model's input layer as much as its head
            return
        last = matrices[-1]
        vocab = {m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)}
        for name, m in linears:
            if m.weight is not last or _in_blocks(model, name):
                continue
            if m.out_features in vocab:
                why = "with the vocabulary's output size"
            elif not vocab:
                why = "in a model without embeddings (a classifier)"
            else:
                continue
            self._fix(last, f"output head: the last matrix of the model, a Linear {why}")

    def _is_expert(self, name: str, p: nn.Parameter) -> bool:
        if p.ndim != 3:
            return False
        return name in self._declared_experts or any(
            part.lower().startswith("expert") for part in name.split(".")
        )

    def decision(self, name: str, p: nn.Parameter) -> Decision:
        """Where parameter `name` goes and why."""
        fixed = self._fixed.get(id(p))
        if fixed is not None:
            return Decision(False, fixed)
        if p.ndim < 2:
            return Decision(False, "vector (bias, norm gain, scalar)")
        if sum(d > 1 for d in p.shape) < 2:
            return Decision(False, f"one vector in a {p.ndim}-D shape (a token, a 1-wide layer)")
        owner = self._owner.get(id(p))
        raw = owner is not None and _is_raw(owner)
        last = name.rsplit(".", 1)[-1].lower()
        if raw and TABLE_NAME.search(last):
            return Decision(False, "raw parameter named like an embedding / positional table")
        if raw and BIAS_NAME.search(last):
            return Decision(False, "raw parameter named like a bias")
        if self._is_expert(name, p):
            how = "model.expert_params()" if name in self._declared_experts else "its name"
            return Decision(True, f"3-D expert stack [E, out, in] (declared by {how})", True)
        if p.ndim == 3 and isinstance(owner, _CONVS):
            return Decision(False, "Conv1d weight [out, in, k]: 3-D but not an expert stack")
        if p.ndim == 3 and raw and p.shape[0] == 1:
            return Decision(False, "raw 3-D parameter with a leading 1: a table over the batch")
        if p.ndim == 3:
            return Decision(True, "3-D weight, one matrix per slice (not an expert stack)")
        if id(owner) in self._input_ids:
            return Decision(
                True, "input convolution (get_input_embeddings()): a dense map over pixels"
            )
        if p.ndim >= 4:
            return Decision(True, "conv weight, seen as one (out, in·k…) matrix")
        return Decision(True, "hidden matrix")

    def is_expert(self, name: str, p: nn.Parameter) -> bool:
        """Whether `name` is an expert stack the layer-wise optimizer may split by expert."""
        return self.decision(name, p).expert

    def __call__(self, name: str, p: nn.Parameter) -> bool:
        return self.decision(name, p).matrix


RoutePredicate = Callable[[str, nn.Parameter], bool]


def explain_routing(
    model: nn.Module,
    optimizer: OptimizerName = "muon",
    route: RoutePredicate | None = None,
    file: TextIO | None = None,
    quiet: bool = False,
    **build_kwargs: Any,
) -> list[RoutingRow]:
    """Each parameter of `model`, its shape, where `build_optimizer(model, optimizer, route=...)`
    sends it, and why; printed as a table to `file` (default stdout) unless `quiet`.

    Takes `build_optimizer`'s keyword arguments so a call can be copied; only `optimizer`,
    `route` and `elementwise` (the non-matrix part's optimizer, "adamw" or "lion") change the
    table. A tied parameter is listed once, under its first name.
    """
    check_choice("optimizer", optimizer, sorted(OPTIMIZER_NAMES))
    rest = build_kwargs.get("elementwise", "adamw")
    default = ModelRoute(model)
    in_out = stored_in_out(model)
    rows = []
    for name, p in model.named_parameters():
        shape = tuple(p.shape)
        if not p.requires_grad:
            rows.append(RoutingRow(name, shape, "-", "frozen (requires_grad=False): left out"))
            continue
        if optimizer == "adamw":
            to, reason = "adamw", "optimizer='adamw': AdamW for all"
        elif route is not None:
            to, reason = (optimizer if route(name, p) else rest), "route= override"
        else:
            d = default.decision(name, p)
            to, reason = (optimizer if d.matrix else rest), d.reason
        flipped = name in in_out and to == optimizer and optimizer != "adamw"
        if flipped:
            reason += "; stored [in, out] (Conv1D): LR-scaled as its [out, in] map"
        rows.append(RoutingRow(name, shape, to, reason, flipped))
    if not quiet:
        print(format_routing(rows), file=file if file is not None else sys.stdout)
    return rows


def format_routing(rows: list[RoutingRow]) -> str:
    """The table `explain_routing` prints: name, shape, optimizer, reason."""
    shapes = ["×".join(map(str, r.shape)) or "scalar" for r in rows]
    wn = max([len("parameter"), *(len(r.name) for r in rows)])
    ws = max([len("shape"), *map(len, shapes)])
    lines = [f"{'parameter':<{wn}}  {'shape':<{ws}}  {'optimizer':<9}  reason"]
    for r, s in zip(rows, shapes):
        lines.append(f"{r.name:<{wn}}  {s:<{ws}}  {r.optimizer:<9}  {r.reason}")
    return "\n".join(lines)
