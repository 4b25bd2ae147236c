"""HF transformers target models wrapped in the capture patterns Eagle3 training uses.

Eagle3 training frameworks (SpecForge-style) run an HF ``*ForCausalLM`` target model and
read K hidden states from it. Two capture styles are common, and both are wrapped here
around a tiny randomly initialised model built from its config (no download):

- ``"hidden_states"`` (:class:`HiddenStatesCapture`): ``model(..., output_hidden_states=True)``
  then ``torch.cat([out.hidden_states[i] for i in layers], -1)``;
- ``"hooks"`` (:class:`HookCapture`): forward hooks on the chosen decoder layers append
  their hidden state to a list, then ``torch.cat(list, -1)``;
- ``"selected_hidden_states"`` (:class:`HiddenStatesCapture` with ``select=True``):
  ``output_hidden_states=[layers]``, which recent transformers (5.x) accept to keep only
  those hidden states (older versions treat the list as ``True`` and keep all: same result);
- ``"none"`` (:class:`NoCapture`): the same forward without captures (the memory baseline).

Layer ids follow :mod:`models.common`: capturing layer ``i`` means the hidden state at the
*input* of decoder layer ``i``, which is ``out.hidden_states[i]`` in HF's numbering
(``hidden_states[0]`` is the embedding output, ``hidden_states[i]`` the output of layer
``i - 1``). The hook style reads the same tensors (the output of layer ``i - 1``; the
input of layer 0 for ``i == 0``), so both styles return bitwise equal captures.
Every wrapper returns ``(logits [B, T, vocab], aux [B, T, K * hidden] or None)``.

Families (:data:`FAMILIES`): ``llama``, ``qwen2``, ``qwen3``, ``deepseek_v3``. DeepSeek-V3's
MoE experts take HF's ``experts_implementation`` (default: HF's choice, ``"grouped_mm"`` in
transformers 5): ``"grouped_mm"`` and ``"batched_mm"`` trace with ``fullgraph=True``;
``"eager"`` loops over the experts hit (``nonzero``), which Dynamo cannot trace with
``fullgraph=True`` (graph breaks without it; see docs/hf.md).

Attention: under ``torch.compile`` HF's ``sdpa`` mask path materializes a ``[B, 1, T, T]``
mask that an uncompiled forward skips (it cannot check the position ids for packed
sequences while tracing, and with torch < 2.14 it never skips while compiling); where the
logits are small it sets the compiled peak (docs/hf.md). :data:`CAUSAL_SDPA`
(``attn_implementation=CAUSAL_SDPA``, registered by :func:`register_causal_sdpa`) is HF's
own SDPA attention with a mask builder that returns no mask for one unpadded causal
sequence per batch row, so SDPA runs with ``is_causal=True`` compiled or not. Results are
bitwise equal to ``"sdpa"``.

transformers is imported lazily (the ``hf`` extra: ``pip install compile-pass[hf]``);
:func:`require_transformers` raises ImportError naming the extra when it is missing.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from models.common import check_capture_layers, eagle3_capture_layers

__all__ = [
    "CAPTURE_STYLES",
    "CAUSAL_SDPA",
    "FAMILIES",
    "FACTORY_NAMES",
    "HiddenStatesCapture",
    "HookCapture",
    "NoCapture",
    "build_model",
    "capture_dominated",
    "capture_dominated_config",
    "default_layers",
    "example_input_ids",
    "register_causal_sdpa",
    "require_transformers",
    "tiny",
    "tiny_config",
    "tiny_llama",
    "wrap",
]

log = logging.getLogger("compile_pass")

FAMILIES: Tuple[str, ...] = ("llama", "qwen2", "qwen3", "deepseek_v3")
CAPTURE_STYLES: Tuple[str, ...] = ("hidden_states", "hooks", "selected_hidden_states", "none")
#: Factories the diff tool may call by name (``python -m compile_pass diff models.hf:tiny_llama``).
FACTORY_NAMES: Tuple[str, ...] = ("tiny", "capture_dominated", "tiny_llama")
#: The attention implementation name :func:`register_causal_sdpa` registers.
CAUSAL_SDPA = "compile_pass_causal_sdpa"

# family -> (config class, causal LM class) names in transformers
_CLASSES: Dict[str, Tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
}


def require_transformers() -> ModuleType:
    """Import and return ``transformers``; ImportError naming the ``hf`` extra if missing."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError(
            "models.hf needs HF transformers: pip install 'compile-pass[hf]' "
            "(or pip install 'transformers>=4.45')"
        ) from e
    return transformers


def _check_family(family: str) -> str:
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; expected one of {', '.join(FAMILIES)}")
    return family


def _check_style(style: str) -> str:
    if style not in CAPTURE_STYLES:
        raise ValueError(f"unknown capture style {style!r}; expected one of {', '.join(CAPTURE_STYLES)}")
    return style


# --------------------------------------------------------------------------- attention


def register_causal_sdpa() -> str:
    """Register :data:`CAUSAL_SDPA` with HF's attention and mask interfaces; return the name.

    The attention function is HF's ``sdpa_attention_forward`` unchanged; with no mask it
    runs SDPA with ``is_causal=True``. The mask builder returns no mask for a square,
    unshifted causal mask without padding (``attention_mask`` None), sliding window or
    custom mask functions, and defers to HF's ``sdpa_mask`` otherwise. Uncompiled it also
    defers when HF detected packed sequences in ``position_ids``. Under ``torch.compile`` HF
    cannot run that detection (it reads tensor values) and always asks for a packed-aware
    mask: this builder then treats each batch row as one sequence. Contract: a model using
    it under ``torch.compile`` is fed unpacked sequences (the wrappers here take
    ``input_ids`` only, positions ``0..T-1``). Idempotent.
    """
    transformers = require_transformers()
    try:
        from transformers import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask
    except ImportError as e:
        raise ImportError(f"{CAUSAL_SDPA} needs transformers' attention-mask interface (transformers >= 4.53; "
                          f"found {transformers.__version__}); use attn_implementation='sdpa' instead") from e

    def causal_sdpa_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0,
                         kv_offset: int = 0, mask_function: Callable[..., Any] = causal_mask_function,
                         attention_mask: Optional[torch.Tensor] = None, local_size: Optional[int] = None,
                         use_vmap: bool = False, **kwargs: Any) -> Optional[torch.Tensor]:
        plain = (attention_mask is None and local_size is None and not use_vmap
                 and isinstance(q_offset, int) and q_offset == 0 and kv_offset == 0
                 and (torch.compiler.is_compiling() or mask_function is causal_mask_function))
        if plain and q_length == kv_length:
            return None
        return sdpa_mask(batch_size, q_length, kv_length, q_offset=q_offset, kv_offset=kv_offset,
                         mask_function=mask_function, attention_mask=attention_mask,
                         local_size=local_size, use_vmap=use_vmap, **kwargs)

    AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)
    AttentionMaskInterface.register(CAUSAL_SDPA, causal_sdpa_mask)
    log.debug("registered attention implementation %s with transformers %s", CAUSAL_SDPA,
              transformers.__version__)
    return CAUSAL_SDPA


# --------------------------------------------------------------------------- configs


def tiny_config(family: str, num_layers: int = 4, hidden_size: int = 64, intermediate_size: int = 128,
                vocab_size: int = 2048, num_heads: int = 4, num_kv_heads: int = 2,
                head_dim: Optional[int] = None, max_position: int = 4096, **overrides: Any) -> Any:
    """A tiny HF config of ``family`` (a ``transformers`` ``PretrainedConfig``).

    The vocabulary is 32x the hidden size, as in Llama 3 (128256 / 4096): the logits, alive
    when the wrapper concatenates the captures, are the largest tensor of the forward, as
    in real targets. ``head_dim=None``: ``hidden_size // num_heads`` (Qwen2 always uses that). DeepSeek-V3:
    MLA with ``num_heads`` heads (q_lora 32, kv_lora 16, rope 8, nope 16, v 16), layer 0
    dense, then MoE with 8 routed experts of ``intermediate_size // 4`` (2 groups, top-1
    group, 2 per token) plus 1 shared. ``overrides`` are HF config keyword arguments.
    """
    transformers = require_transformers()
    config_cls = getattr(transformers, _CLASSES[_check_family(family)][0])
    if num_heads < 1 or hidden_size % num_heads or num_heads % max(num_kv_heads, 1) or num_kv_heads < 1:
        raise ValueError(f"hidden_size {hidden_size}, num_heads {num_heads}, num_kv_heads {num_kv_heads}: "
                         f"heads must divide hidden_size and kv heads must divide heads")
    kwargs: Dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position, tie_word_embeddings=False,
    )
    if family in ("llama", "qwen3"):
        kwargs["head_dim"] = head_dim if head_dim is not None else hidden_size // num_heads
    elif head_dim is not None:
        raise ValueError(f"{family} takes no head_dim (it is hidden_size // num_heads)")
    if family == "deepseek_v3":
        kwargs.update(
            num_key_value_heads=num_heads, moe_intermediate_size=max(intermediate_size // 4, 8),
            first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
            topk_group=1, n_shared_experts=1, q_lora_rank=32, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        )
    kwargs.update(overrides)
    return config_cls(**kwargs)


def capture_dominated_config(family: str = "llama", **overrides: Any) -> Any:
    """Cheap layers around a wide residual stream: hidden 256, attention 2 heads of 32
    (1 kv head), MLP 64, 8 layers (Eagle3 captures [2, 4, 5]), vocab 8192 (32x hidden, as
    in Llama 3). Like ``models.llama.capture_dominated``: the layers are cheap next to the
    captures, and the concat runs on top of the logits. ``overrides`` as in
    :func:`tiny_config` (Qwen2 ignores the head size: its attention is hidden-wide)."""
    kwargs: Dict[str, Any] = dict(num_layers=8, hidden_size=256, intermediate_size=64, vocab_size=8192,
                                  num_heads=2, num_kv_heads=1, head_dim=32, max_position=32768)
    if family in ("qwen2", "deepseek_v3"):
        kwargs.pop("head_dim")
    kwargs.update(overrides)
    return tiny_config(family, **kwargs)


def build_model(config: Any, seed: int = 0, attn_implementation: str = "sdpa",
                experts_implementation: Optional[str] = None,
                dtype: torch.dtype = torch.float32) -> nn.Module:
    """The ``*ForCausalLM`` of ``config``'s family, seeded with ``seed``, frozen, in eval mode.

    ``attn_implementation``: an HF name or :data:`CAUSAL_SDPA` (registered on demand).
    ``experts_implementation`` (MoE families only, DeepSeek-V3): an HF name (``"grouped_mm"``,
    ``"batched_mm"``, ``"eager"``) or None for HF's default.
    """
    transformers = require_transformers()
    by_config = {cfg: lm for cfg, lm in _CLASSES.values()}
    config_name = type(config).__name__
    if config_name not in by_config:
        raise TypeError(f"unsupported config {config_name}; expected one of {', '.join(sorted(by_config))}")
    if attn_implementation == CAUSAL_SDPA:
        register_causal_sdpa()
    config._attn_implementation = attn_implementation
    if experts_implementation is not None:
        if config_name != "DeepseekV3Config":
            raise ValueError(f"experts_implementation applies to MoE models, not {config_name}")
        config._experts_implementation = experts_implementation
    torch.manual_seed(seed)
    model = getattr(transformers, by_config[config_name])(config)
    return model.to(dtype).eval().requires_grad_(False)


def example_input_ids(vocab_size: int, tokens: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    """``[batch, tokens]`` token ids drawn from a CPU generator seeded ``seed``."""
    if tokens < 1 or batch < 1:
        raise ValueError(f"tokens and batch must be >= 1, got tokens={tokens}, batch={batch}")
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, tokens), generator=g)


# --------------------------------------------------------------------------- capture wrappers


def default_layers(num_layers: int) -> List[int]:
    """Three capture layers where the model has room: Eagle3's ``[2, L // 2, L - 3]`` when
    those are 3 distinct layers (L >= 7), else ``[1, L // 2, L - 1]`` (L = 4..6: e.g. 4 ->
    [1, 2, 3]), else every layer (L <= 3)."""
    eagle3 = eagle3_capture_layers(num_layers)
    if len(eagle3) == 3 or num_layers <= 3:
        return eagle3 if len(eagle3) == 3 else list(range(num_layers))
    return sorted({1, num_layers // 2, num_layers - 1})


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no .model.layers ModuleList: not an HF decoder LM")
    return layers


def _resolve_layers(model: nn.Module, layers: Optional[Sequence[int]]) -> Tuple[int, ...]:
    num_layers = len(_decoder_layers(model))
    chosen = eagle3_capture_layers(num_layers) if layers is None else layers
    return check_capture_layers(chosen, num_layers)


def _install_hf_capturing_hooks(model: nn.Module) -> None:
    """Install now the hooks transformers (>= 5) records ``output_hidden_states`` with.

    transformers installs them lazily, under a ``threading.Lock``, on the first forward that
    asks for hidden states; when that first forward runs under ``torch.compile``, Dynamo
    cannot enter the lock: an error with ``fullgraph=True``, a graph break without. Installing
    them up front leaves only the (traceable) hook calls inside the compiled forward.
    Older transformers collect hidden states without hooks: nothing to do there.
    """
    try:
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except ImportError:
        return
    maybe_install_capturing_hooks(model.model)  # the decoder stack: where capture_outputs sits
    log.debug("installed transformers' hidden-state hooks on %s up front", type(model.model).__name__)


class NoCapture(nn.Module):
    """``(logits, None)``: the target model's forward without captures (memory baseline)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> Tuple[torch.Tensor, None]:
        return self.model(input_ids=input_ids, use_cache=False).logits, None


class HiddenStatesCapture(nn.Module):
    """``output_hidden_states=True``, then ``torch.cat([hidden_states[i] for i in layers], -1)``.

    ``layers=None``: Eagle3's default for the model's depth (``eagle3_capture_layers``).
    The model returns every layer's hidden state; only ``layers`` reach the concat.
    ``select=True`` passes ``output_hidden_states=list(layers)`` instead, so a transformers
    that supports the selection keeps only those (the others come back as ``None``).
    """

    def __init__(self, model: nn.Module, layers: Optional[Sequence[int]] = None, select: bool = False) -> None:
        super().__init__()
        if not isinstance(select, bool):
            raise TypeError(f"select must be a bool, got {select!r}")
        self.model = model
        self.capture_layers = _resolve_layers(model, layers)
        self.select = select
        _install_hf_capturing_hooks(model)

    def forward(self, input_ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        request = list(self.capture_layers) if self.select else True
        out = self.model(input_ids=input_ids, output_hidden_states=request, use_cache=False)
        hidden_states = out.hidden_states
        return out.logits, torch.cat([hidden_states[i] for i in self.capture_layers], dim=-1)


class HookCapture(nn.Module):
    """Forward hooks on the decoder layers append the captures; ``torch.cat(captures, -1)``.

    Capture ``i`` is the output of decoder layer ``i - 1`` (a forward hook), or the input
    of layer 0 for ``i == 0`` (a forward pre-hook): the input of layer ``i``. The hooks stay
    registered until :meth:`remove_hooks` but record only during this wrapper's forward
    (the model called on its own captures nothing); no capture outlives a call.
    """

    def __init__(self, model: nn.Module, layers: Optional[Sequence[int]] = None) -> None:
        super().__init__()
        self.model = model
        self.capture_layers = _resolve_layers(model, layers)
        self._captured: Optional[List[torch.Tensor]] = None  # a list only while recording
        decoder_layers = _decoder_layers(model)
        self._handles = []
        for i in self.capture_layers:
            if i == 0:
                self._handles.append(decoder_layers[0].register_forward_pre_hook(self._capture_input))
            else:
                self._handles.append(decoder_layers[i - 1].register_forward_hook(self._capture_output))

    def _capture_input(self, module: nn.Module, args: Tuple[Any, ...]) -> None:
        if self._captured is not None:
            self._captured.append(args[0])

    def _capture_output(self, module: nn.Module, args: Tuple[Any, ...], output: Any) -> None:
        if self._captured is not None:
            # transformers 5 decoder layers return a tensor, 4.x a tuple whose first item it is
            self._captured.append(output[0] if isinstance(output, tuple) else output)

    def remove_hooks(self) -> None:
        """Unregister the hooks from the wrapped model (the wrapper then captures nothing)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def forward(self, input_ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        self._captured = []
        try:
            logits = self.model(input_ids=input_ids, use_cache=False).logits
            captured = self._captured
        finally:
            self._captured = None
        if len(captured) != len(self.capture_layers):
            raise RuntimeError(f"expected {len(self.capture_layers)} captures from the hooks, "
                               f"got {len(captured)} (hooks removed?)")
        return logits, torch.cat(captured, dim=-1)


def wrap(model: nn.Module, style: str, layers: Optional[Sequence[int]] = None) -> nn.Module:
    """``model`` in the capture wrapper of ``style`` (one of :data:`CAPTURE_STYLES`)."""
    _check_style(style)
    if style == "none":
        return NoCapture(model)
    if style in ("hidden_states", "selected_hidden_states"):
        return HiddenStatesCapture(model, layers, select=style == "selected_hidden_states")
    return HookCapture(model, layers)


# --------------------------------------------------------------------------- factories


def tiny(family: str = "llama", style: str = "hidden_states", tokens: int = 32,
         layers: Optional[Sequence[int]] = None, seed: int = 0, attn_implementation: str = "sdpa",
         experts_implementation: Optional[str] = None,
         **config_overrides: Any) -> Tuple[nn.Module, Tuple[torch.Tensor]]:
    """``(wrapper, (input_ids [1, tokens],))`` around :func:`tiny_config`'s model.

    ``layers=None`` captures :func:`default_layers` (4 layers: [1, 2, 3]).
    """
    config = tiny_config(family, **config_overrides)
    model = build_model(config, seed=seed, attn_implementation=attn_implementation,
                        experts_implementation=experts_implementation)
    layers = default_layers(config.num_hidden_layers) if layers is None else layers
    return wrap(model, style, layers), (example_input_ids(config.vocab_size, tokens, seed=seed),)


def capture_dominated(family: str = "llama", style: str = "hidden_states", tokens: int = 2048,
                      layers: Optional[Sequence[int]] = None, seed: int = 0,
                      attn_implementation: str = CAUSAL_SDPA, experts_implementation: Optional[str] = None,
                      **config_overrides: Any) -> Tuple[nn.Module, Tuple[torch.Tensor]]:
    """Like :func:`tiny` on :func:`capture_dominated_config`, with :data:`CAUSAL_SDPA` attention."""
    config = capture_dominated_config(family, **config_overrides)
    model = build_model(config, seed=seed, attn_implementation=attn_implementation,
                        experts_implementation=experts_implementation)
    layers = default_layers(config.num_hidden_layers) if layers is None else layers
    return wrap(model, style, layers), (example_input_ids(config.vocab_size, tokens, seed=seed),)


def tiny_llama(tokens: int = 32) -> Tuple[nn.Module, Tuple[torch.Tensor]]:
    """The tiny HF Llama in the ``output_hidden_states`` style (for the diff tool)."""
    return tiny("llama", "hidden_states", tokens=tokens)
