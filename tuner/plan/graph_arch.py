"""The worst-case compute graph llama.cpp reserves, per architecture, as tensor shapes (tuner.plan.graph_alloc).

Each builder follows its ``src/models/*.cpp`` graph at the pinned commit and the shared pieces of
``src/llama-graph.cpp`` (``build_inp_embd``, ``build_qkv``, ``build_attn`` / ``build_attn_mha``, ``build_moe_ffn``,
``build_ffn``, ``build_rs``) and ``src/models/delta-net-base.cpp``, op by op and in the same order of
``ggml_build_forward_expand`` calls, since the allocator's peak depends on both. The reserve graph is the one
``llama_context::sched_reserve`` sizes: ``n_tokens = min(n_ctx, n_ubatch)`` tokens, all of them outputs (the
default ``n_outputs_max`` is the batch), one sequence per stream, the KV views spanning the whole cache.
Pure: shapes only, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from tuner.core.model import ModelInfo
from tuner.plan import graph_alloc as g
from tuner.plan.graph_alloc import F16, F32, I32, I64, Graph, Tensor

# ggml-cuda.cu's MOE_WEIGHTED_REDUCTION_MAX_EXPERTS: the most experts a token uses for the fused weighted sum.
CUDA_MOE_REDUCTION_MAX_EXPERTS = 15
HYBRID_ARCHS = frozenset({"qwen35moe", "qwen35", "qwen3next"})
# Archs whose last layer gathers the output rows before the FFN (the others gather after the final norm, since
# ``cparams.embeddings_nextn_masked`` is false by default).
GATHER_IN_LAST_LAYER = frozenset({"qwen3moe", "olmoe", "glm4moe"})
GRAPH_ARCHS = frozenset({"qwen3moe", "olmoe", "glm4moe", "gpt-oss"}) | HYBRID_ARCHS


@dataclass(frozen=True, slots=True)
class ReserveShape:
    """What the reserve graph depends on besides the model."""

    n_tokens: int
    n_kv: int  # cells of a full-attention layer's stream
    n_kv_swa: int  # cells of a sliding-window layer's stream
    n_stream: int
    flash_attn: bool
    quant_k: bool  # a quantized K cache: K (and Q) go through a Hadamard rotation first
    quant_v: bool
    n_outputs: int = 0  # rows the reserve graph outputs (``out_ids``); 0: every token
    # Beside a GPU (``ggml_backend_sched_split_graph``): the inputs and the token embedding's GET_ROWS run on the
    # host, and these host weights' matmuls, when offloaded, read a copy of the weight (name → bytes it takes).
    split: bool = False
    host_weights: tuple[tuple[str, int], ...] = ()
    offload_min_batch: int = 0  # 0: --no-op-offload


class _Builder:
    def __init__(self, model: ModelInfo, shape: ReserveShape) -> None:
        self.m, self.s, self.gf = model, shape, Graph()
        self.names = {t.name: t.shape for t in model.tensors}
        self.T = shape.n_tokens
        self.E = model.n_embd
        nextn = {t.layer for t in model.tensors if t.layer is not None and ".nextn." in t.name}
        self.n_layer = model.n_layer - len(nextn)
        self.host_weights = dict(shape.host_weights)

    def out_ids(self) -> Tensor:
        return g.inp(self.s.n_outputs or self.T, es=I32)

    def offload(self, node: Tensor, batch: int) -> Tensor:
        """``ggml_backend_sched_backend_id_from_cur``: a matmul whose weight is on the host runs on the GPU, reading
        a copy of the weight, when ``ggml_backend_cuda_device_offload_op`` takes it (batch >= the minimum, 32);
        else on the host."""
        w = node.src[0]
        if w.copy_bytes:
            if self.s.offload_min_batch and batch >= self.s.offload_min_batch:
                return node
            w.copy_bytes = 0
        if w.host:
            node.host = True
        return node

    def has(self, il: int, name: str) -> bool:
        return f"blk.{il}.{name}" in self.names

    def w(self, name: str) -> Tensor:
        shape = self.names.get(name)
        t = g.weight(*(shape or (1,)))
        if name in self.host_weights:
            t.host, t.copy_bytes = True, self.host_weights[name]
        return t

    def lw(self, il: int, name: str) -> Tensor:
        return self.w(f"blk.{il}.{name}")

    def norm(self, x: Tensor, il: int | None, name: str) -> Tensor:
        """``build_norm`` with RMS: rms_norm, then the weight multiplied in."""
        weight = self.w(name) if il is None else self.lw(il, name)
        return g.same_shape("MUL", g.same_shape("RMS_NORM", x), weight)

    # --- inputs ---------------------------------------------------------------------------------------------

    def inp_embd(self) -> Tensor:
        tokens = g.inp(self.T, es=I32)
        embd = g.inp(self.E, self.T)  # the vector-embeddings input: allocated, never read (ggml_build_forward_select)
        rows = g.get_rows(self.w("token_embd.weight"), tokens)
        rows.host = self.s.split  # the embedding stays on the host and GET_ROWS is never offloaded
        self.gf.expand(rows, embd)
        return rows

    def attn_inputs(self, swa: bool) -> dict[str, Tensor]:
        s, m = self.s, self.m
        n_kv = s.n_kv_swa if swa else s.n_kv
        n_embd_v_gqa = max(m.n_head_kv) * m.head_dim_v
        v_rows = self.T if s.flash_attn else self.T * n_embd_v_gqa  # a transposed V cache is set per element
        mask = g.inp(n_kv, self.T // s.n_stream, 1, s.n_stream, es=F16 if s.flash_attn else F32)
        out = {"k_idxs": g.inp(self.T, es=I64), "v_idxs": g.inp(v_rows, es=I64), "mask": mask}
        if s.quant_k and m.head_dim_k % 64 == 0:
            n = _rot_size(m.head_dim_k)
            out["k_rot"] = g.inp(n, n)
        if s.quant_v and m.head_dim_v % 64 == 0:
            n = _rot_size(m.head_dim_v)
            out["v_rot"] = g.inp(n, n)
        return out

    # --- attention ----------------------------------------------------------------------------------------

    def attn(self, inp: dict[str, Tensor], il: int, q: Tensor, k: Tensor, v: Tensor, *, qvk_order: bool,
             sinks: Tensor | None = None, n_kv: int | None = None) -> Tensor:
        """``build_attn`` with a KV cache (``llama_kv_cache``: q, v, k expanded; the iSWA one: q, k, v)."""
        s, m, T = self.s, self.m, self.T
        if "k_rot" in inp:
            q, k = _hadamard(q, inp["k_rot"]), _hadamard(k, inp["k_rot"])
        if "v_rot" in inp:
            v = _hadamard(v, inp["v_rot"])
        self.gf.expand(*((q, v, k) if qvk_order else (q, k, v)))
        hd, hv, n_head_kv = m.head_dim_k, m.head_dim_v, m.n_head_kv[il]
        n_kv = n_kv or s.n_kv
        size = n_kv * s.n_stream
        k_cache = g.cache(hd * n_head_kv, size)
        v_cache = g.cache(hv * n_head_kv, size)
        k2 = g.view(k, (hd * n_head_kv, T), (k.nb[2],))
        self.gf.expand(g.into("SET_ROWS", k_cache, (k2, inp["k_idxs"], k_cache)))
        if s.flash_attn:
            v2 = g.view(v, (hv * n_head_kv, T), (v.nb[2],))
            self.gf.expand(g.into("SET_ROWS", v_cache, (v2, inp["v_idxs"], v_cache)))
        else:
            v2 = g.reshape(g.reshape(v, hv * n_head_kv, T), 1, hv * n_head_kv * T)
            flat = g.reshape(v_cache, 1, hv * n_head_kv * size)
            self.gf.expand(g.into("SET_ROWS", flat, (v2, inp["v_idxs"], flat)))
        kv_k = g.view(k_cache, (hd, n_head_kv, n_kv, s.n_stream))
        kv_v = g.view(v_cache, (hv, n_head_kv, n_kv, s.n_stream)) if s.flash_attn else \
            g.view(v_cache, (n_kv, n_head_kv, hv, s.n_stream))
        out = self.mha(q, kv_k, kv_v, inp["mask"], sinks)
        if "v_rot" in inp:
            out = _hadamard(out, inp["v_rot"])
        return out

    def mha(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, sinks: Tensor | None) -> Tensor:
        """``build_attn_mha``."""
        ns, T = self.s.n_stream, self.T
        q = g.view(q, (q.ne[0], q.ne[1], T // ns, ns), (q.nb[1], q.nb[2], q.nb[2] * (T // ns)))
        q, k, v = (g.permute(x, (0, 2, 1, 3)) for x in (q, k, v))
        if self.s.flash_attn:
            cur = g.flash_attn(q, k, v, mask, sinks)
            cur = g.reshape(cur, cur.ne[0] * cur.ne[1], cur.ne[2] * cur.ne[3])
        else:
            kq = g.soft_max(g.mul_mat(k, q), mask, sinks)
            kqv = g.mul_mat(v, kq)
            cur = g.permute(kqv, (0, 2, 1, 3))
            cur = g.cont(cur, cur.ne[0] * cur.ne[1], cur.ne[2] * cur.ne[3])
        self.gf.expand(cur)
        return cur

    def qkv(self, il: int, cur: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``build_qkv``'s separate path, without the reshape: the three projections with their biases."""
        out = []
        for name in ("attn_q", "attn_k", "attn_v"):
            x = g.mul_mat(self.lw(il, f"{name}.weight"), cur)
            if self.has(il, f"{name}.bias"):
                x = g.same_shape("ADD", x, self.lw(il, f"{name}.bias"))
            out.append(x)
        return out[0], out[1], out[2]

    # --- feed-forward -------------------------------------------------------------------------------------

    def ffn(self, cur: Tensor, il: int, suffix: str = "") -> Tensor:
        """``build_ffn`` with SiLU and a parallel gate (dense layers and shared experts)."""
        up = g.mul_mat(self.lw(il, f"ffn_up{suffix}.weight"), cur)
        gate = g.mul_mat(self.lw(il, f"ffn_gate{suffix}.weight"), cur)
        return g.mul_mat(self.lw(il, f"ffn_down{suffix}.weight"), g.glu(gate, up))

    def moe(self, cur: Tensor, il: int, gating: str, norm_w: bool) -> Tensor:
        """``build_moe_ffn``: router, top-k, the used experts' up/gate/down, weighting, the sum over experts."""
        m, T, E = self.m, cur.ne[1], self.E
        n_exp, n_used = m.n_expert, m.n_expert_used
        logits = g.mul_mat(self.lw(il, "ffn_gate_inp.weight"), cur)
        if self.has(il, "ffn_gate_inp.bias"):
            logits = g.same_shape("ADD", logits, self.lw(il, "ffn_gate_inp.bias"))
        probs = {"softmax": lambda x: g.soft_max(x), "sigmoid": lambda x: g.same_shape("UNARY", x),
                 "softmax_weight": lambda x: x}[gating](logits)
        selection = probs
        if self.has(il, "exp_probs_b.bias"):
            selection = g.same_shape("ADD", probs, self.lw(il, "exp_probs_b.bias"))
        selected = g.argsort_top_k(selection, n_used)
        weights = g.get_rows(g.reshape(probs, 1, n_exp, T), selected)
        if gating == "softmax_weight":
            weights = g.reshape(g.soft_max(g.reshape(weights, n_used, T)), 1, n_used, T)
        if norm_w:
            w2 = g.reshape(weights, n_used, T)
            total = g.same_shape("CLAMP", g.sum_rows(w2))
            weights = g.reshape(g.same_shape("DIV", w2, total), 1, n_used, T)
        self.gf.expand(weights)
        x = g.reshape(cur, E, 1, T)
        up = self.offload(g.mul_mat_id(self.lw(il, "ffn_up_exps.weight"), x, selected), T)
        if self.has(il, "ffn_up_exps.bias"):
            up = g.same_shape("ADD_ID", up, self.lw(il, "ffn_up_exps.bias"), selected)
        gate = self.offload(g.mul_mat_id(self.lw(il, "ffn_gate_exps.weight"), x, selected), T)
        if self.has(il, "ffn_gate_exps.bias"):
            gate = g.same_shape("ADD_ID", gate, self.lw(il, "ffn_gate_exps.bias"), selected)
        act = g.glu(gate, up)
        # ggml_backend_sched_split_graph pass 2: an op without weights goes with its neighbours, and the host's
        # backend spreads down only after every GPU's has spread up and down: between host experts' up/gate and
        # down, the activation stays on the host.
        act.host = gate.host and up.host
        experts = self.offload(g.mul_mat_id(self.lw(il, "ffn_down_exps.weight"), act, selected), T)
        if self.has(il, "ffn_down_exps.bias"):
            experts = g.same_shape("ADD_ID", experts, self.lw(il, "ffn_down_exps.bias"), selected)
        experts = g.same_shape("MUL", experts, weights)
        self.gf.expand(experts)
        views = [g.view(experts, (E, T), (experts.nb[2],)) for _ in range(n_used)]
        self.gf.expand(*views)
        out = views[0]
        for v in views[1:]:
            out = g.same_shape("ADD", out, v)
            self.gf.expand(out)
        if self.s.split and 2 <= n_used <= CUDA_MOE_REDUCTION_MAX_EXPERTS:
            # ggml_backend_cuda_graph_optimize: the weighting and the sum over experts match
            # ggml_cuda_match_moe_weighted_reduction, and the fusion keeps the unweighted experts (their copy, when
            # host experts ran on the host) and the router weights allocated until the sum (add_alloc_dep), so the
            # MUL cannot take the experts' memory in place.
            self.gf.keep_sources_until(out, experts)
        return g.cont(out) if n_used == 1 else out

    def shared_gated(self, cur: Tensor, il: int, moe_out: Tensor) -> Tensor:
        """Qwen3.5 / Qwen3-Next: the shared expert scaled by its own sigmoid gate, added to the routed sum."""
        if not self.has(il, "ffn_up_shexp.weight"):
            return moe_out
        shexp = self.ffn(cur, il, "_shexp")
        gate = g.same_shape("UNARY", g.mul_mat(self.lw(il, "ffn_gate_inp_shexp.weight"), cur))
        return g.same_shape("ADD", moe_out, g.same_shape("MUL", shexp, gate))


def _rot_size(head_dim: int) -> int:
    """``llama_kv_cache::build_input_k_rot``: the largest power of two from 64 that divides the head."""
    n = 64
    while head_dim % (n * 2) == 0:
        n *= 2
    return n


def _hadamard(x: Tensor, rot: Tensor) -> Tensor:
    """``llama_mul_mat_hadamard`` (src/llama-impl.h)."""
    n = rot.ne[0]
    count = x.ne[0] * x.ne[1] * x.ne[2] * x.ne[3]
    flat = g.reshape(x, n, count // n) if x.nb == g._contiguous(x.ne, x.es) else g.cont(x, n, count // n)
    return g.reshape(g.mul_mat(rot, flat), *x.ne)


# --- the architectures -----------------------------------------------------------------------------------------


def _transformer(b: _Builder) -> None:
    """qwen3moe, olmoe, glm4moe, gpt-oss (``src/models/{qwen3moe,olmoe,glm4-moe,openai-moe}.cpp``)."""
    m, T, arch = b.m, b.T, b.m.arch
    inpL = b.inp_embd()
    pos = g.inp(T, es=I32)
    base = b.attn_inputs(swa=False)
    swa = b.attn_inputs(swa=True) if arch == "gpt-oss" else base
    out_ids = b.out_ids()
    hd = m.head_dim_k
    for il in range(b.n_layer):
        inpSA = inpL
        cur = b.norm(inpL, il, "attn_norm.weight")
        n_head_kv = m.n_head_kv[il]
        q, k, v = b.qkv(il, cur)
        if arch == "olmoe":  # whole-projection q/k norms before the reshape
            q, k = b.norm(q, il, "attn_q_norm.weight"), b.norm(k, il, "attn_k_norm.weight")
        q, k, v = g.reshape(q, hd, m.n_head, T), g.reshape(k, hd, n_head_kv, T), g.reshape(v, m.head_dim_v,
                                                                                          n_head_kv, T)
        if arch != "olmoe" and b.has(il, "attn_q_norm.weight"):
            q, k = b.norm(q, il, "attn_q_norm.weight"), b.norm(k, il, "attn_k_norm.weight")
        q, k = g.same_shape("ROPE", q, pos), g.same_shape("ROPE", k, pos)
        on_swa = arch == "gpt-oss" and m.swa_layers[il]
        inp = swa if on_swa else base
        sinks = b.lw(il, "attn_sinks.weight") if b.has(il, "attn_sinks.weight") else None
        cur = b.attn(inp, il, q, k, v, qvk_order=arch != "gpt-oss", sinks=sinks,
                     n_kv=b.s.n_kv_swa if on_swa else b.s.n_kv)
        cur = g.mul_mat(b.lw(il, "attn_output.weight"), cur)
        if b.has(il, "attn_output.bias"):
            cur = g.same_shape("ADD", cur, b.lw(il, "attn_output.bias"))
        if il == b.n_layer - 1 and arch in GATHER_IN_LAST_LAYER:
            cur, inpSA = g.get_rows(cur, out_ids), g.get_rows(inpSA, out_ids)
        ffn_inp = g.same_shape("ADD", cur, inpSA)
        post = "ffn_norm.weight" if arch in ("qwen3moe", "olmoe") else "post_attention_norm.weight"
        cur = b.norm(ffn_inp, il, post)
        if b.has(il, "ffn_gate.weight"):  # a dense lead layer (GLM-4.5)
            cur = b.ffn(cur, il)
        else:
            gating = {"glm4moe": "sigmoid", "gpt-oss": "softmax_weight"}.get(arch, "softmax")
            routed = b.moe(cur, il, gating, norm_w=arch in ("qwen3moe", "glm4moe"))
            if b.has(il, "ffn_up_shexp.weight"):
                routed = g.same_shape("ADD", routed, b.ffn(cur, il, "_shexp"))
            cur = routed
        inpL = g.same_shape("ADD", cur, ffn_inp)
    _head(b, inpL, out_ids, gather_first=arch == "gpt-oss", gathered=arch in GATHER_IN_LAST_LAYER)


def _head(b: _Builder, inpL: Tensor, out_ids: Tensor, *, gather_first: bool, gathered: bool) -> None:
    """The final norm and the LM head; ``t_h_nextn``, ``t_embd`` and the logits are graph outputs."""
    outputs = []
    if gather_first:  # gpt-oss: the last layer's output is t_h_nextn, then rows are gathered, then normed
        outputs.append(inpL)
        cur = b.norm(g.get_rows(inpL, out_ids), None, "output_norm.weight")
    else:
        cur = b.norm(inpL, None, "output_norm.weight")
        if not gathered:  # the hybrids: the normed state is t_h_nextn, its gathered rows t_embd
            outputs.append(cur)
            cur = g.get_rows(cur, out_ids)
    outputs.append(cur)
    head = "output.weight" if "output.weight" in b.names else "token_embd.weight"
    logits = g.mul_mat(b.w(head), cur)
    outputs.append(logits)
    g.mark_outputs(outputs)
    b.gf.expand(logits)


def _hybrid(b: _Builder) -> None:
    """qwen35moe, qwen35 and qwen3next: gated full attention every ``full_attention_interval``-th layer, gated
    delta-net layers between (``src/models/qwen35moe.cpp``, ``qwen35.cpp``, ``qwen3next.cpp``)."""
    m, T = b.m, b.T
    inpL = b.inp_embd()
    attn_inp = b.attn_inputs(swa=False)
    copy_ids = g.inp(1, es=I32)  # build_rs_inp: one recurrent state per sequence, no extra ones
    s_copy = (g.view(copy_ids, (1,)), g.view(copy_ids, (0,)))
    pos = g.inp(T * (4 if m.arch in ("qwen35moe", "qwen35") else 1), es=I32)  # M-RoPE: 4 positions per token
    out_ids = b.out_ids()
    for il in range(b.n_layer):
        inpSA = inpL
        cur = b.norm(inpL, il, "attn_norm.weight")
        b.gf.expand(cur)
        recurrent = m.recurrent_layers[il]
        cur = _delta_net(b, il, cur, s_copy) if recurrent else _gated_attn(b, il, cur, attn_inp, pos)
        cur = g.same_shape("ADD", cur, inpSA)
        residual = cur
        post = b.norm(cur, il, "post_attention_norm.weight")
        if b.has(il, "ffn_gate_inp.weight"):
            ffn = b.shared_gated(post, il, b.moe(post, il, "softmax", norm_w=True))
        else:
            ffn = b.ffn(post, il)
        inpL = g.same_shape("ADD", ffn, residual)
    _head(b, inpL, out_ids, gather_first=False, gathered=False)


def _gated_attn(b: _Builder, il: int, cur: Tensor, inp: dict[str, Tensor], pos: Tensor) -> Tensor:
    m, T, hd = b.m, b.T, b.m.head_dim_k
    n_head, n_head_kv = m.n_head, m.n_head_kv[il]
    q_full, k, v = b.qkv(il, cur)
    es = q_full.es
    if m.arch == "qwen3next":
        q_full = g.reshape(q_full, 2 * hd, n_head, T, 1)
        q = g.view(q_full, (hd, n_head, T, 1), q_full.nb[1:])
        gate = g.view(q_full, (hd, n_head, T, 1), q_full.nb[1:])
        k, v = g.reshape(k, hd, n_head_kv, T), g.reshape(v, hd, n_head_kv, T)
        q, k = b.norm(q, il, "attn_q_norm.weight"), b.norm(k, il, "attn_k_norm.weight")
    else:
        q = g.view(q_full, (hd, n_head, T), (es * hd * 2, es * hd * 2 * n_head))
        q = b.norm(q, il, "attn_q_norm.weight")
        k = b.norm(g.reshape(k, hd, n_head_kv, T), il, "attn_k_norm.weight")
        gate = g.view(q_full, (hd, n_head, T), (es * hd * 2, es * hd * 2 * n_head))
        gate = g.cont(gate, hd * n_head, T)
        v = g.reshape(v, hd, n_head_kv, T)
    q, k = g.same_shape("ROPE", q, pos), g.same_shape("ROPE", k, pos)
    cur = b.attn(inp, il, q, k, v, qvk_order=True)
    if m.arch == "qwen3next":
        gate = g.cont(gate, hd * n_head, T)
    cur = g.same_shape("MUL", cur, g.same_shape("UNARY", gate))
    return g.mul_mat(b.lw(il, "attn_output.weight"), cur)


def _delta_net(b: _Builder, il: int, cur: Tensor, s_copy: tuple[Tensor, Tensor]) -> Tensor:
    """``build_layer_attn_linear`` with the fused gated delta net (the CPU backend runs it, so
    ``resolve_fused_ops`` keeps it on) and ``build_conv_state`` / ``build_rs`` for one sequence."""
    m, T = b.m, b.T
    hk, nk, nv = m.ssm_d_state, m.ssm_n_group, m.ssm_dt_rank
    hv = m.ssm_d_inner // max(nv, 1)
    channels = m.ssm_d_inner + 2 * nk * hk
    if m.arch == "qwen3next":
        qkv, z = _qkvz_fused(b, il, cur)
        ba = g.mul_mat(b.lw(il, "ssm_ba.weight"), cur)
        ba = g.reshape(ba, 2 * nv // nk, nk, T, 1)
        beta = g.same_shape("UNARY", g.cont(g.view(ba, (nv // nk, nk, T, 1), ba.nb[1:])))
        alpha = g.cont(g.view(ba, (nv // nk, nk, T, 1), ba.nb[1:]), nv, T, 1)
        gate = g.same_shape("MUL", g.same_shape("UNARY", g.same_shape("ADD", alpha, b.lw(il, "ssm_dt.bias"))),
                            b.lw(il, "ssm_a"))
        beta, gate = g.reshape(beta, 1, nv, T, 1), g.reshape(gate, 1, nv, T, 1)
    else:
        qkv = g.reshape(g.mul_mat(b.lw(il, "attn_qkv.weight"), cur), channels, T, 1)
        z = g.mul_mat(b.lw(il, "attn_gate.weight"), cur)
        beta = g.same_shape("UNARY", g.reshape(g.mul_mat(b.lw(il, "ssm_beta.weight"), cur), 1, nv, T, 1))
        alpha = g.reshape(g.mul_mat(b.lw(il, "ssm_alpha.weight"), cur), nv, T, 1)
        gate = g.same_shape("MUL", g.same_shape("UNARY", g.same_shape("ADD", alpha, b.lw(il, "ssm_dt.bias"))),
                            b.lw(il, "ssm_a"))
        gate = g.reshape(gate, 1, nv, T, 1)
    d_conv = m.ssm_d_conv
    conv_all = g.cache((d_conv - 1) * channels, 1, es=F32)
    ssm_all = g.cache(hv * hv * nv, 1, es=F32)
    conv_states = g.reshape(_rs(b, conv_all, s_copy), d_conv - 1, channels, 1)
    conv_input = g.concat(conv_states, g.transpose(qkv), 0)
    last = g.view(conv_input, (d_conv - 1, channels, 1), conv_input.nb[1:3])
    dst = g.view(conv_all, ((d_conv - 1) * channels, 1))
    b.gf.expand(g.into("CPY", dst, (last, dst)))
    state = g.reshape(_rs(b, ssm_all, s_copy), hv, hv, nv, 1)
    conv = g.same_shape("UNARY", g.new("SSM_CONV", (channels, T, 1), (conv_input, b.lw(il, "ssm_conv1d.weight"))))
    row = conv.nb[1]
    q = g.view(conv, (hk, nk, T, 1), (hk * F32, row, row * T))
    k = g.view(conv, (hk, nk, T, 1), (hk * F32, row, row * T))
    v = g.view(conv, (hv, nv, T, 1), (hv * F32, row, row * T))
    q = g.same_shape("SCALE", g.same_shape("RMS_NORM", q))
    k = g.same_shape("SCALE", g.same_shape("RMS_NORM", k))
    if m.arch == "qwen3next" and nk != nv:  # qwen3next repeats the key heads even with the fused op
        q = g.reshape(g.repeat(g.reshape(q, hk, 1, nk, T), hk, nv // nk, nk, T), hk, nv, T, 1)
        k = g.reshape(g.repeat(g.reshape(k, hk, 1, nk, T), hk, nv // nk, nk, T), hk, nv, T, 1)
    result = g.new("GATED_DELTA_NET", (hv * nv, T + hv, 1, 1), (q, k, v, gate, beta, state))
    output = g.view(result, (hv, nv, T, 1))
    new_state = g.view(result, (hv, hv, nv, 1))
    dst = g.view(ssm_all, (hv * hv * nv, 1))
    b.gf.expand(g.into("CPY", dst, (new_state, dst)))
    normed = b.norm(output, il, "ssm_norm.weight")
    gated = g.same_shape("MUL", normed, g.same_shape("UNARY", g.reshape(z, hv, nv, T, 1)))
    out = g.mul_mat(b.lw(il, "ssm_out.weight"), g.reshape(gated, hv * nv, T, 1))
    return g.reshape(out, m.n_embd, T)


def _qkvz_fused(b: _Builder, il: int, cur: Tensor) -> tuple[Tensor, Tensor]:
    """qwen3next's ``build_qkvz`` legacy path: one ``ssm_in`` projection split per key head and re-joined."""
    m, T = b.m, b.T
    hk, nk, nv = m.ssm_d_state, m.ssm_n_group, m.ssm_dt_rank
    hv = m.ssm_d_inner // max(nv, 1)
    per = 2 * hk + 2 * hv * (nv // nk)
    mixed = g.reshape(g.mul_mat(b.lw(il, "ssm_in.weight"), cur), per, nk, T, 1)
    nb = mixed.nb[1:]
    query = g.view(mixed, (hk, nk, T, 1), nb)
    key = g.view(mixed, (hk, nk, T, 1), nb)
    value = g.view(mixed, (hv * nv // nk, nk, T, 1), nb)
    z = g.cont(g.view(mixed, (hv * nv // nk, nk, T, 1), nb))
    qf, kf, vf = g.cont(query, hk * nk, T, 1), g.cont(key, hk * nk, T, 1), g.cont(value, hv * nv, T, 1)
    return g.concat(g.concat(qf, kf, 0), vf, 0), z


def _rs(b: _Builder, states_all: Tensor, s_copy: tuple[Tensor, Tensor]) -> Tensor:
    """``build_rs``: clear, gather this sequence's state, copy the (zero) extra states back."""
    states = g.reshape(states_all, states_all.ne[0], states_all.ne[1])
    zero = g.view(states, (states.ne[0],))
    b.gf.expand(g.into("SCALE", zero, (zero,)))
    main, extra_ids = s_copy
    rows = g.get_rows(states, main)
    b.gf.expand(rows)
    extra = g.get_rows(states, extra_ids)
    dst = g.view(states_all, (states.ne[0], 0))
    b.gf.expand(g.into("CPY", dst, (extra, dst)))
    return rows


def reserve_graph(model: ModelInfo, shape: ReserveShape) -> Graph:
    b = _Builder(model, shape)
    if model.arch in HYBRID_ARCHS:
        _hybrid(b)
    else:
        _transformer(b)
    if shape.split:  # ggml_backend_sched_backend_id_from_cur: graph inputs go to the last backend, the CPU
        for leaf in b.gf.leafs:
            leaf.host = leaf.host or leaf.is_input
    return b.gf


def compute_buffer_bytes(model: ModelInfo, shape: ReserveShape) -> tuple[int, int]:
    """(the compute buffer llama.cpp reserves for ``model`` at ``shape`` on the device, or on the CPU when there is
    no GPU; the host's beside a GPU, else 0): the reserve graph placed by ggml's allocator, as the engine does."""
    return g.reserve(reserve_graph(model, shape))


__all__ = ["F16", "F32", "GRAPH_ARCHS", "ReserveShape", "compute_buffer_bytes", "reserve_graph"]
