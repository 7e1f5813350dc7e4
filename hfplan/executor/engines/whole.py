"""The single-stage mode of a RoleModel (pp = 1): every rank runs the whole model.

Forward calls run the contract's micro-batches one after another; a training step runs forward and
backward per micro-batch, accumulating gradients and summing each micro-batch's statistics, and clips
by the norm of the model's (DTensor) gradients (hfplan.executor.engines.grad_norm).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from hfplan.executor import sequences
from hfplan.executor.engines import forward
from hfplan.executor.engines.forward import Readout
from hfplan.executor.engines.grad_norm import clip_by_norm, squared_grad_norm
from hfplan.executor.engines.modules import decoder_layers
from hfplan.executor.engines.stages import Batch, Objective


class WholeModel:
    """Stages of a pipeline of one: the model itself, first and last."""

    pp = 1
    last = True
    names = None  # the module's parameter names are the HF model's
    buffer_names = None

    def split(self, model: nn.Module, device: torch.device) -> nn.Module:
        return model

    def layers(self, module: nn.Module) -> list[nn.Module]:
        return decoder_layers(module)

    def roots(self, module: nn.Module) -> list[nn.Module]:
        return [module]

    @contextlib.contextmanager
    def named(self, what: str) -> Iterator[None]:
        yield

    def forward(self, module: nn.Module, readout: Readout, prompts: torch.Tensor, responses: torch.Tensor,
                response_mask: torch.Tensor, micro_batch: int, pad_id: int) -> torch.Tensor:
        args = (module, prompts, responses, response_mask, pad_id)
        if readout.kind == "log_probs":
            return forward.token_log_probs(*args, readout.temperature, micro_batch=micro_batch)
        if readout.kind == "values":
            return forward.token_values(*args, micro_batch=micro_batch)
        return forward.sequence_scores(*args, micro_batch=micro_batch)

    def accumulate(self, module: nn.Module, batch: Batch, micro_batch: int, readout: Readout,
                   objective: Objective, tokens: torch.Tensor, pad_id: int) -> dict[str, torch.Tensor]:
        """Forward and backward of each micro-batch; the statistics summed over them."""
        totals: dict[str, torch.Tensor] = {}
        for part in forward.micro_batches(batch["response_mask"].shape[0], micro_batch):
            mb = {k: v[part] for k, v in batch.items()}
            joined = sequences.join(mb["prompts"], mb["responses"], mb["response_mask"], pad_id)
            loss, stats = objective(forward.read(module, readout, joined, mb["responses"]), mb, tokens)
            loss.backward()
            for name, value in stats.items():
                totals[name] = totals.get(name, 0.0) + value.detach().to(torch.float32)
        return totals

    def clip_grad_norm(self, module: nn.Module, max_norm: float) -> float:
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        norm = float(squared_grad_norm(grads).sqrt())
        clip_by_norm(grads, norm, max_norm)
        return norm

    def names_from_last(self, names: list[str]) -> list[str]:
        return names

    def from_last(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def generation_weights(self, engine) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The engine's FSDP groups unsharded (until `release_generation`): its parameters and buffers by HF name,
        tensor-parallel DTensors still shards."""
        engine.unshard()
        module = engine.module
        return ({n: p.detach() for n, p in module.named_parameters(remove_duplicate=False)},
                dict(module.named_buffers(remove_duplicate=False)))

    def release_generation(self, engine) -> None:
        engine.reshard()

    def full_weights(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """Every parameter whole, on the CPU, on rank 0 (a collective over the model's ranks)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
