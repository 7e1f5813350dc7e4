"""The manual split of an HF decoder model into pipeline stages (hfplan.layout.stage_params' rule).

A pipeline of pp ranks with v virtual stages cuts the model into n = pp * v stages (torch.distributed.
pipelining's word for a model chunk) of equal layers: stage s of n holds the decoder layers
[s * L/n, (s+1) * L/n), stage 0 also the embedding, the last stage the final norm and the head (the LM
head, or the scalar head of a critic, reward or cost model). Rank r holds the stages r, r + pp,
r + 2 pp, ... (`rank_stages`, the stage-to-rank rule of torch's looped schedules); with v = 1 the
stage of rank r is r. Each stage runs its layers as the whole model's forward does (`lean.layers_output`
where it runs, else the model's own backbone `forward` over them, with the architecture's own masks and
rotary embeddings), and passes on the tuple

    (hidden states, input ids, attention mask, position ids)

stage 0 starts from (input ids, attention mask, position ids). The ids travel with the activations so
that the last stage reads its output itself (`Readout`): the response tokens' log-probs (and entropies),
the values before each response token, or a sequence's score at its last real token.
"""

from __future__ import annotations

import copy
import re

import torch
from torch import nn

from hfplan.executor import sequences
from hfplan.executor.engines import forward, lean
from hfplan.executor.engines.forward import Readout
from hfplan.executor.engines.modules import HEADS

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def rank_stages(rank: int, pp: int, virtual_stages: int) -> list[int]:
    """The stages pipeline rank `rank` of `pp` holds, `virtual_stages` of them, in pipeline order."""
    return [rank + k * pp for k in range(virtual_stages)]


def stage_layers(num_layers: int, stages: int, stage: int) -> range:
    if num_layers % stages:
        raise ValueError(f"{stages} pipeline stages do not split {num_layers} layers equally")
    per = num_layers // stages
    return range(stage * per, (stage + 1) * per)


def stage_of(name: str, num_layers: int, stages: int) -> int:
    """The stage holding an HF model's parameter or buffer `name` (rotary tables: every stage; -1)."""
    match = _LAYER.match(name)
    if match:
        return int(match.group(1)) // (num_layers // stages)
    if name.startswith("model.embed_tokens."):
        return 0
    if name.startswith(("model.norm.", *(f"{head}." for head in HEADS))):
        return stages - 1
    if name.startswith("model.rotary_emb."):
        return -1
    raise ValueError(f"parameter {name} belongs to no pipeline stage")


def stage_names(model: nn.Module, stages: int) -> list[list[str]]:
    """The HF parameter names of each stage, in the model's order (tied names each on their own stage)."""
    layers = model.config.num_hidden_layers
    out: list[list[str]] = [[] for _ in range(stages)]
    for name, _ in model.named_parameters(remove_duplicate=False):
        out[stage_of(name, layers, stages)].append(name)
    return out


class Stage(nn.Module):
    """One pipeline stage of an HF `<Arch>ForCausalLM` or `<Arch>ForTokenClassification` model."""

    def __init__(self, backbone: nn.Module, head: nn.Module | None, first: bool, last: bool) -> None:
        super().__init__()
        self.backbone, self.head, self.first, self.last = backbone, head, first, last
        self.readout: Readout | None = None  # set before each schedule run

    @property
    def layers(self) -> list[nn.Module]:
        return list(self.backbone.layers)

    def forward(self, *inputs: torch.Tensor):
        if self.first:
            (input_ids, attention_mask, position_ids), hidden = inputs, None
        else:
            hidden, input_ids, attention_mask, position_ids = inputs
        joined = sequences.Joined(input_ids, attention_mask, position_ids, 0)
        if lean.runs_backbone(self.backbone, joined):
            if self.first:
                hidden = self.backbone.embed_tokens(input_ids)
            hidden = self.backbone.norm(lean.layers_output(self.backbone, hidden, joined))
        else:
            hidden = self.backbone(input_ids=input_ids if self.first else None, inputs_embeds=hidden,
                                   attention_mask=attention_mask, position_ids=position_ids,
                                   use_cache=False).last_hidden_state
        if not self.last:
            return hidden, input_ids, attention_mask, position_ids
        return self._read(hidden, joined)

    def _read(self, hidden: torch.Tensor, joined: sequences.Joined):
        spec = self.readout
        if spec is None:
            raise RuntimeError("pipeline stage run without a readout")
        input_ids, length = joined.input_ids, joined.input_ids.shape[1]
        if spec.kind == "log_probs":  # the head over the last R + 1 positions only, as forward.response_log_probs
            logits = self.head(hidden[:, length - spec.response_len - 1:])
            log_probs, entropy = forward.window_log_probs(logits, input_ids[:, length - spec.response_len:],
                                                          spec.temperature, with_entropy=spec.with_entropy,
                                                          entropy_grad=spec.entropy_grad)
            return (log_probs, entropy) if spec.with_entropy else log_probs
        per_position = self.head(hidden).squeeze(-1)
        if spec.kind == "values":
            return sequences.response_predictions(per_position, length - spec.response_len, spec.response_len).float()
        return per_position.float().gather(1, sequences.last_token_index(joined).unsqueeze(1)).squeeze(1)


class RankStages(nn.Module):
    """The stages one pipeline rank holds (`.stages`, in pipeline order): what its optimizer steps and its
    checkpoint saves."""

    def __init__(self, stages: list[Stage]) -> None:
        super().__init__()
        self.stages = nn.ModuleList(stages)

    @property
    def layers(self) -> list[nn.Module]:
        return [layer for stage in self.stages for layer in stage.layers]

    @property
    def embedding(self) -> nn.Module:
        """The embedding (on the rank holding stage 0)."""
        return self.stages[0].backbone.embed_tokens

    @property
    def head(self) -> nn.Module:
        """The head (on the rank holding the last stage)."""
        return self.stages[-1].head

    def set_readout(self, readout: Readout) -> None:
        for stage in self.stages:
            stage.readout = readout


def own_children(module: nn.Module) -> nn.Module:
    """A copy of `module` sharing its children, parameters, buffers and config but with registries of its
    own: replacing a child of the copy leaves the original's in place (a deep copy whose memo maps each of
    those to itself, so only the containers and plain attributes are copied)."""
    shared = [*module.children(), *module.parameters(recurse=False), *module.buffers(recurse=False),
              getattr(module, "config", None)]
    return copy.deepcopy(module, memo={id(item): item for item in shared if item is not None})


def _stage(model: nn.Module, stage: int, stages: int) -> Stage:
    config, backbone = model.config, own_children(model.model)
    ids = stage_layers(config.num_hidden_layers, stages, stage)
    first, last = stage == 0, stage == stages - 1
    backbone.layers = nn.ModuleList([model.model.layers[i] for i in ids])
    stage_config = copy.copy(config)  # the backbone's forward reads num_hidden_layers and layer_types by position
    stage_config.num_hidden_layers = len(ids)
    if getattr(config, "layer_types", None) is not None:
        stage_config.layer_types = [config.layer_types[i] for i in ids]
    backbone.config = stage_config
    if not first:
        backbone.embed_tokens = None
    if not last:
        backbone.norm = nn.Identity()
    head = next(getattr(model, name) for name in HEADS if hasattr(model, name)) if last else None
    return Stage(backbone, head, first, last)


def split_model(model: nn.Module, stages: list[int], total: int) -> tuple[RankStages, dict[str, str], dict[str, str]]:
    """This rank's `stages` of `total` of `model` (which it takes apart: use only the stages afterwards),
    and the HF names of their parameters and buffers (RankStages name -> HF name)."""
    owned = {name for stage in stages for name in stage_names(model, total)[stage]}
    hf_params = {id(p): n for n, p in model.named_parameters(remove_duplicate=False) if n in owned}
    hf_buffers = {id(b): n for n, b in model.named_buffers(remove_duplicate=False)}
    module = RankStages([_stage(model, stage, total) for stage in stages])
    model.model.layers = nn.ModuleList()  # the layers now live in the stages (others are freed with the model)
    params = {n: hf_params[id(p)] for n, p in module.named_parameters(remove_duplicate=False)}
    buffers = {n: hf_buffers[id(b)] for n, b in module.named_buffers(remove_duplicate=False)}
    if sorted(params.values()) != sorted(owned):
        raise ValueError(f"stages {stages}: split holds {sorted(params.values())}, the rule says {sorted(owned)}")
    return module, params, buffers
