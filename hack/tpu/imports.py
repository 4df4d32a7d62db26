"""What a chip run imports: hack/tpu/bundle.sh packs each distribution this script imports (-X importtime).

It builds the tiny policy (MaxText, qwix, tokamax are imported lazily by the trainer) and imports the modules
tests/tpu and bench/train_step_chip.py use."""

from rljob.trainer import compilecheck, loop, train_step  # noqa: F401
from rljob.trainer.model import ModelSpec, Policy

Policy(ModelSpec.tiny())
# The packer's balanced layout compiles its search with numba (llvmlite), imported on first use.
from rljob.trainer.packing import _search_kernel  # noqa: E402

_search_kernel()
# The fixture modules tests/conftest.py registers (pytest loads them before any test of the chip tier).
import sys  # noqa: E402

import jax.experimental.pallas.ops.tpu.splash_attention  # noqa: E402,F401

sys.path.insert(0, "tests")
import fixtures.chip_models  # noqa: E402
import fixtures.cluster  # noqa: E402
import fixtures.cpu_sampler  # noqa: E402
import fixtures.gcs  # noqa: E402
import fixtures.kueue  # noqa: E402
import fixtures.operator  # noqa: E402
import fixtures.trainer_run  # noqa: E402,F401

# bench/train_step_chip.py's peers: tunix's RL trainer and loss, MaxText's tunix adapter.
import tunix.rl.algo_core  # noqa: E402
import tunix.rl.grpo.grpo_learner  # noqa: E402
import tunix.rl.trainer  # noqa: E402
import tunix.sft.peft_trainer  # noqa: E402,F401
