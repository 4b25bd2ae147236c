"""SGLang 0.5.23's real ModelRunner extend on the CPU: LlamaForCausalLM (tiny random config,
dummy weights), plugin off vs on, in one process (also the recipe SpecForge's offline capture
backend follows: ScheduleBatch -> ForwardBatch -> ModelRunner.forward, FULL capture).

Needs: SGLANG_USE_CPU_ENGINE=1 (set here) and an import-only stand-in for the ``sgl_kernel``
package (its CPU build is not on PyPI): a module whose names are placeholders raising
NotImplementedError when called, created below; the Llama path on the CPU calls none of them.

    K=12 python benchmarks/sglang_model_runner.py [out.json]     # env: K, NREQ, LEN, LAYERS

ARCH=llama|qwen2_moe|qwen3|gemma3 picks the class (gemma3: a plain-list model, its list adopted);
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM set its widths (default 256 / 256 / 4 / HEADS / 64).
SETTER=dflash sets the capture layers as SGLang's DFlash path does (the model's
``set_dflash_layers_to_capture``, K target layers spread over the depth); default: layers 1..K
set on the inner model directly.
NORM=fused runs SGLang's RMSNorm-with-residual in place (a stand-in for its fused kernel).
PROJECT=plain|norm_before_fc|fc_norms (DRAFT_HIDDEN, default HIDDEN): the plugin's
COMPILE_PASS_SGLANG_PROJECT opt-in with an Eagle3 draft of that combine registered; one more
extend, its stored draft input ([T, H_draft]) against the draft's own cat-then-project.
One tensor-parallel rank's proportions (Llama 3.1 70B at TP=8: attention and MLP widths cut by
8, hidden not): HIDDEN=1024 HEADS=2 KV_HEADS=1 INTER=448.

COMPILE=1: also ``model.forward`` compiled as SGLang's ``--enable-torch-compile`` does it on
the CPU (``cpu_graph_runner.set_torch_compile_config()`` and ``patch_model``: Inductor,
``dynamic=False``, freezing on), then called through ``ModelRunner.forward`` for the same
extend; plugin off (stock Inductor config), then ``enable()`` (its Inductor config) and a
fresh compile. SGLang's own CPU graph runner cannot run here (it needs the ``intel_amx``
attention backend, whose kernels are ``sgl_kernel``'s CPU build; ``torch_native`` has no
``init_cpu_graph_state``), so the extend batch is the one compiled.
"""
import os, sys, tempfile
os.environ["SGLANG_USE_CPU_ENGINE"]="1"
if os.environ.get("PROJECT"):  # the plugin's opt-in, read when it is enabled below
    os.environ["COMPILE_PASS_SGLANG_PROJECT"] = "1"
import _sgl_kernel_stub  # benchmarks/, on sys.path as the script's folder
_sgl_kernel_stub.install()
import torch
from sglang.srt.server_args import ServerArgs
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.model_executor.model_runner import ModelRunner
_env = lambda name, default: int(os.environ.get(name, default))  # noqa: E731
_cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": _env("HIDDEN", 256),
        "intermediate_size": _env("INTER", 256), "num_hidden_layers": _env("LAYERS", 16),
        "num_attention_heads": _env("HEADS", 4), "num_key_value_heads": _env("KV_HEADS", _env("HEADS", 4)),
        "head_dim": _env("HEAD_DIM", 64), "vocab_size": 1000,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "torch_dtype": os.environ.get("DTYPE", "float32"),
        "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}
if os.environ.get("ARCH", "llama") == "qwen2_moe":  # ARCH=qwen2_moe: a tiny random MoE config
    _cfg.update({"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "num_experts": 4,
                 "num_experts_per_tok": 2, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 0,
                 "decoder_sparse_step": 1, "norm_topk_prob": False, "mlp_only_layers": [], "use_sliding_window": False})
if os.environ.get("ARCH", "llama") == "qwen3":  # ARCH=qwen3: Qwen3's q/k norms, no attention bias
    _cfg.update({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
                 "rms_norm_eps": 1e-6, "max_window_layers": _cfg["num_hidden_layers"], "use_sliding_window": False})
if os.environ.get("ARCH", "llama") == "gemma3":  # ARCH=gemma3: a plain-list model (list adopted)
    _nl = _cfg["num_hidden_layers"]
    _cfg.update({"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "head_dim": 64,
                 "query_pre_attn_scalar": 64, "sliding_window": 4096, "rope_local_base_freq": 10000.0,
                 "layer_types": ["full_attention"] * _nl, "hidden_activation": "gelu_pytorch_tanh",
                 "final_logit_softcapping": None, "attn_logit_softcapping": None, "rms_norm_eps": 1e-6,
                 "tie_word_embeddings": True})
if os.environ.get("NORM", "native") == "fused":
    # NORM=fused: SGLang's RMSNorm with a residual runs in place, as its CUDA and CPU kernels
    # (fused_add_rmsnorm / sgl_kernel's fused_add_rmsnorm_cpu, neither loadable here) do:
    # residual += x, then x = rmsnorm(residual) * weight, row block by row block. A stand-in
    # written here for the kernel, not SGLang code; its eager fp32 forward_native keeps about
    # four [tokens, hidden] temporaries alive per norm that no served build has.
    from sglang.srt.layers.layernorm import RMSNorm as _RMSNorm
    _native = _RMSNorm.forward_native
    def _fused_add_rmsnorm_(self, x, residual=None, post_residual_addition=None, quant_linear=None):
        if (residual is None or post_residual_addition is not None or self.variance_size_override is not None
                or not (x.is_contiguous() and residual.is_contiguous()) or x.shape != residual.shape):
            return _native(self, x, residual, post_residual_addition, quant_linear)
        residual.add_(x)
        rows_r, rows_x = residual.view(-1, residual.shape[-1]), x.view(-1, x.shape[-1])
        for s_ in range(0, rows_r.shape[0], 128):
            r_ = rows_r[s_:s_ + 128].float()
            rows_x[s_:s_ + 128] = (r_ * torch.rsqrt(r_.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
                                   * self.weight.float()).to(x.dtype)
        return x, residual
    _RMSNorm.forward_native = _fused_add_rmsnorm_
_dir = tempfile.mkdtemp(prefix="sglang_tiny_model_")
import json as _json
with open(os.path.join(_dir, "config.json"), "w") as _f:
    _json.dump(_cfg, _f)
sa = ServerArgs(model_path=_dir, skip_tokenizer_init=True, load_format="dummy", device="cpu", dtype=os.environ.get("DTYPE", "float32"),
    disable_cuda_graph=True, chunked_prefill_size=-1, max_total_tokens=8192, mem_fraction_static=0.5, enable_return_hidden_states=True)
print("server args ok")
from sglang.srt.runtime_context import publish, SpawnRanks
publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
from sglang.srt.distributed.bootstrap import init_parallel_runtime
import socket
def _free_port():
    with socket.socket() as s_:
        s_.bind(("127.0.0.1", 0)); return s_.getsockname()[1]
init_parallel_runtime(server_args=sa, device="cpu", dist_port=_free_port())
mc = ModelConfig.from_server_args(sa)
mr = ModelRunner(model_config=mc, mem_fraction_static=sa.mem_fraction_static, gpu_id=0, nccl_port=_free_port(), server_args=sa)
print("runner ok", type(mr.model))
mr.alloc_memory_pool()
mr.init_attention_backends()
mr.init_cuda_graphs()
from array import array
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from compile_pass.memory import measure_peak
import json
NREQ, L = int(os.environ.get("NREQ", 4)), int(os.environ.get("LEN", 512))
torch.manual_seed(0)
ids = torch.randint(3, 1000, (NREQ, L))
def make_fb():
    mr.req_to_token_pool.clear(); mr.token_to_kv_pool_allocator.clear()
    sp = SamplingParams(temperature=0, max_new_tokens=1, top_k=1)
    cp = CacheInitParams(disable=False, req_to_token_pool=mr.req_to_token_pool,
        token_to_kv_pool_allocator=mr.token_to_kv_pool_allocator, page_size=getattr(mr, "page_size", None) or 1)
    tc = RadixCache(cp)
    reqs = []
    for i in range(NREQ):
        r = Req(rid=str(i), origin_input_text="", origin_input_ids=array("q", ids[i].tolist()), sampling_params=sp)
        r.init_next_round_input(tc)
        r.extend_end = r.prefix_len + len(r.origin_input_ids) - r.prefix_len
        reqs.append(r)
    b = ScheduleBatch.init_new(reqs=reqs, req_to_token_pool=mr.req_to_token_pool,
        token_to_kv_pool_allocator=mr.token_to_kv_pool_allocator, tree_cache=tc,
        model_config=mr.model_config, enable_overlap=False, spec_algorithm=SpeculativeAlgorithm.NONE)
    b.prepare_for_extend()
    if getattr(b, "prefill_input_ids_cpu", None) is not None:
        b.input_ids = b.prefill_input_ids_cpu.to(b.device); b.prefill_input_ids_cpu = None
    b.capture_hidden_mode = CaptureHiddenMode.FULL
    fb = ForwardBatch.init_new(b, mr, return_hidden_states_before_norm=False)
    fb.capture_hidden_mode = CaptureHiddenMode.FULL
    return fb
def run():
    fb = make_fb()
    with torch.no_grad():
        p = measure_peak(mr.forward, fb)
    out = p.result.logits_output if hasattr(p.result, "logits_output") else p.result
    return p.bytes, out
K = int(os.environ.get("K", 7)); nl = 10
m = mr.model
base, o0 = run()
print("base ok", base)
m.capture_aux_hidden_states = True
SETTER = os.environ.get("SETTER", "direct")
if SETTER == "dflash":
    # SGLang's own DFlash path (configure_aux_hidden_state_capture with dflash_use_aux_hidden_state):
    # the model's set_dflash_layers_to_capture with K target layers spread over the depth
    _n = _cfg["num_hidden_layers"]
    m.set_dflash_layers_to_capture([i * (_n - 2) // (K - 1) for i in range(K)])
elif hasattr(m.model, "set_eagle3_layers_to_capture") and _cfg["model_type"] != "llama":
    m.model.set_eagle3_layers_to_capture(list(range(1, 1 + K)))  # qwen2_moe: flags the layers too
else:
    m.model.layers_to_capture = list(range(1, 1 + K))
off, o1 = run(); h_off = o1.hidden_states.clone()
from compile_pass.integrations import sglang as plugin
packed = NREQ * L * _cfg["hidden_size"] * K * getattr(torch, _cfg["torch_dtype"]).itemsize
def make_draft():
    """PROJECT=plain|norm_before_fc|fc_norms: an Eagle3 draft of that combine, handed to the
    plugin as its draft-loading hook hands a loaded draft. DRAFT=sglang: SGLang's own
    ``llama_eagle3.LlamaForCausalLMEagle3`` (one layer, hidden DRAFT_HIDDEN, the target's
    heads: its attention runs on the target's KV pool layout; random weights, seed 1);
    default: a module shaped like SGLang's ``llama_eagle3.LlamaModel`` (fc,
    num_aux_hidden_states, input_norm / fc_norm)."""
    from sglang.srt.layers.layernorm import RMSNorm as _Norm
    PROJECT, _H = os.environ["PROJECT"], _cfg["hidden_size"]
    _HD = _env("DRAFT_HIDDEN", _H)
    g = torch.Generator().manual_seed(1)
    if os.environ.get("DRAFT") == "sglang_dflash":
        # SGLang's DFlash draft (dflash.DFlashDraftModel): fc [K*H -> H], then hidden_norm;
        # its target layers those SETTER=dflash captures
        from transformers import LlamaConfig
        from sglang.srt.models.dflash import DFlashDraftModel
        dc = LlamaConfig(hidden_size=_H, intermediate_size=_cfg["intermediate_size"], num_hidden_layers=1,
                         num_attention_heads=_cfg["num_attention_heads"], num_key_value_heads=_cfg["num_key_value_heads"],
                         head_dim=_cfg["head_dim"], vocab_size=_cfg["vocab_size"], rms_norm_eps=1e-5,
                         max_position_embeddings=4096, rope_theta=10000.0)
        dc.dflash_config = {"target_layer_ids": [i - 1 for i in m.model.layers_to_capture], "block_size": 16}
        draft = DFlashDraftModel(dc).to(getattr(torch, _cfg["torch_dtype"])).requires_grad_(False)
        with torch.no_grad():
            for p_ in draft.parameters():
                r_ = torch.randn(p_.shape, generator=g)
                p_.copy_(1 + 0.1 * r_ if p_.dim() == 1 else r_ * p_.shape[-1] ** -0.5)
        return draft
    if os.environ.get("DRAFT") == "sglang":
        from transformers import LlamaConfig
        from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
        dc = LlamaConfig(hidden_size=_HD, intermediate_size=_cfg["intermediate_size"], num_hidden_layers=1,
                         num_attention_heads=_cfg["num_attention_heads"], num_key_value_heads=_cfg["num_key_value_heads"],
                         head_dim=_cfg["head_dim"], vocab_size=_cfg["vocab_size"], rms_norm_eps=1e-5,
                         max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=False)
        dc.target_hidden_size, dc.num_aux_hidden_states, dc.draft_vocab_size = _H, K, _cfg["vocab_size"]
        dc.eagle_config = {"norm_before_fc": PROJECT == "norm_before_fc"}
        dc.fc_norm = PROJECT == "fc_norms"
        draft = LlamaForCausalLMEagle3(dc).to(getattr(torch, _cfg["torch_dtype"])).requires_grad_(False)
        with torch.no_grad():
            for p_ in draft.parameters():  # norms around 1, matrices scaled by their fan-in
                r_ = torch.randn(p_.shape, generator=g)
                p_.copy_(1 + 0.1 * r_ if p_.dim() == 1 else r_ * p_.shape[-1] ** -0.5)
        return draft

    class _Eagle3Inner(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.num_aux_hidden_states = K
            self.fc = torch.nn.Linear(K * _H, _HD, bias=False)
            self.input_norm = _Norm(K * _H, eps=1e-5) if PROJECT == "norm_before_fc" else None
            self.fc_norm = torch.nn.ModuleList(_Norm(_H, eps=1e-5) for _ in range(K)) if PROJECT == "fc_norms" else None
            with torch.no_grad():
                self.fc.weight.copy_(torch.randn(_HD, K * _H, generator=g) * (K * _H) ** -0.5)
                for n_ in [self.input_norm, *(self.fc_norm or [])]:
                    if n_ is not None:
                        n_.weight.copy_(1 + 0.1 * torch.randn(n_.weight.shape, generator=g))
    draft = torch.nn.Module(); draft.model = _Eagle3Inner()
    return draft.requires_grad_(False)


def draft_proposals(draft, target_hidden):
    """DRAFT=sglang: the greedy token SGLang's draft proposes at every position of the
    extend batch, reading ``target_hidden`` as its ``spec_info.hidden_states`` (the packed
    [T, K*H]: it applies its norms and fc; [T, H_draft]: it reads it as is), and its
    pre-logits hidden states."""
    from types import SimpleNamespace
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    fb = make_fb()
    fb.spec_info = SimpleNamespace(hidden_states=target_hidden)
    mr.attn_backend.init_forward_metadata(fb)
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=mr.attn_backend), forward_batch=fb):
        hidden, _ = draft.model(fb.input_ids, fb.positions, fb)
    return (hidden.float() @ draft.lm_head.weight.float().t()).argmax(-1), hidden


def draft_reference(draft, packed):
    """What the draft computes from the list path's packed captures (its norms, then fc; a
    DFlash draft: its own ``project_target_hidden``, fc then hidden_norm)."""
    if hasattr(draft, "project_target_hidden"):
        with torch.no_grad():
            return draft.project_target_hidden(packed)
    from compile_pass.ops import rms_norm as _rms
    inner, hidden = draft.model, _cfg["hidden_size"]
    with torch.no_grad():
        x = packed
        if inner.input_norm is not None:
            x = _rms(x, inner.input_norm.weight, 1e-5)
        if inner.fc_norm is not None:
            x = torch.cat([_rms(c, n_.weight, 1e-5) for c, n_ in zip(x.split(hidden, -1), inner.fc_norm)], -1)
        return inner.fc(x)


if os.environ.get("COMPILE", "0") == "1":
    from types import SimpleNamespace
    from sglang.srt.model_executor.cpu_graph_runner import patch_model, set_torch_compile_config
    import torch._dynamo
    from torch._dynamo.utils import counters
    set_torch_compile_config()
    eager_fwd = m.forward
    logits_ref = o1.next_token_logits.clone()
    def compiled_peaks():
        torch._dynamo.reset()
        m.forward = eager_fwd
        with patch_model(m, True, num_tokens=NREQ * L, tp_group=SimpleNamespace(ca_comm=None)) as fwd:
            m.forward = fwd
            layers, m.model.layers_to_capture = m.model.layers_to_capture, []
            m.capture_aux_hidden_states = False
            run(); b, _ = run()
            m.capture_aux_hidden_states, m.model.layers_to_capture = True, layers
            run(); c, o = run()
        m.forward = eager_fwd
        return b, c, o
    cb_off, c_off, oc1 = compiled_peaks(); hc_off = oc1.hidden_states.clone(); lc_off = oc1.next_token_logits.clone()
    print("enable", plugin.enable())
    cb_on, c_on, oc2 = compiled_peaks()
    hc_on = oc2.hidden_states
    res = {"K": K, "layers": _cfg["num_hidden_layers"], "tokens": NREQ * L, "compiled": "torch.compile(no_grad(model.forward), dynamic=False), freezing",
           "eager_overhead_off": round((off - base) / packed, 3),
           "compiled_overhead_off": round((c_off - cb_off) / packed, 3), "compiled_overhead_on": round((c_on - cb_on) / packed, 3),
           "compiled_peak_off": c_off, "compiled_peak_on": c_on,
           "on_vs_off_bitwise": bool(torch.equal(hc_off, hc_on)),
           "on_max_abs_vs_uncompiled": float((hc_on - h_off).abs().max()), "off_max_abs_vs_uncompiled": float((hc_off - h_off).abs().max()),
           "logits_on_max_abs_vs_uncompiled": float((oc2.next_token_logits - logits_ref).abs().max()),
           "graphs": int(counters["stats"]["unique_graphs"]), "graph_breaks": sum(counters["graph_break"].values()),
           "aux_capture": dict(counters["aux_capture"]), "plugin_inductor": plugin.STATE["inductor"]}
    if os.environ.get("PROJECT"):
        # the draft's input projected (COMPILE_PASS_SGLANG_PROJECT): the logits hook's combine
        # traced into the compiled forward, folded into the captures by fuse_projection
        from compile_pass.integrations import sglang_projection
        _draft = make_draft()
        print("draft registered", sglang_projection.register_draft(_draft))
        before = counters["aux_capture"].get("groups_projected", 0)
        cb_p, c_p, oc3 = compiled_peaks()
        _ref = draft_reference(_draft, h_off)
        res.update({"combine": os.environ["PROJECT"], "compiled_overhead_projected": round((c_p - cb_p) / packed, 3),
                    "compiled_stored_shape": list(oc3.hidden_states.shape),
                    "compiled_groups_projected": counters["aux_capture"].get("groups_projected", 0) - before,
                    "compiled_max_rel_vs_cat_then_project": float((oc3.hidden_states - _ref).abs().max() / _ref.abs().max()),
                    "compiled_logits_projected_equal_on": bool(torch.equal(oc3.next_token_logits, oc2.next_token_logits))})
    print(json.dumps(res))
    if len(sys.argv) > 1:
        open(sys.argv[1], "w").write(json.dumps(res, indent=1) + "\n")
    sys.exit(0)
print("enable", plugin.enable())
on, o2 = run(); h_on = o2.hidden_states


def run_bypassing_model_runner_forward():
    """The model's forward without ``ModelRunner.forward`` around it, as SGLang's CUDA-graph
    runners capture it (``ModelRunner._forward_raw``: the eager runner's own call of
    ``model.forward``): K comes from the model ``configure_aux_hidden_state_capture`` set
    capture layers on, called here through model_runner's own binding (None: not
    applicable to this model or setter)."""
    if SETTER != "direct" or ARCH not in ("llama", "qwen3"):
        return None
    import sglang.srt.model_executor.model_runner as _mr_mod
    layers = list(m.model.layers_to_capture)
    _mr_mod.configure_aux_hidden_state_capture(
        model=m, eagle_use_aux_hidden_state=True, eagle_aux_hidden_state_layer_ids=[i - 1 for i in layers],
        dflash_use_aux_hidden_state=False, dflash_target_layer_ids=None, is_dspark=False)
    if list(m.model.layers_to_capture) != layers:  # this model's setter maps ids otherwise
        m.model.layers_to_capture = layers
        return None
    fb = make_fb()
    with torch.no_grad():
        p = measure_peak(ModelRunner._forward_raw, mr, fb, None)
    return p.bytes, p.result.logits_output


ARCH = os.environ.get("ARCH", "llama")
bypass = run_bypassing_model_runner_forward()
if os.environ.get("PROJECT"):
    # the same extend once more, with the draft registered
    from compile_pass.integrations import sglang_projection
    PROJECT, _H = os.environ["PROJECT"], _cfg["hidden_size"]
    _HD = _env("DRAFT_HIDDEN", _H)
    _draft = make_draft()
    print("draft registered", sglang_projection.register_draft(_draft))
    proj, o3 = run()
    _ref = draft_reference(_draft, h_off)
    _got = o3.hidden_states
    if hasattr(_draft, "project_target_hidden"):
        # DFlash: what its worker computes from the stored input (through the plugin's hook on
        # project_target_hidden: hidden_norm alone on an input already projected)
        with torch.no_grad():
            _got = _draft.project_target_hidden(o3.hidden_states)
    # the width SGLang's draft-extend CUDA-graph runner sizes its static hidden-state buffer
    # with, through that module's own binding of the function (a draft runner's config)
    import types
    import sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner as _dx
    _runner = types.SimpleNamespace(
        model_config=types.SimpleNamespace(hf_config=types.SimpleNamespace(target_hidden_size=_H, num_aux_hidden_states=K),
                                           hidden_size=_HD, spec_hidden_size=_HD),
        spec_algorithm=types.SimpleNamespace(is_eagle3=lambda: True))
    projected_width = _dx.get_draft_input_from_target_hidden_dim(_runner)
    bypass_projected = run_bypassing_model_runner_forward()
    if bypass_projected is not None:
        bypass_projected = (bypass_projected[0], bool(torch.equal(bypass_projected[1].hidden_states, _got)))
    projected = {"combine": PROJECT, "draft_hidden": _HD, "peak_projected": proj,
                 "draft_cuda_graph_input_width": projected_width,
                 "overhead_projected": round((proj - base) / packed, 3),
                 "stored_shape": list(_got.shape), "projected_forwards": plugin.STATE["projected"],
                 "max_abs_vs_cat_then_project": float((_got - _ref).abs().max()),
                 "max_rel_vs_cat_then_project": float((_got - _ref).abs().max() / _ref.abs().max()),
                 "logits_equal_no_capture_projected": bool(torch.equal(o0.next_token_logits, o3.next_token_logits))}
    if os.environ.get("DRAFT") == "sglang":
        # the draft's proposals on the same extend: from the list path's packed captures (it
        # projects them itself) and from the projected input (it reads it as is)
        # (a copy each: the draft's first layer adds into its input in place, as SGLang's fused
        # add-RMSNorm does into its fc's output without the switch)
        tok_packed, hid_packed = draft_proposals(_draft, h_off.clone())
        tok_projected, hid_projected = draft_proposals(_draft, _got.clone())
        projected.update({"draft": type(_draft).__module__ + "." + type(_draft).__qualname__,
                          "dtype": _cfg["torch_dtype"],
                          "proposal_agreement": float((tok_packed == tok_projected).float().mean()),
                          "proposals": int(tok_packed.numel()),
                          "draft_hidden_max_rel": float((hid_projected.float() - hid_packed.float()).abs().max()
                                                        / hid_packed.float().abs().max())})
    if bypass_projected is not None:
        projected.update({"bypass_overhead_projected": round((bypass_projected[0] - base) / packed, 3),
                          "bypass_projected_equal": bypass_projected[1]})
res = ({"K": K, "layers": _cfg["num_hidden_layers"], "model": _cfg["architectures"][0], "tokens": NREQ * L, "overhead_off": round((off - base) / packed, 3),
  "overhead_on": round((on - base) / packed, 3), "peak_base": base, "peak_off": off, "peak_on": on,
  "packed_bytes": packed, "adopted": plugin.STATE["adopted"], "bitwise": bool(torch.equal(h_off, h_on)),
  "logits_equal": bool(torch.equal(o1.next_token_logits, o2.next_token_logits)),
  "logits_equal_no_capture": bool(torch.equal(o0.next_token_logits, o2.next_token_logits)),
  "hidden": _cfg["hidden_size"], "norm": os.environ.get("NORM", "native"),
  "packed_views": plugin.STATE["packed"], "fallbacks": plugin.STATE["fallbacks"], "setter": SETTER,
  "capture_layers": list(m.model.layers_to_capture)})
if bypass is not None:
    res.update({"bypass_overhead_on": round((bypass[0] - base) / packed, 3),
                "bypass_bitwise": bool(torch.equal(bypass[1].hidden_states, h_off))})
if os.environ.get("PROJECT"):
    res.update(projected)
print(json.dumps(res))
if len(sys.argv) > 1:
    open(sys.argv[1], "w").write(json.dumps(res, indent=1) + "\n")
