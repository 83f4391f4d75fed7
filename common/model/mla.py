"""DeepSeek's Multi-head Latent Attention (DeepSeek-V2, V2-Lite, V3, R1, Kimi K2, Moonlight) over the paged KV cache.

transformers computes it as ordinary attention over keys and values expanded from a latent: per token, the
latent ``c`` (``kv_lora_rank`` wide, ``kv_a_proj_with_mqa``'s first columns, normed by ``kv_a_layernorm``) and
one rotated key ``k_pe`` (``qk_rope_head_dim``) shared by every head; head ``h``'s key is
``[W_UK[h] c, k_pe]`` and its value ``W_UV[h] c`` (``kv_b_proj``'s rows for the head), its query ``[q_nope,
q_pe]`` (``q_proj``, or ``q_b_proj(q_a_layernorm(q_a_proj(x)))`` with ``q_lora_rank``), its scale
``qk_head_dim ** -0.5`` (times YaRN's ``mscale_all_dim`` mscale squared).

Here the cache holds what transformers' cache holds, the latent, and only that: per token one vector of
``qk_rope_head_dim + kv_lora_rank`` entries, ``[k_pe, c]`` (the key rotated), its first half in the K slot and
its second in the V slot. So the model's ``num_kv_heads`` is 1 and its ``head_size`` half that width (288 for
V3: 576 entries a token and layer, as DeepSeek's own and vLLM's caches hold), and the engine, the block
transfer and the prefix cache take it as any other cache; the attention kernels' ``latent`` mode joins the two
halves into the one vector that is each token's key and value. Attention runs in the absorbed form
(as DeepSeek's and vLLM's inference code do): each head's ``q_nope`` is carried into the latent space by
``W_UK[h]`` (``q_nope . W_UK[h] c = (W_UK[h]^T q_nope) . c``), so the query ``[q_pe, W_UK[h]^T q_nope]``
meets the cached ``[k_pe, c]`` in one multi-query attention (every head reading the one latent head) at
transformers' scale; the attended latent (the output's last ``kv_lora_rank`` entries) is carried out by
``W_UV[h]`` before ``o_proj``. Each score and output is the same sum of the same products as transformers',
grouped otherwise, so they agree to float rounding (about 1e-6 in float32), not to the bit.

The rotation is the kernels' ``rope`` over each head's ``q_pe`` and the token's ``k_pe``; pairs interleaved in
the checkpoint (V2's RoPE, V3's with ``rope_interleave``) are reordered as the weights load
(``common.model.weights.deinterleave_mla_rope``).
"""

from __future__ import annotations

import itertools
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from common.engine.host_tensors import long_tensors
from common.model.arch import ModelArch, rope_parameters
from common.model.llama import AttentionMetadata, RMSNorm, _sharded
from common.model.parallel import TensorParallel

# DeepSeek's norms of the low-rank q and of the latent: transformers builds them with their class's default
# epsilon, whatever ``rms_norm_eps`` says.
LATENT_NORM_EPS = 1e-6


def mla_scale(config: Any) -> float:
    """The attention's scale as transformers computes it: ``qk_head_dim ** -0.5``, times YaRN's mscale of
    ``mscale_all_dim`` squared where the RoPE is scaled and names one (``yarn_apply_mscale``)."""
    scale = float((config.qk_nope_head_dim + config.qk_rope_head_dim) ** (-0.5))
    params = rope_parameters(config)
    if params.get("rope_type", params.get("type", "default")) != "default" and params.get("mscale_all_dim"):
        from transformers.modeling_rope_utils import yarn_apply_mscale

        scale = float(yarn_apply_mscale(params, scale))
    return scale


class MLAttention(nn.Module):
    """Multi-head Latent Attention, its parameters named as transformers' ``DeepseekV3Attention`` names them."""

    def __init__(self, config: Any, arch: ModelArch, layer_idx: int, kernels: ModuleType,
                 tp: TensorParallel | None = None) -> None:
        """``tp``: the layer holds its rank's share of the heads (their rows of q's and of the latent's
        up-projections, their columns of ``o_proj``, summed over the ranks); the projections down to the
        latent, its norm and so the cached latent head are whole on every rank (as vLLM's)."""
        super().__init__()
        hidden = config.hidden_size
        self.tp = _sharded(tp)
        self.num_heads = heads = config.num_attention_heads // (1 if self.tp is None else self.tp.size)
        self.kv_lora_rank = config.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        # The cache: one vector per token, the rotated key's entries then the latent's, in halves across the K
        # and V slots (``ModelArch`` refuses an odd width).
        self.num_kv_heads = 1
        self.head_size = (self.rope_dim + self.kv_lora_rank) // 2
        self.scale = mla_scale(config)
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        q_width = heads * (self.nope_dim + self.rope_dim)
        self.q_proj: nn.Linear | None = None
        self.q_a_proj: nn.Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: nn.Linear | None = None
        if self.q_lora_rank is None:  # V2-Lite's
            self.q_proj = nn.Linear(hidden, q_width, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, self.q_lora_rank, bias=arch.qkv_bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS, kernels=kernels)
            self.q_b_proj = nn.Linear(self.q_lora_rank, q_width, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_lora_rank + self.rope_dim, bias=arch.qkv_bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS, kernels=kernels)
        # Each head's W_UK (its first qk_nope_head_dim rows) and W_UV (the v_head_dim after), as in the checkpoint.
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, hidden, bias=arch.o_bias)
        self.layer_idx = layer_idx
        self.kernels = kernels

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], meta: AttentionMetadata, kv_layer: Tensor,
                q_scale: Tensor | None = None) -> Tensor:
        """As ``llama.Attention.forward`` (``q_scale`` is Ministral 3's, None for these families)."""
        n, heads, nope, rope_dim, rank = x.shape[0], self.num_heads, self.nope_dim, self.rope_dim, self.kv_lora_rank
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(n, heads, nope + rope_dim)
        kv = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(kv[:, :rank])
        w_kv = self.kv_b_proj.weight.view(heads, nope + self.v_dim, rank)
        q_pe, k_pe = self.kernels.rope(q[..., nope:], kv[:, None, rank:], *rope)
        # The cached vector [k_pe, c], its first half into the K slot and its second into the V slot.
        key = torch.cat((k_pe.view(n, rope_dim), latent), dim=-1).view(n, 2, self.head_size)
        self.kernels.store_kv(key[:, :1], key[:, 1:], kv_layer, meta.slot_mapping)
        if meta.decode_only:
            out = self._absorbed(q[..., :nope], q_pe, w_kv, kv_layer, meta.block_tables, meta.context_lens)
        else:
            out = self._prefill(q[..., :nope], q_pe, w_kv, kv_layer, meta)
        result: Tensor = self.o_proj(out.reshape(n, heads * self.v_dim))
        return result if self.tp is None else self.tp.all_reduce(result)

    def _absorbed(self, q_nope: Tensor, q_pe: Tensor, w_kv: Tensor, kv_layer: Tensor, block_tables: Tensor,
                  context_lens: Tensor, query_start_loc: Tensor | None = None) -> Tensor:
        """Attention in the latent space, ``[rows, heads, v_head_dim]``: each head's ``q_nope`` carried in by its
        ``W_UK``, every head reading the cached latent, the attended latent carried out by its ``W_UV``. One
        query row per sequence without ``query_start_loc``, else chunks."""
        nope = self.nope_dim
        # [heads, rows, nope] @ W_UK [heads, nope, rank].
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_kv[:, :nope]).transpose(0, 1)
        query = torch.cat((q_pe, q_latent), dim=-1)  # [rows, heads, rope + rank]
        if query_start_loc is None:
            o = self.kernels.paged_decode_attention(query, kv_layer, block_tables, context_lens, self.scale,
                                                    latent=True)
        else:
            o = self.kernels.paged_prefill_attention(query, kv_layer, block_tables, query_start_loc, context_lens,
                                                     self.scale, latent=True)
        # [heads, rows, rank] @ W_UV^T [heads, rank, v].
        return torch.bmm(o[..., self.rope_dim:].transpose(0, 1), w_kv[:, nope:].transpose(1, 2)).transpose(0, 1)

    def _prefill(self, q_nope: Tensor, q_pe: Tensor, w_kv: Tensor, kv_layer: Tensor, meta: AttentionMetadata) -> Tensor:
        """A step with chunks longer than a token: each chunk in whichever form costs fewer multiply-adds
        (``expands``), the rest (decode rows among them) together in the absorbed form."""
        starts = (meta.query_start_loc if meta.host_query_start_loc is None else meta.host_query_start_loc).tolist()
        lens = (meta.context_lens if meta.host_context_lens is None else meta.host_context_lens).tolist()
        n = q_nope.shape[0]
        expanded = [s for s in range(len(lens)) if self.expands(starts[s + 1] - starts[s], lens[s], n)]
        if not expanded:
            return self._absorbed(q_nope, q_pe, w_kv, kv_layer, meta.block_tables, meta.context_lens,
                                  meta.query_start_loc)
        out = q_nope.new_empty(n, self.num_heads, self.v_dim)
        for s in expanded:
            rows = slice(starts[s], starts[s + 1])
            out[rows] = self._expanded(q_nope[rows], q_pe[rows], w_kv, kv_layer, meta.block_tables[s], lens[s])
        taken = set(expanded)
        rest = [s for s in range(len(lens)) if s not in taken and starts[s + 1] > starts[s]]
        if rest:
            rows_t, seqs, chunk_starts = long_tensors(
                [[r for s in rest for r in range(starts[s], starts[s + 1])], rest,
                 [0, *itertools.accumulate(starts[s + 1] - starts[s] for s in rest)]], q_nope.device)
            out[rows_t] = self._absorbed(q_nope[rows_t], q_pe[rows_t], w_kv, kv_layer, meta.block_tables[seqs],
                                         meta.context_lens[seqs], chunk_starts)
        return out

    def expands(self, q_len: int, context_len: int, step_tokens: int) -> bool:
        """Whether a chunk of ``q_len`` queries over ``context_len`` cached tokens runs expanded: each context
        token's latent carried out to every head's key and value, then plain attention (transformers' form; vLLM
        runs every prefill so), rather than absorbed. Where it costs fewer multiply-adds per head: expanding
        costs ``context * rank * (nope + v)`` for the keys and values and ``q_len * context * (nope + rope + v)``
        for attention; absorbing costs ``q_len * rank * (nope + v)`` carrying queries in and outputs out, and
        ``q_len * context * (rope + 2 * rank)`` for attention over the latent. And only over a context no longer
        than the step's tokens: the largest expansion is then the profiling run's (a prompt of the step's
        tokens), which sized the KV cache around it; a long cached prefix under a short chunk stays absorbed."""
        if q_len <= 1 or context_len > step_tokens or not EXPANDED_PREFILL:
            return False
        rank, nope, rope, v = self.kv_lora_rank, self.nope_dim, self.rope_dim, self.v_dim
        expand = context_len * rank * (nope + v) + q_len * context_len * (nope + rope + v)
        absorb = q_len * rank * (nope + v) + q_len * context_len * (rope + 2 * rank)
        return expand < absorb

    def _expanded(self, q_nope: Tensor, q_pe: Tensor, w_kv: Tensor, kv_layer: Tensor, table: Tensor,
                  context_len: int) -> Tensor:
        """One chunk (its queries the last of ``context_len`` positions) attending as transformers computes it:
        the cached latent of the context carried out to every head's ``[k_nope, k_pe]`` and ``v``; ``[q_len,
        heads, v]``."""
        heads, nope, rope_dim = self.num_heads, self.nope_dim, self.rope_dim
        block_size = kv_layer.shape[2]
        # [2, blocks, block_size, 1, half], an 8-bit cache's widened.
        blocks = kv_layer.index_select(1, table[: -(-context_len // block_size)].long()).to(q_nope.dtype)
        cached = torch.cat((blocks[0], blocks[1]), dim=-1).reshape(-1, 2 * self.head_size)[:context_len]
        # [heads, context, rank] @ [heads, rank, nope + v]: every head's k_nope and v.
        kv_heads = torch.matmul(cached[None, :, rope_dim:], w_kv.transpose(1, 2))
        k = torch.cat((kv_heads[..., :nope], cached[None, :, :rope_dim].expand(heads, -1, -1)), dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1).transpose(0, 1)  # [heads, q_len, nope + rope]
        q_len = q.shape[1]
        visible = torch.ones(q_len, context_len, dtype=torch.bool, device=q.device).tril(context_len - q_len)
        o = F.scaled_dot_product_attention(q, k, kv_heads[..., nope:], attn_mask=visible, scale=self.scale)
        return o.transpose(0, 1)


# Prefill chunks may run expanded (``MLAttention.expands``); off, every chunk runs absorbed (a benchmark's baseline).
EXPANDED_PREFILL = True

