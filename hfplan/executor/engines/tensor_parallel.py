"""Tensor parallelism of an HF Llama / Qwen2 / Mistral model with DTensor, Megatron style.

In every decoder layer the q, k, v, gate and up projections are split column-wise (a rank holds
heads / tp query heads, kv_heads / tp KV heads and ffn / tp MLP columns) and o and down row-wise
(their partial outputs summed over the tensor-parallel group). The token embedding is
vocabulary-parallel (rows split, each rank looks up its own ids, the lookups summed); the LM head is
vocabulary-parallel too, its logits gathered whole on every rank, because the losses and sampling
read whole rows of logits (a vocabulary-parallel loss would save that gather; not done here).
An inference-only model may run with tp a multiple of its KV heads: each KV head is first copied
tp / kv_heads times (the same grouped-query attention, with kv_heads = tp), so every rank holds one.
Every other parameter (norms, a scalar head) becomes a replicated DTensor on the same mesh, so that
all parameters live on one mesh: FSDP2 composes over them uniformly and `clip_grad_norm_` sees one
mesh. Activations between modules stay plain tensors, identical on every rank of the group.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from hfplan.layout import kv_head_copies

_COLUMNS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
_ROWS = ("self_attn.o_proj", "mlp.down_proj")


def _plan(model: nn.Module) -> dict[str, object]:
    """The plan of every module the model has by its HF name (a pipeline stage may lack the embedding,
    the head or some layers)."""
    plan: dict[str, object] = {}
    for name, _ in model.named_modules():
        if name.endswith(_COLUMNS):
            plan[name] = ColwiseParallel()
        elif name.endswith(_ROWS):
            plan[name] = RowwiseParallel()
        elif name == "model.embed_tokens":
            plan[name] = RowwiseParallel(input_layouts=Replicate())
        elif name == "lm_head":
            plan[name] = ColwiseParallel(output_layouts=Replicate())
    if not any(name.endswith(_COLUMNS) for name in plan):
        raise ValueError(f"{type(model).__name__}: no attention or MLP projections to split (an HF decoder's "
                         "model.layers.N.self_attn / .mlp)")
    return plan


def _replicate_params(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for key, param in list(module.named_parameters(recurse=False)):
        if not isinstance(param, DTensor):
            module.register_parameter(key, nn.Parameter(distribute_tensor(param.data, mesh, [Replicate()]),
                                                        requires_grad=param.requires_grad))


def _inputs_replicated(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False) if _plain_tensor(x) else x
                 for x in inputs)


def _outputs_local(module: nn.Module, outputs, mesh: DeviceMesh):
    return outputs.to_local() if isinstance(outputs, DTensor) else outputs


def _plain_tensor(value) -> bool:
    return isinstance(value, torch.Tensor) and not isinstance(value, DTensor)


def _copy_kv_heads(model: nn.Module, copies: int) -> None:
    """Repeat each KV head `copies` times in place (query head j still reads original head j // groups)."""
    config = model.config
    for layer in model.model.layers:
        attn = layer.self_attn
        for name in ("k_proj", "v_proj"):
            old = getattr(attn, name)
            new = nn.Linear(old.in_features, old.out_features * copies, bias=old.bias is not None,
                            device=old.weight.device, dtype=old.weight.dtype)
            with torch.no_grad():
                new.weight.copy_(old.weight.view(-1, attn.head_dim, old.in_features)
                                 .repeat_interleave(copies, dim=0).reshape(new.weight.shape))
                if old.bias is not None:
                    new.bias.copy_(old.bias.view(-1, attn.head_dim).repeat_interleave(copies, dim=0).reshape(-1))
            new.requires_grad_(old.weight.requires_grad)
            setattr(attn, name, new)
        attn.num_key_value_groups //= copies
    config.num_key_value_heads *= copies


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, *, copy_kv_heads: bool = False) -> nn.Module:
    """Split `model` (an HF Llama / Qwen2 / Mistral causal LM or token classifier, plain tensors) over
    the 1-D `tp_mesh` in place, as the module docstring says; returns it. tp must divide the heads,
    the MLP width, the vocabulary and the KV heads, or with `copy_kv_heads` (inference only: copies
    would drift apart in training) be a multiple of the KV heads: hfplan.layout.unsupported_layout's rule,
    which the caller checks (training.check_layout)."""
    if tp_mesh.ndim != 1:
        raise ValueError(f"tensor parallelism needs a 1-D mesh, got {tp_mesh.ndim} dims")
    config = model.config
    tp = tp_mesh.size()
    copies = kv_head_copies(config.num_key_value_heads, tp) if copy_kv_heads else 1
    if copies > 1:
        _copy_kv_heads(model, copies)
    tied = (bool(getattr(config, "tie_word_embeddings", False)) and getattr(model, "lm_head", None) is not None
            and getattr(model.model, "embed_tokens", None) is not None)
    parallelize_module(model, tp_mesh, _plan(model))
    if tied:  # both split the [V, H] table by rows (Shard(0)): one parameter again
        model.lm_head.weight = model.model.embed_tokens.weight
    for module in list(model.modules()):
        if any(not isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            distribute_module(module, tp_mesh, _replicate_params, input_fn=_inputs_replicated,
                              output_fn=_outputs_local)
    return model
