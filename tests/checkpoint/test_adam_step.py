"""Adam's step survives a resume whichever way the optimizer keeps it: torch's per parameter
(the other resume tests), or apex FusedAdam's ``param_groups[i]['step']`` (here)."""

from __future__ import annotations

from unittest import mock

import torch

from megatron3d import kernels
from tests.helpers.dist import run_distributed
from tests.helpers.runs import merge_ranks, train
from tests.helpers.tiny import train_argv

ITERS, STOP = 6, 3


class GroupStepAdamW(torch.optim.Optimizer):
    """AdamW that counts steps like apex's FusedAdam: ``group['step']``, created at the first
    step and incremented once per step, and no per-parameter 'step'."""

    def __init__(self, groups: list[dict], lr: float, betas: tuple[float, float],
                 eps: float) -> None:
        super().__init__(groups, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": 0.0})

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            (beta1, beta2), step, lr = group["betas"], group["step"], group["lr"]
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                p.mul_(1.0 - lr * group["weight_decay"])
                state["exp_avg"].lerp_(p.grad, 1.0 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1.0 - beta2)
                denom = (state["exp_avg_sq"] / (1.0 - beta2 ** step)).sqrt_().add_(group["eps"])
                p.addcdiv_(state["exp_avg"], denom, value=-lr / (1.0 - beta1 ** step))


def _continue_after_save(directory: str) -> dict:
    """With GroupStepAdamW: ITERS steps straight; STOP steps, save, stop; a fresh trainer
    loads and runs to ITERS."""
    argv = train_argv("gpt2", ITERS, "--zero-stage", "1")
    with mock.patch.object(kernels, "adamw", GroupStepAdamW):
        return {"continuous": train(argv),
                "stopped": train([*argv, "--save", directory, "--exit-interval", str(STOP)]),
                "resumed": train([*argv, "--load", directory])}


def test_resume_keeps_a_step_counted_in_the_param_groups(tmp_path):
    per_rank = run_distributed(_continue_after_save, 2, str(tmp_path / "ckpt"))
    runs = {k: merge_ranks([r[k] for r in per_rank]) for k in per_rank[0]}
    assert len(runs["resumed"].losses) == ITERS - STOP
    assert runs["resumed"].losses == runs["continuous"].losses[STOP:]  # bitwise
    for name, value in runs["continuous"].params.items():
        assert torch.equal(runs["resumed"].params[name], value), name
