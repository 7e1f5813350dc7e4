"""torch.compile (inductor, CPU) against eager for the actor's log-prob forward and its update, on one torch thread.

The actor of `arith-grpo` as the executor builds it on one CPU process (build_model, the training engine's
RoleModel: fp32, fused AdamW, no FSDP2 on one rank), over bench/lean_forward.py's batch of arith-grpo's shape (32
sequences of 8 prompt and 4 response tokens, some prompts left-padded, some responses ended early; every
iteration of the workload has this shape: prompts are padded to prompt_len and responses to max_new_tokens):
- `log-prob forward`: forward.response_log_probs without grad (hfplan's lean forward, log_softmax and gather);
- `update`: one optimizer step as the engine takes it (zero the gradients, the readout and the actor's loss with
  its KL term, backward, clip by the global norm, fused AdamW); the eager row is RoleModel.update_actor itself,
  the compiled row runs the same parts with the readout and the loss compiled as one function (its backward
  compiled by AOTAutograd) and the engine's fused AdamW step as it is (torch.compile of the fused step makes no
  graph: dynamo leaves it to eager).

For each of `dynamic=False` and `dynamic=True` (a phase each, dynamo's caches reset between them): the first call's
wall and CPU seconds (the compile; inductor keeps what it compiled on disk, in /tmp/torchinductor_$USER or
$TORCHINDUCTOR_CACHE_DIR, so a later process compiles from that cache: point it at an empty folder for a first
run's cost), then --rounds alternating rounds of --calls calls, eager and compiled, CPU ms per call
(median over the rounds) and eager / compiled. Then the recompiles a change of shape costs (one response token
fewer, and one more) and whether the compiled outputs equal eager's to the bit. Asserts nothing about time.

    python bench/compile_step.py [--rounds N] [--calls N]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch
from lean_forward import RESPONSE, tensors  # bench/ is the script's folder, hence on sys.path
from rounds import alternate

from hfplan.executor import sequences
from hfplan.executor.engines import forward, losses
from hfplan.executor.engines.forward import Readout
from hfplan.executor.engines.training import RoleModel
from hfplan.executor.local import single_process_world
from hfplan.executor.mesh import ParallelDims
from hfplan.executor.models import build_model
from hfplan.hyperparams import Hyperparameters

MODEL = "tiny-arith"
LR = 3e-3  # arith-grpo's actor_lr
Batch = dict[str, torch.Tensor]


def actor() -> RoleModel:
    """The actor as the executor builds it on one CPU rank."""
    model = build_model(MODEL, "lm", seed=0, dtype=torch.float32)
    return RoleModel(model, ParallelDims(1, 1, 1, 1).build("cpu"), Hyperparameters(), "cpu", torch.float32,
                     pad_id=0, lr=LR)


def update_batch(role: RoleModel, response: int) -> Batch:
    """An update's batch: lean_forward's sequences (cut to `response` tokens), the model's own log-probs as the old
    and the reference ones, random advantages."""
    prompts, responses, mask = tensors(role.config.vocab_size)
    extra = max(response - RESPONSE, 0)  # columns past every response's end
    responses = torch.cat([responses, responses.new_zeros(responses.shape[0], extra)], dim=1)[:, :response]
    mask = torch.cat([mask, mask.new_zeros(mask.shape[0], extra)], dim=1)[:, :response]
    log_probs = role.log_probs(prompts, responses, mask, micro_batch=prompts.shape[0])
    advantages = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1)) * mask
    return {"prompts": prompts, "responses": responses, "response_mask": mask, "old_log_probs": log_probs,
            "ref_log_probs": log_probs, "advantages": advantages}


def readout(role: RoleModel, batch: Batch) -> Readout:
    """The actor update's readout (RoleModel.update_actor's)."""
    return Readout("log_probs", batch["responses"].shape[1], role.hp.temperature, with_entropy=True,
                   entropy_grad=role.hp.entropy_coef > 0)


def log_probs(module, joined: sequences.Joined, responses: torch.Tensor, temperature: float) -> torch.Tensor:
    return forward.response_log_probs(module, joined, responses, temperature)[0]


def actor_loss(module, out: Readout, joined: sequences.Joined, batch: Batch, tokens: torch.Tensor,
               hp: Hyperparameters) -> tuple[torch.Tensor, torch.Tensor]:
    """(the actor's loss with its KL term, the log-probs it read): WholeModel.accumulate's forward and objective."""
    log_probs, entropy = forward.read(module, out, joined, batch["responses"])
    return losses.actor_objective(log_probs, entropy, batch, tokens, hp, use_kl_loss=True)[0], log_probs


def compiled_update(role: RoleModel, batch: Batch, loss_fn: Callable) -> Callable[[], torch.Tensor]:
    """RoleModel._step's parts (one micro-batch) with the loss function given."""
    joined = sequences.join(batch["prompts"], batch["responses"], batch["response_mask"], role.pad_id)
    out = readout(role, batch)

    def run() -> torch.Tensor:
        tokens = batch["response_mask"].sum().to(torch.float32).clamp(min=1.0)
        role.optimizer.zero_grad(set_to_none=True)
        loss, log_probs = loss_fn(role.module, out, joined, batch, tokens, role.hp)
        loss.backward()
        role.stages.clip_grad_norm(role.module, role.hp.max_grad_norm)
        role.optimizer.step()
        return log_probs.detach()

    return run


def inference_call(role: RoleModel, batch: Batch, fn: Callable) -> Callable[[], torch.Tensor]:
    joined = sequences.join(batch["prompts"], batch["responses"], batch["response_mask"], role.pad_id)

    def run() -> torch.Tensor:
        with role.inference() as module:
            return fn(module, joined, batch["responses"], role.hp.temperature)

    return run


def graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def first_call(fn: Callable[[], object]) -> str:
    """The wall and CPU seconds of the first call and the graphs it compiled, in words."""
    before, start, cpu = graphs(), time.perf_counter(), time.process_time()
    fn()
    return (f"first call {time.perf_counter() - start:.1f} s wall, {time.process_time() - cpu:.1f} s CPU "
            f"({graphs() - before} graphs)")


def phase(dynamic: bool, rounds: int, calls: int) -> None:
    """Eager against compiled with `dynamic`, from fresh caches, on fresh actors of the same weights."""
    torch._dynamo.reset()
    def compile_(fn: Callable) -> Callable:
        return torch.compile(fn, dynamic=dynamic)

    eager_role, role = actor(), actor()
    batch = update_batch(eager_role, RESPONSE)
    rows = batch["prompts"].shape[0]
    forward_fns = {"eager": inference_call(eager_role, batch, log_probs),
                   "compiled": inference_call(role, batch, compile_(log_probs))}
    update_fns = {
        "eager": lambda: eager_role.update_actor(batch, mini_batches=1, epochs=1, micro_batch=rows, use_kl_loss=True),
        "compiled": compiled_update(role, batch, compile_(actor_loss))}
    print(f"dynamic={dynamic}")
    for name, fns in (("log-prob forward", forward_fns), ("update", update_fns)):
        print(f"  {name} compiled: {first_call(fns['compiled'])}")
        for fn in fns.values():
            fn()  # warm-up
        ms = alternate(fns, rounds, calls)
        print(f"  {name:<17} eager {ms['eager']:6.2f} ms  compiled {ms['compiled']:6.2f} ms  "
              f"eager/compiled {ms['eager'] / ms['compiled']:.2f}x")
    for response in (RESPONSE - 1, RESPONSE + 1):
        other = update_batch(eager_role, response)
        print(f"  then {response} response tokens: log-prob forward "
              f"{first_call(inference_call(role, other, compile_(log_probs)))}")


def reference() -> RoleModel:
    """The reference as the executor builds it: the actor's initial weights, forward-only."""
    return RoleModel(build_model(MODEL, "lm", seed=0, dtype=torch.float32), ParallelDims(1, 1, 1, 1).build("cpu"),
                     Hyperparameters(), "cpu", torch.float32, pad_id=0)


def exactness() -> None:
    """Bitwise agreement where the weights agree (the first update): the actor's training forward (grad on, the
    update's readout), eager and compiled, against the log-prob forward, eager and compiled, of the actor itself
    and of the reference (a forward-only copy, its parameters not requiring grad), and of a reference whose head
    weight requires grad (aten's matmul folds the head's non-contiguous input into one matrix product only when the
    weight requires grad), over the batch and the one with a response token fewer."""
    torch._dynamo.reset()
    role, ref, ref_head = actor(), reference(), reference()
    ref_head.module.lm_head.weight.requires_grad_(True)
    train_loss, infer = torch.compile(actor_loss), torch.compile(log_probs)
    print("bitwise agreement of log-probs at real response tokens, the actor's training forward against a "
          "log-prob forward, same weights:")
    for response in (RESPONSE, RESPONSE - 1):
        batch = update_batch(role, response)
        joined = sequences.join(batch["prompts"], batch["responses"], batch["response_mask"], role.pad_id)
        out, tokens = readout(role, batch), batch["response_mask"].sum().to(torch.float32)
        mask = batch["response_mask"].bool()
        trained = {name: fn(role.module, out, joined, batch, tokens, role.hp)[1].detach()
                   for name, fn in (("eager", actor_loss), ("compiled", train_loss))}
        for whose, model in (("actor's", role), ("reference's", ref), ("grad head's", ref_head)):
            inferred = {name: inference_call(model, batch, fn)() for name, fn in (("eager", log_probs),
                                                                                  ("compiled", infer))}
            for a, left in trained.items():
                for b, right in inferred.items():
                    diff = (left - right)[mask].abs()
                    equal = torch.equal(left[mask], right[mask])
                    print(f"  R={response}: {a:<8} training vs {b:<8} {whose:<11} forward: equal {equal!s:<5}  "
                          f"max |diff| {diff.max().item():.3g}, {int((diff > 0).sum())}/{int(mask.sum())} differ")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=20, help="calls per round")
    args = parser.parse_args()
    if args.rounds < 1 or args.calls < 1:
        raise SystemExit("--rounds and --calls must be at least 1")
    torch.set_num_threads(1)
    print(f"{MODEL} actor, arith-grpo's batch, one thread; median of {args.rounds} alternating rounds of "
          f"{args.calls} calls, CPU ms per call; torch {torch.__version__}; load average {os.getloadavg()[0]:.2f}")
    with single_process_world():
        for dynamic in (False, True):
            phase(dynamic, args.rounds, args.calls)
        exactness()


if __name__ == "__main__":
    main()
