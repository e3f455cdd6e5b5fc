"""TRL's GRPO tests on this CPU, offline: tiny stand-ins for the Hub, and the selection of CPU tests.

Run with PGLOSS_PEER_TRAINER=trl for TRL's own GRPOTrainer ("before"); by default the trainer is
pgloss's PGLossGRPOTrainer ("after"). See README.md.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import re
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest
import torch
from absent import skipped_modules

_MISSING = [name for name in ("trl", "datasets", "accelerate") if importlib.util.find_spec(name) is None]
if _MISSING:  # TRL's own tests need TRL's stack (the trl extra; make test installs it)
    pytest_pycollect_makemodule = skipped_modules(f"needs {', '.join(_MISSING)}: pip install -e '.[trl]'")
else:
    from .standins import MODELS, build_models

HERE = Path(__file__).parent
_QWEN_VOCABULARY = (
    "test_train_with_mask_truncated_completions",
    "test_train_with_mask_truncated_completions_all_masked",
)
_ID = re.compile(r"trl-internal-testing/([\w.\-]+)")

_EITHER = "fails with TRL's own GRPOTrainer too: the tests are TRL's main at 1.10.0.dev0, the trainer is 1.16 (README)"
_REFUSED = "docs/reference.md, 'Conformance with TRL': pgloss refuses "
EXPECTED_FAILURES = {
    # test (node name without the class): (reason, fails with TRL's own trainer too)
    "test_generate_prefers_rollout_func": (_EITHER, True),
    "test_entropy_bonus_flows_gradients": (_EITHER, True),
    **{
        f"test_warning_raised_sequence_level_with_token_summed_loss[{loss}]": (
            _REFUSED + "importance_sampling_level='sequence' with a token-summed loss",
            False,
        )
        for loss in ("bnpo", "dr_grpo", "dapo", "cispo")
    },
    "test_train_sequence_importance_sampling": (_REFUSED + "importance_sampling_level='sequence' with dapo", False),
    "test_prepare_input_called_with_correct_data": (_REFUSED + "an optimizer step spanning two generations", False),
    "test_entropy_bonus_scale[luspo]": (
        "docs/reference.md, 'Conformance with TRL': LUSPO's entropy bonus is "
        "aggregated like its loss (x16 here), TRL's is a token mean",
        False,
    ),
}
"""The tests that fail, each on a difference written in docs/reference.md (README: the results table)."""


@pytest.fixture(autouse=True)
def _cpu(monkeypatch):
    """GRPOConfig turns bf16 on when fp16 is off; on a CPU without bf16 TrainingArguments then refuses to
    start, with TRL's trainer as with ours. The stand-in for the hardware, for these tests only: bf16
    stays off, and one thread (tiny models: threads only contend)."""
    from trl.trainer.base_config import _BaseConfig

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    if not torch.cuda.is_available():
        post_init = _BaseConfig.__post_init__

        def __post_init__(self):
            if self.bf16 is None:
                self.bf16 = False
            post_init(self)

        monkeypatch.setattr(_BaseConfig, "__post_init__", __post_init__)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def hub(tmp_path_factory):
    return build_models(str(tmp_path_factory.mktemp("hub")))


@pytest.fixture(autouse=True)
def _offline_hub(hub, monkeypatch):
    monkeypatch.chdir(hub)  # "trl-internal-testing/<name>" is the local stand-in


def _reason(item) -> str | None:
    """Why a TRL test is not run here, or None."""
    cls = item.cls.__name__ if item.cls else ""
    if cls == "TestGRPOTrainerVLM":
        return "vision-language models and image datasets from the Hub (no stand-ins)"
    if cls == "TestGRPOTrainerSlow":
        return "slow GPU tests"
    name = item.originalname if hasattr(item, "originalname") else item.name
    if name == "test_train_multiple_dataloader_workers":
        return (
            "TRL's DataLoader with spawned workers, which never reach the loss: each re-imports TRL (about a "
            "minute of the suite's 2 cores)"
        )
    if name in _QWEN_VOCABULARY:
        return (
            "relies on Qwen2.5's 151k-token vocabulary (generate mocked with its ids 151643/151645, or EOS "
            "practically never sampled); the stand-in tokenizer has 259 tokens"
        )
    for word, why in (
        ("vllm", "needs vLLM (a GPU server)"),
        ("liger", "needs Liger kernels"),
        ("peft", "needs peft (not installed with pgloss)"),
    ):
        if word in item.name.lower():
            return why
    callspec = getattr(item, "callspec", None)
    if callspec is not None and callspec.params.get("use_liger_kernel"):
        # Liger's kernels need a GPU, and applying them patches transformers' classes for every later test
        return "needs Liger kernels (installed for the conformance tests; they patch transformers' modules)"
    source = inspect.getsource(item.function)
    body = source[source.index("def " + name) :] if ("def " + name) in source else source
    params = getattr(item, "callspec", None)
    named = _ID.findall(body) + [
        m for v in (params.params.values() if params else ()) if isinstance(v, str) for m in _ID.findall(v)
    ]
    missing = sorted(
        {n for n in named if n not in MODELS and not n.startswith("zen")} | {n for n in named if n.startswith("zen-")}
    )
    if missing:
        return f"Hub resources without a stand-in here: {', '.join(missing)}"
    return None


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: TRL's slow tests")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE not in Path(item.fspath).parents:
            continue
        reason = _reason(item)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))
        expected = EXPECTED_FAILURES.get(item.name)
        if expected is not None and (expected[1] or os.environ.get("PGLOSS_PEER_TRAINER") != "trl"):
            item.add_marker(pytest.mark.xfail(reason=expected[0], strict=True))
