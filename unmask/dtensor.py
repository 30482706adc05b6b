"""Whether a tensor is a DTensor, without importing torch.distributed.tensor: that import
(with sympy under it) costs about a second, a third of `unmask --help`'s start-up, and
a DTensor can exist only once the module was imported (sharding, tensor parallelism and
DCP import it), so a check before that is False."""

from __future__ import annotations

import sys
from typing import Any

_MODULE = "torch.distributed.tensor"


def is_dtensor(value: Any) -> bool:
    """isinstance(value, torch.distributed.tensor.DTensor), the module left unimported."""
    module = sys.modules.get(_MODULE)
    return module is not None and isinstance(value, module.DTensor)


__all__ = ["is_dtensor"]
