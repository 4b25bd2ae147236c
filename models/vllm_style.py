"""Decoders built the way vLLM builds models, compiled by vLLM 0.33.0's own stack on the CPU
(tests/test_vllm.py, benchmarks/vllm_capture.py; models/ is used from the repo).

``build(style, backend, ...)`` returns a ``@support_torch_compile`` decoder made under a
``VllmConfig(CompilationConfig(mode=VLLM_COMPILE, splitting_ops=[attention op],
cudagraph_mode=NONE))`` on ``DeviceConfig("cpu")`` and a ``run(x)`` that calls it under
vLLM's forward context. ``style``: ``"sum"`` captures ``hidden + residual`` at a layer's
input (vLLM's ``EagleModelMixin._maybe_add_hidden_state``) before an in-place fused
add-RMSNorm; ``"native"`` the same capture before a norm computed in torch (vLLM's
``RMSNorm.forward_native``: the piece computes the capture's sum a second time); ``"clone"`` captures ``residual.clone()`` right after it (SGLang's
communicator models: the shape where stock Inductor hands back the mutated residual).
"""

from __future__ import annotations

import os
from typing import Any, Callable, List, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from models import communicator

ATTENTION_OP = "cp_vllm_test::attention"

# the torch.ops._C names vLLM's fix_functionalization compares nodes with (vllm._C is the
# CUDA extension, not loadable on this CPU): schema-only stubs, never called
_C_STUB_NAMES = ("rotary_embedding", "fused_add_rms_norm", "fused_add_rms_norm_static_fp8_quant",
                 "rms_norm_dynamic_per_token_quant", "rms_norm", "rms_norm_static_fp8_quant",
                 "silu_and_mul", "silu_and_mul_quant", "silu_and_mul_nvfp4_quant",
                 "fused_qk_norm_rope")
_stub_lib = None


def stub_vllm_c_ops() -> List[str]:
    """Define the missing ``torch.ops._C.*`` names (schema only); returns those defined."""
    global _stub_lib
    missing = []
    for name in _C_STUB_NAMES:
        try:
            getattr(torch.ops._C, name)
        except (AttributeError, RuntimeError):
            missing.append(name)
    if missing:
        if _stub_lib is None:
            _stub_lib = torch.library.Library("_C", "FRAGMENT")
        for name in missing:
            _stub_lib.define(f"{name}(Tensor(a!) x) -> ()")
    return missing


# the in-place fused add-RMSNorm (residual += hidden; hidden = rmsnorm(residual) * w), shared
# with the communicator decoder
fused_add_rmsnorm_ = communicator.fused_add_rmsnorm_


@torch.library.custom_op("cp_vllm_test::attention", mutates_args=())
def attention(qkv: torch.Tensor) -> torch.Tensor:
    q, k, v = qkv.chunk(3, dim=-1)
    out = torch.empty_like(q)
    # causal attention in blocks of rows: the op's own workspace stays small
    block = 256
    scale = q.shape[-1] ** -0.5
    for s in range(0, q.shape[0], block):
        e = min(s + block, q.shape[0])
        scores = (q[s:e] @ k[:e].transpose(0, 1)) * scale
        mask = torch.ones(e - s, e, dtype=torch.bool, device=q.device).tril(s)
        out[s:e] = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v[:e]
    return out


@attention.register_fake
def _(qkv: torch.Tensor) -> torch.Tensor:
    return qkv.new_empty(qkv.shape[0], qkv.shape[1] // 3)


class _Layer(nn.Module):
    def __init__(self, hidden: int, intermediate: int, attn_width: int) -> None:
        super().__init__()
        self.norm1 = nn.Parameter(1.0 + 0.1 * torch.randn(hidden))
        self.qkv = nn.Linear(hidden, 3 * attn_width, bias=False)
        self.o = nn.Linear(attn_width, hidden, bias=False)
        self.norm2 = nn.Parameter(1.0 + 0.1 * torch.randn(hidden))
        self.up = nn.Linear(hidden, intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)


class VllmStyleDecoder(nn.Module):
    """The decoder body; ``decorated()`` gives the ``@support_torch_compile`` class."""

    def __init__(self, *, vllm_config: Any = None, prefix: str = "", num_layers: int = 8,
                 hidden: int = 256, intermediate: int = 128, attn_width: int = 64, capture_at: Sequence[int] = (1, 3, 5, 6, 7),
                 style: str = "sum", seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList(_Layer(hidden, intermediate, attn_width) for _ in range(num_layers))
        self.final_norm = nn.Parameter(torch.ones(hidden))
        self.capture_at = tuple(capture_at)
        self.style = style

    def forward(self, hidden_states: torch.Tensor) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        hidden = hidden_states.clone()
        residual = torch.zeros_like(hidden)
        aux: List[torch.Tensor] = []
        norm = self._native_norm if self.style == "native" else self._fused_norm
        for i, layer in enumerate(self.layers):
            if self.style in ("sum", "native") and i in self.capture_at:
                aux.append(hidden + residual)
            hidden, residual = norm(hidden, residual, layer.norm1)
            if self.style == "clone" and i in self.capture_at:
                aux.append(residual.clone())
            hidden = layer.o(torch.ops.cp_vllm_test.attention(layer.qkv(hidden)))
            hidden, residual = norm(hidden, residual, layer.norm2)
            hidden = layer.down(F.silu(layer.up(hidden)))
        hidden, residual = norm(hidden, residual, self.final_norm)
        return hidden, aux

    @staticmethod
    def _fused_norm(hidden, residual, weight):
        torch.ops.comm_test.fused_add_rmsnorm_(hidden, residual, weight)
        return hidden, residual

    @staticmethod
    def _native_norm(hidden, residual, weight):
        # vLLM's RMSNorm.forward_native with a residual (the CPU path): x + residual in torch,
        # the same sum as the capture's, so a piece computes it twice
        residual = hidden + residual
        variance = residual.pow(2).mean(-1, keepdim=True)
        return residual * torch.rsqrt(variance + 1e-6) * weight, residual


class EngineRank(nn.Module):
    """``models.engine.EngineDecoder`` (one tensor-parallel rank of a served model, engine-shaped:
    fused in-place add-RMSNorm, opaque attention, in-place all-reduce) as vLLM builds a model;
    ``capture_mode="list_out"`` returns the captures as a list, as vLLM's models do."""

    SPLITTING_OPS = ("engine::attention",)
    DYNAMIC = {"input_ids": 0, "positions": 0}

    def __init__(self, *, vllm_config: Any = None, prefix: str = "", cfg: Any = None,
                 capture_mode: str = "list_out", dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        from models.engine import EngineDecoder

        self.inner = EngineDecoder(cfg, capture_mode, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> Any:
        hidden, aux = self.inner(input_ids, positions)
        return hidden, (aux if aux is not None else [])


_DECORATED = {}


def decorated(cls: type = VllmStyleDecoder) -> type:
    """``cls`` under vLLM's ``@support_torch_compile`` (one class per ``cls``)."""
    if cls not in _DECORATED:
        from vllm.compilation.decorators import support_torch_compile

        sub = type(f"Compiled{cls.__name__}", (cls,), {"__module__": __name__})
        dims = getattr(cls, "DYNAMIC", {"hidden_states": 0})
        _DECORATED[cls] = support_torch_compile(dynamic_arg_dims=dims)(sub)
    return _DECORATED[cls]


def vllm_config(backend: str, splitting_ops: Sequence[str] = (ATTENTION_OP,), mode: str = "VLLM_COMPILE"):
    from vllm.config import (CompilationConfig, CompilationMode, CUDAGraphMode, DeviceConfig,
                             VllmConfig)

    cc = CompilationConfig(mode=getattr(CompilationMode, mode), backend=backend,
                           splitting_ops=list(splitting_ops), cudagraph_mode=CUDAGraphMode.NONE,
                           compile_sizes=[])
    config = VllmConfig(compilation_config=cc, device_config=DeviceConfig("cpu"))
    # the CUDA fusion passes off (their classes are not imported on this platform)
    pc = config.compilation_config.pass_config
    for flag in [f for f in dir(pc) if f.startswith(("fuse_", "enable_"))]:
        if isinstance(getattr(pc, flag, None), bool) and getattr(pc, flag):
            setattr(pc, flag, False)
    return config


def build(backend: str = "eager", cls: type = VllmStyleDecoder, mode: str = "VLLM_COMPILE",
          speculative_config: Any = None, **model_kwargs: Any) -> Tuple[nn.Module, Callable[[torch.Tensor], Any], Any]:
    """(model, run, config): the decorated model built under its config (vLLM's compilation
    ``mode``: VLLM_COMPILE splits at the attention op, DYNAMO_TRACE_ONCE compiles one graph
    as vLLM's CPU platform does), ``run(x)`` calling it in vLLM's forward context.
    ``backend="none"`` builds the same weights uncompiled. ``speculative_config``: the engine's
    (``models/vllm_drafts.py``), so the target belongs to that engine as in vLLM, where the
    target and its draft share one."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")
    if backend == "inductor":
        stub_vllm_c_ops()
    if backend == "none":
        model = cls(**model_kwargs).eval()
        return model, model, None
    config = vllm_config(backend, getattr(cls, "SPLITTING_OPS", (ATTENTION_OP,)), mode=mode)
    config.speculative_config = speculative_config
    with set_current_vllm_config(config):
        model = decorated(cls)(vllm_config=config, prefix="", **model_kwargs).eval()

    def run(*x: torch.Tensor) -> Any:
        with set_current_vllm_config(config), set_forward_context(None, vllm_config=config), \
                torch.no_grad():
            return model(*x)

    return model, run, config


class DraftRMSNorm(nn.Module):
    """vLLM's RMSNorm as its ``forward_native`` computes it (the CPU stand-in of a draft's norm)."""

    def __init__(self, width: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter((1.0 + 0.1 * torch.randn(width)).to(dtype))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return xf.to(x.dtype) * self.weight


class Eagle3Draft(nn.Module):
    """An Eagle3 draft's input side laid out as vLLM's ``Eagle3LlamaForCausalLM``:
    ``model.fc`` (``[H_draft, K*hidden]``), ``model.input_norm`` when ``norm_before_fc``,
    ``model.fc_norm`` (one per capture); ``combine_hidden_states`` is vLLM's own function
    (as the plugin left it, looked up at each call)."""

    def __init__(self, num_captures: int, hidden: int, h_draft: int, combine: str = "fc",
                 dtype: torch.dtype = torch.float32, seed: int = 3) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.model = nn.Module()
        self.model.use_aux_hidden_state = True
        self.model.num_aux_hidden_states = num_captures
        self.model.norm_before_fc = combine == "norm_before_fc"
        self.model.input_norm = DraftRMSNorm(num_captures * hidden, dtype=dtype) if self.model.norm_before_fc \
            else None
        self.model.fc_norm = nn.ModuleList(DraftRMSNorm(hidden, dtype=dtype) for _ in range(num_captures)) \
            if combine == "fc_norms" else None
        self.model.fc = nn.Linear(num_captures * hidden, h_draft, bias=False, dtype=dtype)
        self.model.fc.weight.data.mul_(4.0)
        self.requires_grad_(False)  # inference weights, as a loaded vLLM draft's

    def combine_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

        return Eagle3LlamaForCausalLM.combine_hidden_states(self, hidden_states)
