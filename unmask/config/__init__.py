"""The run config: one YAML file = one run (`RunConfig`, one section per component),
loaded with `section.key=value` overrides; seed schemas (LMMs-Engine, Transformer Lab)
are translated first. `python -m unmask.config` prints docs/configuration.md."""

from unmask.config.eval import EvalConfig
from unmask.config.parallel import ParallelConfig
from unmask.config.run import (
    RunConfig,
    apply_override,
    dump_config,
    load_config,
    parse_override,
    quickstart_yaml,
    read_yaml,
    reference_markdown,
    validate_tree,
)
from unmask.config.train import TrainConfig

__all__ = [
    "EvalConfig",
    "ParallelConfig",
    "RunConfig",
    "TrainConfig",
    "apply_override",
    "dump_config",
    "load_config",
    "parse_override",
    "quickstart_yaml",
    "read_yaml",
    "reference_markdown",
    "validate_tree",
]
