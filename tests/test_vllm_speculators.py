"""Every speculator the installed vLLM ships that reads the target's aux hidden states
(``models.vllm_drafts.SPECULATORS``: Eagle3, DFlash, DFlash2, DSpark), its draft built from
its own config by vLLM's loader after the target, under ``COMPILE_PASS_VLLM_PROJECT=1``:
the target compiled by vLLM's stack and run as the model runner runs it, the draft's input
formed as its speculator forms it (the concat through that speculator module's ``torch``,
then the draft's ``combine_hidden_states``), equal to vLLM's own cat-then-combine of the
uncompiled model's captures within the projection's rounding; ``[T, H_draft]`` from the
graph where the draft registered; the packed captures and the draft's own ``fc`` where it
did not. ``make vllm`` (0.33.0 and 0.34.0); skipped without vllm."""

import tempfile

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from compile_pass.integrations import vllm as plugin  # noqa: E402
from compile_pass.integrations import vllm_projection  # noqa: E402
import models.vllm_style as H  # noqa: E402
from models.vllm_drafts import SPECULATORS, speculator_engine  # noqa: E402

CAPTURES = (1, 3, 5)
K, HIDDEN, H_DRAFT = len(CAPTURES), 256, 192
#: the module whose torch.cat forms each speculator's draft input (MRV2)
CONCAT_MODULE = {"eagle3": "vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator",
                 "dflash": "vllm.v1.worker.gpu.spec_decode.dflash.speculator",
                 "dflash2": "vllm.v1.worker.gpu.spec_decode.dflash.speculator",
                 "dspark": "vllm.v1.worker.gpu.spec_decode.dflash.speculator"}


@pytest.fixture
def projecting(monkeypatch):
    plugin.uninstall()
    monkeypatch.setenv(vllm_projection.ENV_PROJECT, "1")
    assert plugin.install()
    yield
    plugin.uninstall()


def _draft_class_present(name: str) -> bool:
    from vllm.model_executor.models.registry import ModelRegistry

    return SPECULATORS[name][1] in ModelRegistry.get_supported_archs()


@pytest.mark.parametrize("name", sorted(SPECULATORS))
def test_each_speculators_draft_gets_its_input_projected_or_packed_never_wrong(projecting, name):
    if not _draft_class_present(name):
        pytest.skip(f"this vLLM has no {SPECULATORS[name][1]}")
    from vllm.forward_context import set_forward_context

    engine = speculator_engine(tempfile.mkdtemp(prefix=f"cp-{name}-"), name, hidden=HIDDEN, layers=max(CAPTURES) + 2,
                               h_draft=H_DRAFT, capture_layers=CAPTURES)
    ref = H.build("none", capture_at=CAPTURES)[0]
    model, _, config = H.build("eager", capture_at=CAPTURES, speculative_config=engine.speculative_config)
    model.load_state_dict(ref.state_dict())
    draft = engine.build_draft()  # after the target, as the speculator's load_model
    assert type(draft).__name__ == SPECULATORS[name][2]
    assert vllm_projection.is_registered(draft), f"{type(draft).__name__} did not register"
    cat = __import__(CONCAT_MODULE[name], fromlist=["torch"]).torch.cat
    x = torch.randn(40, HIDDEN)
    with set_forward_context(None, vllm_config=config), torch.no_grad():  # as execute_model: no current config
        h, aux = model(x)
        drafted = draft.combine_hidden_states(cat(aux, dim=-1))
        rh, raux = ref(x)
        combine = type(draft).combine_hidden_states.__wrapped__
        listed = combine(draft, torch.cat(raux, dim=-1))  # vLLM's own: the cat, then its combine
    assert torch.equal(h, rh)
    assert aux[0].shape == (40, H_DRAFT) and all(a.shape == (40, 0) for a in aux[1:])
    assert drafted.data_ptr() == aux[0].data_ptr()  # passed on: fc not applied twice
    torch.testing.assert_close(drafted, listed, rtol=2e-5, atol=2e-5)
