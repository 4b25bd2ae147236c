"""vLLM's own Eagle3 draft (``llama_eagle3.Eagle3LlamaForCausalLM``) built the way vLLM's
speculator loads it, on the CPU with the CUDA wheel (tests/test_vllm_projection.py,
benchmarks/vllm_projection.py; models/ is used from the repo).

``eagle3_engine(root, ...)`` writes a target's and a draft's ``config.json`` under ``root``
and makes the engine's ``ModelConfig`` + ``SpeculativeConfig(method="eagle3")`` +
``VllmConfig`` from them; its ``build_draft()`` calls vLLM's ``get_model(vllm_config=speculative_config.apply_draft_overrides(config),
model_config=speculative_config.draft_model_config)``, the call its Eagle3 speculator's
``load_eagle_model`` makes (dummy weights: vLLM's ``DummyModelLoader``). So the draft class
is the one vLLM's registry resolves from ``architectures=["LlamaForCausalLMEagle3"]``, its
``__init__`` (patched by the plugin when ``COMPILE_PASS_VLLM_PROJECT=1``) runs as in an
engine, and ``norm_before_fc`` / ``fc_norm`` are read from the draft config as vLLM reads them.

Two things the CPU needs: the CUDA wheel's "unspecified" platform names no attention backend
(FlexAttention is returned while the draft is built: the combine runs no attention), and
``custom_ops=["none"]`` so RMSNorm runs ``forward_native``.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch

COMBINES = ("fc", "norm_before_fc", "fc_norms")


#: every speculator of vLLM 0.33 / 0.34 that reads the target's aux hidden states, by name:
#: (SpeculativeConfig method, the draft's architecture in vLLM's registry, the draft class
#: that architecture resolves to, the draft config's own keys); ``eagle3`` also takes a
#: ``combine`` (``COMBINES``)
SPECULATORS = {
    "eagle3": ("eagle3", "LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", {}),
    "dflash": ("dflash", "DFlashDraftModel", "DFlashQwen3ForCausalLM", {}),
    "dflash2": ("dflash", "DFlash2DraftModel", "DFlash2Qwen3ForCausalLM",
                {"dflash_config": {"selector_rank": 16, "selector_top_k": 4, "conv_kernel_size": 3,
                                   "conv_group_size": 4}}),
    "dspark": ("dspark", "Qwen3DSparkModel", "Qwen3DSparkForCausalLM", {"markov_rank": 16}),
}


def _write_configs(root: str, *, hidden: int, layers: int, h_draft: int, capture_layers: Sequence[int],
                   combine: str, dtype: torch.dtype, vocab: int, speculator: str = "eagle3") -> tuple:
    """The target's and the draft's config folders under ``root``."""
    if combine not in COMBINES:
        raise ValueError(f"unknown combine {combine!r}: one of {COMBINES}")
    if speculator not in SPECULATORS:
        raise ValueError(f"unknown speculator {speculator!r}: one of {sorted(SPECULATORS)}")
    if speculator != "eagle3" and combine != "fc":
        raise ValueError(f"a {speculator} draft's combine is its fc alone (combine='fc'), not {combine!r}")
    target, draft = os.path.join(root, "target"), os.path.join(root, "draft")
    os.makedirs(target, exist_ok=True)
    os.makedirs(draft, exist_ok=True)
    base = dict(model_type="llama", intermediate_size=2 * hidden, num_attention_heads=4, num_key_value_heads=4,
                vocab_size=vocab, max_position_embeddings=8192, rms_norm_eps=1e-6,
                torch_dtype=str(dtype).replace("torch.", ""))
    with open(os.path.join(target, "config.json"), "w") as f:
        json.dump(dict(base, architectures=["LlamaForCausalLM"], hidden_size=hidden, head_dim=hidden // 4,
                       num_hidden_layers=layers), f)
    _, architecture, _, own = SPECULATORS[speculator]
    if speculator == "eagle3":
        eagle = {"eagle_aux_hidden_state_layer_ids": list(capture_layers), "norm_before_fc": combine == "norm_before_fc"}
        config = dict(base, architectures=[architecture], hidden_size=h_draft, head_dim=h_draft // 4,
                      num_hidden_layers=1, target_hidden_size=hidden, draft_vocab_size=vocab,
                      fc_norm=combine == "fc_norms", eagle_config=eagle)
    else:  # the DFlash family: Qwen3 layers, the capture layers and mask token in dflash_config
        dflash = {"target_layer_ids": list(capture_layers), "mask_token_id": vocab - 1,
                  **own.get("dflash_config", {})}
        config = dict(base, **{k: v for k, v in own.items() if k != "dflash_config"}, model_type="qwen3",
                      architectures=[architecture], hidden_size=h_draft, head_dim=h_draft // 4,
                      num_hidden_layers=2, target_hidden_size=hidden, dflash_config=dflash)
    with open(os.path.join(draft, "config.json"), "w") as f:
        json.dump(config, f)
    return target, draft


@contextlib.contextmanager
def _flex_attention_backend() -> Iterator[None]:
    """The attention-backend lookup answers FlexAttention while the draft is built (the CUDA
    wheel's platform on a CPU names none)."""
    import vllm.model_executor.layers.attention.attention as attention
    from vllm.v1.attention.backends.flex_attention import FlexAttentionBackend

    original = attention.get_attn_backend
    attention.get_attn_backend = lambda *args, **kwargs: FlexAttentionBackend
    try:
        yield
    finally:
        attention.get_attn_backend = original


def _init_parallel_state(root: str) -> None:
    """vLLM's single-rank parallel groups (gloo), once per process (under the engine's config:
    vLLM reads it while making them)."""
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return
    parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                                distributed_init_method=f"file://{os.path.join(root, 'dist')}")
    parallel_state.initialize_model_parallel(1)


@dataclass
class Eagle3Engine:
    """One engine's config (``config``: the target's ``ModelConfig`` and the Eagle3
    ``SpeculativeConfig``); ``build_draft()`` loads its draft as the speculator does. A target
    compiled under ``config`` (its ``speculative_config``) belongs to this engine."""

    config: Any
    root: str

    @property
    def speculative_config(self) -> Any:
        return self.config.speculative_config

    def build_draft(self) -> torch.nn.Module:
        """vLLM's Eagle3 draft built by its loader (``get_model`` with the draft's config,
        under it, as ``load_eagle_model``); the fc and norm weights then set to order one."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader import get_model

        speculative = self.config.speculative_config
        draft_config = speculative.apply_draft_overrides(self.config) \
            if hasattr(speculative, "apply_draft_overrides") else self.config
        with set_current_vllm_config(self.config):
            _init_parallel_state(self.root)
        with set_current_vllm_config(draft_config), _flex_attention_backend():
            model = get_model(vllm_config=draft_config, model_config=speculative.draft_model_config).eval()
        with torch.no_grad():
            generator = torch.Generator().manual_seed(3)
            fc = model.model.fc.weight
            fc.copy_(torch.randn(fc.shape, generator=generator).to(fc.dtype) * 4.0 / fc.shape[1] ** 0.5)
            inner = model.model
            norms = ([inner.input_norm] if getattr(inner, "norm_before_fc", False) else []) + \
                list(getattr(inner, "fc_norm", None) or [])
            for norm in norms:
                norm.weight.copy_((1 + 0.1 * torch.randn(norm.weight.shape, generator=generator)).to(norm.weight.dtype))
        return model


def eagle3_engine(root: str, *, hidden: int, layers: int, h_draft: int, capture_layers: Sequence[int],
                  combine: str = "fc", dtype: torch.dtype = torch.float32, vocab: int = 256,
                  speculator: str = "eagle3") -> Eagle3Engine:
    """An engine serving a Llama target of ``layers`` x ``hidden`` with a draft of
    ``speculator`` (``SPECULATORS``: Eagle3 by default; ``h_draft`` wide, Eagle3's
    ``combine``: ``"fc"``, ``"norm_before_fc"`` or ``"fc_norms"``) capturing at
    ``capture_layers``: config folders written under ``root``, vLLM's configs made from them."""
    from vllm.config import (CompilationConfig, DeviceConfig, LoadConfig, ModelConfig, ParallelConfig,
                             SpeculativeConfig, VllmConfig)

    target, draft = _write_configs(root, hidden=hidden, layers=layers, h_draft=h_draft,
                                   capture_layers=capture_layers, combine=combine, dtype=dtype, vocab=vocab,
                                   speculator=speculator)
    model_config = ModelConfig(model=target, skip_tokenizer_init=True, dtype=dtype, max_model_len=8192)
    parallel = ParallelConfig()
    speculative = SpeculativeConfig(method=SPECULATORS[speculator][0], model=draft,
                                    num_speculative_tokens=1 if speculator == "eagle3" else 2,
                                    target_model_config=model_config, target_parallel_config=parallel)
    config = VllmConfig(model_config=model_config, speculative_config=speculative, parallel_config=parallel,
                        load_config=LoadConfig(load_format="dummy"), device_config=DeviceConfig("cpu"),
                        compilation_config=CompilationConfig(custom_ops=["none"]))
    return Eagle3Engine(config, root)


def speculator_engine(root: str, speculator: str, **kwargs: Any) -> Eagle3Engine:
    """``eagle3_engine`` for any of ``SPECULATORS``."""
    return eagle3_engine(root, speculator=speculator, **kwargs)


def build_eagle3(root: str, **kwargs: Any) -> torch.nn.Module:
    """``eagle3_engine(root, **kwargs).build_draft()``: the draft alone."""
    return eagle3_engine(root, **kwargs).build_draft()
