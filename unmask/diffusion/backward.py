"""A backward split into an input pass and a weight pass (zero-bubble pipelines).

A zero-bubble pipeline schedule (parallel/pipeline.py) runs each stage's backward in two
parts: the *input pass* makes the gradient its upstream stage waits for, the *weight pass*
the parameters' gradients, which nobody waits for and which the schedule uses to fill the
gaps. Here the input pass is one ordinary autograd backward in which the layers that know
how (models/fused.py `linear` and `rms_norm`) make only their input's gradient and hand
their weight's to `BackwardPass.defer`, as a function of the tensors they already hold; the
weight pass calls those functions (`BackwardPass.take`): each weight's matmul, nothing else. Every other parameter gets its
gradient in the input pass, as in a plain backward (the LM head's, which the fused loss made
in the forward, is handed over there).

torch's own split (torch.distributed.pipelining `stage_backward_input` /
`stage_backward_weight`) walks the autograd graph twice instead: the input pass keeps it
alive, and the weight pass calls autograd once per group of parameters (about 90 calls per
micro-batch on an 8-layer stage) and runs every node between them and the saved
intermediates again (the norms' both gradients in both passes). On CPU that made the two
passes 21-30% dearer than one full backward on every stage but the first.

The gradients equal a plain backward's bit for bit (tests/unit/test_deferred_backward.py):
each deferred function runs the same aten call autograd would have run.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class BackwardPass:
    """Which gradients the next backward of a stage makes: every one, or while `deferring`
    (an input pass) those of the activations only, each deferring layer handing its
    weight's to `defer` instead. The stage sets `deferring` around a backward and calls
    `take` after it."""

    def __init__(self) -> None:
        self.deferring = False
        self._deferred: list[Callable[[], None]] = []

    def defer(self, make: Callable[[], None]) -> None:
        """Keep `make` (it computes a weight's gradient and adds it, `add_gradient`) for the
        weight pass."""
        self._deferred.append(make)

    def take(self) -> Callable[[], None]:
        """The weight pass of the backward(s) since the last take: one call that runs what
        they deferred, in the order they deferred it."""
        work, self._deferred = self._deferred, []

        def weight_pass() -> None:
            with torch.no_grad():  # as inside autograd's backward: nothing recorded
                for make in work:
                    make()

        return weight_pass


def add_gradient(param: torch.Tensor, grad: torch.Tensor | None) -> None:
    """Add `grad` into param's gradient as autograd would: into `.grad` of a leaf (the
    first gradient taken as is, the next added in place), through the graph that made
    param otherwise (a cast of a float32 weight under autocast)."""
    if grad is None:
        return
    if not param.is_leaf:
        torch.autograd.backward(param, grad)
    elif param.grad is None:
        param.grad = grad
    else:
        param.grad += grad
