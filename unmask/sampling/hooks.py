"""Dream's per-step hooks: user callables that see, and may replace, the logits and the
canvas at every denoising step (`SamplingConfig.logits_hook` / `tokens_hook`).

    logits_hook(step, x, logits) -> logits   # the model's logits, before the EOS options
    tokens_hook(step, x, logits) -> x        # after the step's commits; once before the
                                             # first step as (None, x, None)

x is the (B, P + G) canvas of the rows still being decoded, logits (B, Lb, V) those of the
current block's positions, step counts the steps of all blocks from 0. A hook given on the
command line is named `module:function` (imported from sys.path, e.g. PYTHONPATH). A hook
that raises, or returns something of the wrong shape, is an InputError naming the hook and
the step: one line from the CLI, exit code 2.
"""

import importlib
from collections.abc import Callable
from typing import Any

import torch

from unmask.errors import InputError

Hook = Callable[[int | None, torch.Tensor, torch.Tensor | None], torch.Tensor]


def import_hook(spec: str) -> Hook:
    """The function a 'module:function' string names; ValueError (one line) otherwise."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected module:function (e.g. mypkg.hooks:boost), got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # ImportError, or the module raising as it loads
        raise ValueError(
            f"cannot import module {module_name!r} ({type(err).__name__}: {err}); put it "
            "on PYTHONPATH"
        ) from None
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"module {module_name!r} has no {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"{spec!r} is not callable")
    return target


def hook_name(hook: Hook) -> str:
    """'module:qualname' of a function (how the CLI names it), else its repr."""
    module, name = getattr(hook, "__module__", None), getattr(hook, "__qualname__", None)
    return f"{module}:{name}" if module and name else repr(hook)


def _call(kind: str, hook: Hook, step, x, logits) -> Any:
    try:
        return hook(step, x, logits)
    except Exception as err:
        where = "before the first step" if step is None else f"at step {step}"
        raise InputError(
            f"{kind} {hook_name(hook)} raised {where}: {type(err).__name__}: {err}"
        ) from err


def _checked(kind: str, hook: Hook, step, x, logits, like: torch.Tensor, what: str):
    """The hook's result, checked to be a tensor of `like`'s shape."""
    result = _call(kind, hook, step, x, logits)
    if not isinstance(result, torch.Tensor) or result.shape != like.shape:
        got = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result).__name__
        raise InputError(
            f"{kind} {hook_name(hook)} returned {got} at step {step}; return {what}, a "
            f"tensor of shape {tuple(like.shape)}"
        )
    return result


def call_logits_hook(hook: Hook, step: int, x: torch.Tensor, logits: torch.Tensor):
    """The logits hook's result, checked to be a tensor of the logits' shape."""
    return _checked("logits_hook", hook, step, x, logits, logits, "the logits")


def call_tokens_hook(hook: Hook, step: int | None, x: torch.Tensor, logits):
    """The tokens hook's result, checked to be a canvas of x's shape (as x's dtype)."""
    result = _checked("tokens_hook", hook, step, x, logits, x, "the canvas x")
    return result.to(dtype=x.dtype, device=x.device)
