"""TRL 1.16 under accelerate's context or sequence parallelism (`parallelism_config` with cp_size or sp_size > 1).

TRL's `GRPOConfig` refuses both before any model is built: GRPO builds the model's inputs after generation,
where accelerate's sequence sharding cannot reach them. `PGLossGRPOTrainer` takes a `GRPOConfig`, so it has
no such path to run. When TRL lifts the refusal this test fails: its fused and plain losses then need the
step's count with `sequence_parallel=pgloss.SequenceParallel(mesh["cp"].get_group(), layout="load_balanced")`
(docs/integrations.md, "Sequence and context parallelism").
"""

import pytest

pytest.importorskip("trl")

from accelerate.parallelism_config import ParallelismConfig
from trl import GRPOConfig


@pytest.mark.parametrize("sizes", [dict(cp_size=2), dict(sp_size=2)])
def test_grpo_config_refuses_sequence_dim_parallelism(tmp_path, sizes):
    with pytest.raises(ValueError, match="does not support sequence-dim parallelism"):
        GRPOConfig(output_dir=str(tmp_path), parallelism_config=ParallelismConfig(**sizes), use_cpu=True, report_to=[])
