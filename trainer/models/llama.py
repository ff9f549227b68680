"""A Llama-style decoder-only transformer (its block: `trainer.models.block`).

Sources: Touvron et al. 2023, "LLaMA" (pre-norm RMSNorm, SwiGLU, RoPE, no biases) and "Llama 2"
(grouped-query attention); Llama Team 2024, "The Llama 3 Herd of Models" (GQA everywhere,
rope_theta 500000, attention kept within each document of a packed sequence); Su et al. 2021,
"RoFormer" (RoPE); Ainslie et al. 2023, "GQA"; Shazeer 2020, "GLU Variants Improve Transformer"
(SwiGLU); Zhang & Sennrich 2019, "Root Mean Square Layer Normalization". The families' variants:
Team OLMo 2024, "2 OLMo 2 Furious" (post-norm blocks, QK-norm over each whole projection); Hugging
Face 2025, SmolLM3 (every fourth layer without RoPE, "NoPE": Kazemnejad et al. 2023, "The Impact of
Positional Encoding on Length Generalization in Transformers"); Gemma Team 2025, "Gemma 3 Technical
Report" (sandwich norms with 1 + w scales, embeddings times sqrt(D), GeGLU, local sliding-window
layers with their own RoPE base between global ones).

Shape suffixes on variable names: B batch, T sequence length, D model dim,
H query heads, K key/value heads, E head dim, F ffn dim, V vocabulary.

RoPE uses the "half-split" layout (the first half of each head's features is
rotated against the second half, as in GPT-NeoX and Hugging Face Llama
checkpoints), not the interleaved-pairs layout of Meta's reference code. A
checkpoint in Meta's original layout needs its wq/wk rows permuted to load.

Module names (the FQNs other code relies on):
``tok_embeddings``, ``layers.<i>.attention_norm``, ``layers.<i>.attention.{wq,wk,wv,wo}``,
``layers.<i>.ffn_norm``, ``layers.<i>.feed_forward.{w1,w2,w3}``, ``norm``, ``output``; post-norm
blocks have ``layers.<i>.post_attention_norm`` and ``layers.<i>.post_ffn_norm`` instead of the two
pre-norms; QK-norm adds ``layers.<i>.attention.{q_norm,k_norm}``.
"""

import math
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from typing_extensions import override

from strategies.core.ranges import NON_NEGATIVE, POSITIVE, Range
from trainer.models.attention import DOCUMENT_CAUSAL, QK_NORM_SCOPES, sliding_window_mask
from trainer.models.block import ACTIVATIONS, NORM_PLACEMENTS, TransformerBlock, llama_ffn_dim
from trainer.models.init import seeded_normal_
from trainer.models.kv_cache import KVCache
from trainer.models.llama_tp import llama_tp_plan
from trainer.models.norm import RMSNorm
from trainer.models.rope import rope_scaling_problems, rope_tables

# Every rank allocates the whole RoPE tables (4 x max_seq_len x head_dim bytes). 2**24 tokens is
# above the longest context of open models (10M, Llama 4 Scout); a typo (1e10) is refused by
# validate instead of failing in the allocator.
MAX_SEQ_LEN = Range(min=1, max=2**24)


class Llama(nn.Module):
    """Llama-style decoder-only transformer.

    Args:
        vocab_size: number of token ids (embedding rows and logits).
        dim: model width D.
        n_layers: number of transformer blocks.
        n_heads: query heads H; ``dim`` must be divisible by it unless ``head_dim``
            is given; the head dim must be even (RoPE rotates feature pairs).
        n_kv_heads: key/value heads K (GQA); None means ``n_heads`` (plain
            multi-head attention). ``n_heads`` must be divisible by it.
        ffn_dim: SwiGLU hidden size; None means the Llama rule
            ``int(8 * dim / 3)`` rounded up to a multiple of 64.
        max_seq_len: length of the precomputed RoPE table; positions must be
            below it.
        rope_theta: RoPE base (10000 in Llama 1/2, 500000 in Llama 3).
        norm_eps: RMSNorm epsilon.
        tie_embeddings: if True, ``output.weight`` is ``tok_embeddings.weight``.
        init_std: std of the normal init of embeddings and linear weights.
        head_dim: per-head width E; None means ``dim // n_heads`` (Qwen3 and some
            Mistral checkpoints set their own).
        qkv_bias: biases on the q/k/v projections (Qwen2).
        qk_norm: RMSNorm of q and k before RoPE (Qwen3, OLMo 2).
        rope_scaling: a RoPE context-extension scaling, ``{"rope_type": "linear" |
            "llama3" | "yarn", ...}`` as in Hugging Face configs (see `trainer.models.rope`).
        norm_placement: ``"pre"``: RMSNorm before attention and feed-forward (Llama);
            ``"post"``: on their outputs, before each residual add (OLMo 2; `trainer.models.block`).
        qk_norm_scope: what ``qk_norm`` normalises: ``"head"``, each head's E features (Qwen3);
            ``"projection"``, each projection's heads x E features at once (OLMo 2).
        nope_layers: blocks (0-based) whose attention applies no RoPE (SmolLM3: every fourth).
        norm_unit_offset: every RMSNorm scales by ``1 + weight`` (Gemma; the weights start at 0).
        scale_embeddings: the token embeddings are multiplied by ``sqrt(dim)`` (Gemma).
        activation: the MLP's gate activation, ``"silu"`` (SwiGLU) or ``"gelu_tanh"`` (GeGLU, Gemma).
        query_pre_attn_scalar: attention scores scaled by ``1 / sqrt(query_pre_attn_scalar)``;
            None: ``1 / sqrt(head_dim)`` (Gemma 3 sets it).
        sliding_window: blocks of ``window_layers`` attend only to the last ``sliding_window``
            tokens (themselves included); None: no window.
        window_layers: the windowed blocks; None: every block when ``sliding_window`` is set
            (Gemma 3: five of every six).
        rope_local_theta: the windowed blocks' RoPE base, without ``rope_scaling`` (Gemma 3's
            local base 10000); None: the same tables as the other blocks.
        attention_sinks: a learned sink logit per query head in every block's softmax
            (``layers.<i>.attention.sinks`` ``[H]``, GPT-OSS): FlexAttention on CUDA's packed rows,
            else the scores written out (`document_masks.sink_attention`: per group of equally long
            documents on CPU's packed rows); context parallelism does not run them.
        o_bias: a bias on the attention output projection ``wo`` (GPT-OSS).

    Raises:
        ValueError: if a size is not positive, the head counts do not divide, the RoPE
            scaling is unsupported, a choice is unknown or a NoPE layer is out of range.

    Pipeline stages may set ``tok_embeddings``, ``norm`` or ``output`` to None
    and delete entries of ``layers``; ``forward`` then takes and/or returns
    hidden states ``[B, T, D]``.
    """

    # init_weights fills a model built on the meta device and parallelized, shard by shard, with the
    # one-process values (per-name seeded draws): trainer.build builds sharded layouts on meta.
    META_INIT = True

    def __init__(
        self,
        *,
        vocab_size: int,
        dim: int,
        n_layers: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        ffn_dim: int | None = None,
        max_seq_len: Annotated[int, MAX_SEQ_LEN] = 2048,
        rope_theta: Annotated[float, POSITIVE] = 10000.0,
        norm_eps: Annotated[float, POSITIVE] = 1e-5,
        tie_embeddings: bool = False,
        init_std: Annotated[float, NON_NEGATIVE] = 0.02,
        head_dim: int | None = None,
        qkv_bias: bool = False,
        qk_norm: bool = False,
        rope_scaling: dict[str, Any] | None = None,
        norm_placement: Literal["pre", "post", "sandwich"] = "pre",
        qk_norm_scope: Literal["head", "projection"] = "head",
        nope_layers: Sequence[int] | None = None,
        norm_unit_offset: bool = False,
        scale_embeddings: bool = False,
        activation: Literal["silu", "gelu_tanh"] = "silu",
        query_pre_attn_scalar: Annotated[float, POSITIVE] | None = None,
        sliding_window: int | None = None,
        window_layers: Sequence[int] | None = None,
        rope_local_theta: Annotated[float, POSITIVE] | None = None,
        attention_sinks: bool = False,
        o_bias: bool = False,
    ) -> None:
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        rope_scaling = dict(rope_scaling) if rope_scaling else None
        ffn_dim = llama_ffn_dim(dim) if ffn_dim is None else ffn_dim
        for name, value in [
            ("vocab_size", vocab_size),
            ("dim", dim),
            ("n_layers", n_layers),
            ("n_heads", n_heads),
            ("n_kv_heads", n_kv_heads),
            ("ffn_dim", ffn_dim),
            ("max_seq_len", max_seq_len),
            ("head_dim", 2 if head_dim is None else head_dim),
        ]:
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name, value in [("rope_theta", rope_theta), ("norm_eps", norm_eps), ("init_std", init_std)]:
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
        if head_dim is None and dim % n_heads != 0:
            raise ValueError(
                f"dim ({dim}) must be divisible by n_heads ({n_heads}); change dim or n_heads, or set head_dim"
            )
        if (head_dim or dim // n_heads) % 2 != 0:
            raise ValueError(
                f"head dim ({head_dim or dim // n_heads}) must be even for RoPE; change dim, n_heads or head_dim"
            )
        if rope_scaling_problems(rope_scaling):
            raise ValueError("; ".join(rope_scaling_problems(rope_scaling)))
        if n_heads % n_kv_heads != 0:
            raise ValueError(
                f"n_heads ({n_heads}) must be divisible by n_kv_heads ({n_kv_heads}); "
                "pick n_kv_heads among the divisors of n_heads"
            )
        for name, value, choices in [
            ("norm_placement", norm_placement, NORM_PLACEMENTS),
            ("qk_norm_scope", qk_norm_scope, QK_NORM_SCOPES),
            ("activation", activation, tuple(ACTIVATIONS)),
        ]:
            if value not in choices:
                raise ValueError(f"{name}={value!r} is not one of {', '.join(choices)}")
        if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window <= 0):
            raise ValueError(f"sliding_window must be a positive int or null, got {sliding_window!r}")
        if window_layers is not None and sliding_window is None:
            raise ValueError("window_layers needs a sliding_window; set model.sliding_window or drop window_layers")
        window_layers = range(n_layers) if sliding_window is not None and window_layers is None else window_layers
        for name, layers in [("nope_layers", nope_layers), ("window_layers", window_layers)]:
            if any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < n_layers for i in layers or ()):
                raise ValueError(f"{name}={list(layers)} must hold block indices in 0..{n_layers - 1}")
        nope_layers, window_layers = tuple(sorted(set(nope_layers or ()))), tuple(sorted(set(window_layers or ())))

        self.vocab_size = vocab_size
        self.dim = dim
        self.n_layers = n_layers
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = dim // n_heads if head_dim is None else head_dim
        self.ffn_dim = ffn_dim
        self.max_seq_len = max_seq_len
        self.rope_theta = rope_theta
        self.norm_eps = norm_eps
        self.tie_embeddings = tie_embeddings
        self.init_std = init_std
        self.qkv_bias, self.qk_norm, self.rope_scaling = qkv_bias, qk_norm, rope_scaling
        self.norm_placement, self.qk_norm_scope, self.nope_layers = norm_placement, qk_norm_scope, nope_layers
        self.norm_unit_offset, self.scale_embeddings, self.activation = norm_unit_offset, scale_embeddings, activation
        self.query_pre_attn_scalar, self.sliding_window = query_pre_attn_scalar, sliding_window
        self.window_layers, self.rope_local_theta = window_layers, rope_local_theta
        self.attention_sinks, self.o_bias = attention_sinks, o_bias
        # One draw from torch's RNG (on CPU, also when built under a meta default device): the
        # seed of every weight (init_weights), so the weights are deterministic given the RNG state.
        self.init_seed = int(torch.randint(0, 2**62, (1,), device="cpu"))

        self.tok_embeddings: nn.Embedding | None = nn.Embedding(vocab_size, dim)
        attention = {
            "head_dim": self.head_dim,
            "qkv_bias": qkv_bias,
            "qk_norm": qk_norm,
            "qk_norm_scope": qk_norm_scope,
            "query_pre_attn_scalar": query_pre_attn_scalar,
            **({"sinks": True} if attention_sinks else {}),
            **({"o_bias": True} if o_bias else {}),
        }
        self.layers = nn.ModuleDict(
            {
                str(i): TransformerBlock(
                    dim,
                    n_heads,
                    n_kv_heads,
                    ffn_dim,
                    norm_eps,
                    self.make_feed_forward(i),
                    self.make_attention(i),
                    norm_placement=norm_placement,
                    norm_unit_offset=norm_unit_offset,
                    activation=activation,
                    rope=i not in nope_layers,
                    **attention,
                )
                for i in range(n_layers)
            }
        )
        self.attention_core: Any = DOCUMENT_CAUSAL  # see set_attention_core
        self.norm: RMSNorm | None = RMSNorm(dim, norm_eps, unit_offset=norm_unit_offset)
        self.output: nn.Linear | None = nn.Linear(dim, vocab_size, bias=False)
        if tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

        # Not saved in checkpoints (persistent=False): rebuilt by init_weights
        # and whenever a cast would otherwise leave them in low precision.
        cos, sin = self._rope_tables(None)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if rope_local_theta is not None:  # the windowed blocks' own tables
            cos, sin = self._local_rope_tables(None)
            self.register_buffer("rope_local_cos", cos, persistent=False)
            self.register_buffer("rope_local_sin", sin, persistent=False)

        self.init_weights()

    def make_feed_forward(self, layer: int) -> nn.Module | None:
        """The feed-forward of block ``layer``: None for the dense SwiGLU (a mixture of experts
        overrides this, `trainer.models.moe_transformer`)."""
        return None

    def make_attention(self, layer: int) -> nn.Module | None:
        """The attention of block ``layer``: None for grouped-query `Attention` (subclasses may
        give latent attention, `trainer.models.mla`)."""
        return None

    @property
    def rope_dim(self) -> int:
        """Features per head that RoPE rotates (the RoPE tables' width is half of it)."""
        return self.head_dim

    def _rope_tables(self, device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_tables(self.rope_dim, self.max_seq_len, self.rope_theta, device=device, scaling=self.rope_scaling)

    def _local_rope_tables(self, device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_tables(self.rope_dim, self.max_seq_len, self.rope_local_theta, device=device)

    def _rebuild_rope(self) -> None:
        self.rope_cos, self.rope_sin = self._rope_tables(self.rope_cos.device)
        if self.rope_local_theta is not None:
            self.rope_local_cos, self.rope_local_sin = self._local_rope_tables(self.rope_cos.device)

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialize all parameters and the RoPE tables in place; does nothing on the meta device.

        Embedding and linear weights ~ N(0, init_std); the residual output projections (``wo``,
        ``w2``) use ``init_std / sqrt(2 * n_layers)`` as in GPT-2 (Radford et al. 2019), so the
        residual stream's variance does not grow with depth. RMSNorm weights are set to 1, biases
        to 0. Each weight is drawn from generators seeded by ``init_seed`` and its name
        (`trainer.models.init`), so a parallelized model (DTensor shards, pipeline stages) filled
        after ``to_empty`` holds exactly the one-process values. Skips modules that are None.
        """
        if self.rope_cos.is_meta:
            return  # built on the meta device: the strategy materialises it and calls this again
        self._rebuild_rope()
        residual_std = self.init_std / math.sqrt(2 * self.n_layers)
        seen: set[int] = set()  # a tied output weight is the embedding's: initialised once
        for module_name, module in self.named_modules():
            for param_name, param in module.named_parameters(recurse=False):
                if id(param) in seen:
                    continue
                seen.add(id(param))
                local = param.to_local() if isinstance(param, DTensor) else param
                if isinstance(module, RMSNorm):
                    local.fill_(0.0 if module.unit_offset else 1.0)
                elif param_name in ("bias", "sinks") or param_name.endswith("_bias"):
                    local.zero_()  # a sink at 0: one more unit in each softmax's denominator
                else:
                    # residual output projections: a linear ``wo``/``w2``, or stacked experts' ``w2``
                    residual = module_name.endswith(("wo", "w2")) or param_name == "w2"
                    std = residual_std if residual else self.init_std
                    seeded_normal_(param, f"{module_name}.{param_name}", std=std, seed=self.init_seed)

    @override
    def _apply(self, fn, recurse=True):
        # model.to(bfloat16) / .half() would cast the RoPE tables too, and a
        # bf16 cos/sin table is badly off at large positions. Rebuild them in
        # float32 on the new device instead.
        super()._apply(fn, recurse)
        if self.rope_cos.dtype != torch.float32 or (
            self.rope_local_theta is not None and self.rope_local_cos.dtype != torch.float32
        ):
            self._rebuild_rope()
        return self

    def forward(
        self,
        input_ids_bt: torch.Tensor,
        *,
        position_ids_bt: torch.Tensor | None = None,
        document_ids_bt: torch.Tensor | None = None,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        """Run the model.

        Args:
            input_ids_bt: token ids ``[B, T]`` (int); or, when
                ``tok_embeddings`` is None (a later pipeline stage), hidden
                states ``[B, T, D]``.
            position_ids_bt: RoPE positions ``[B, T]`` (int), each in
                ``[0, max_seq_len)``; None means ``arange(T)`` for every row.
                For packed sequences, restart at 0 in each document.
            document_ids_bt: document index of each token ``[B, T]`` (int).
                Attention is then block-diagonal causal: token t attends s iff
                ``s <= t`` and ``doc[s] == doc[t]``. None means plain causal
                attention (the fast ``is_causal=True`` path), as is a row that
                holds one document (see `attention.DocumentCausalAttention`).
            return_hidden: return the final-norm hidden states ``[B, T, D]``
                instead of logits (a chunked loss applies ``output`` itself).

        Returns:
            Logits ``[B, T, V]`` in the activation dtype; or hidden states
            ``[B, T, D]`` when ``output`` is None (an earlier pipeline stage;
            ``norm`` is skipped too when it is None).

        Raises:
            ValueError: if T exceeds ``max_seq_len`` or the position/document
                ids do not have shape ``[B, T]``.
        """
        return self._run(
            input_ids_bt, position_ids_bt=position_ids_bt, document_ids_bt=document_ids_bt, return_hidden=return_hidden
        )

    def _run(
        self,
        input_ids_bt: torch.Tensor,
        *,
        position_ids_bt: torch.Tensor | None,
        document_ids_bt: torch.Tensor | None,
        return_hidden: bool,
        token_mask_bt: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`forward`; ``token_mask_bt`` goes to the blocks whose feed-forward routes tokens (a
        mixture of experts: `trainer.models.moe_transformer.MoETransformer.forward`)."""
        # [B, T] of the full sequence: under sequence parallelism the hidden states between blocks
        # are [B, T/tp, D] per rank, while ids, RoPE tables and masks cover the whole sequence.
        B, T = input_ids_bt.shape[0], input_ids_bt.shape[1]
        if self.tok_embeddings is not None:
            input_ids_bt = self.tok_embeddings(input_ids_bt)
            if self.scale_embeddings:  # Gemma: sqrt(D), rounded to the activation dtype as transformers does
                input_ids_bt = input_ids_bt * torch.tensor(self.dim**0.5, dtype=input_ids_bt.dtype)
        elif position_ids_bt is not None:
            T = position_ids_bt.shape[1]
        h_btd = input_ids_bt
        if T > self.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len {self.max_seq_len}; raise max_seq_len")
        for name, ids in [
            ("position_ids_bt", position_ids_bt),
            ("document_ids_bt", document_ids_bt),
            ("token_mask_bt", token_mask_bt),
        ]:
            if ids is not None and tuple(ids.shape) != (B, T):
                raise ValueError(f"{name} must have shape [B, T] = {[B, T]}, got {list(ids.shape)}")

        rope = _rope_rows(self.rope_cos, self.rope_sin, position_ids_bt, T)
        # Built once for all layers: the document layout the attention core needs (see its mask()).
        mask = self.attention_core.mask(document_ids_bt, T, h_btd.device)
        one_process = self.attention_core is DOCUMENT_CAUSAL or isinstance(self.attention_core, KVCache)
        if self.attention_sinks and not one_process:
            raise ValueError(
                "attention sinks run with the one-process attention core or a KV cache only, not under "
                "context parallelism; use strategy.cp=1"
            )
        local_rope, local_mask = rope, mask  # the windowed blocks' (Gemma 3's local layers)
        if self.rope_local_theta is not None:
            local_rope = _rope_rows(self.rope_local_cos, self.rope_local_sin, position_ids_bt, T)
        # The windowed blocks' mask: the one-process core's is built here; a KV cache applies the window
        # itself (it knows the cached length); context parallelism does not (validate refuses it).
        if self.window_layers and T > self.sliding_window and not isinstance(self.attention_core, KVCache):
            if self.attention_core is not DOCUMENT_CAUSAL:
                raise ValueError(
                    f"sliding_window={self.sliding_window} shorter than the sequence ({T}) runs with the one-process "
                    "attention core or a KV cache only, not under context parallelism; use strategy.cp=1"
                )
            local_mask = sliding_window_mask(document_ids_bt, T, self.sliding_window, h_btd.device)

        for name, layer in self.layers.items():
            local = int(name) in self.window_layers
            routed = {"token_mask_bt": token_mask_bt} if layer.routes_tokens else {}
            h_btd = layer(h_btd, *(local_rope if local else rope), local_mask if local else mask, **routed)
        if self.norm is not None:
            h_btd = self.norm(h_btd)
        return self.output(h_btd) if self.output is not None and not return_hidden else h_btd

    def set_attention_core(self, core: Any) -> None:
        """Swaps the attention computation of every block (context parallelism does).

        ``core.mask(document_ids_bt, T, device)`` runs once per forward; ``core(q, k, v, mask)`` in each
        block (see `trainer.models.attention.DocumentCausalAttention`).
        """
        self.attention_core = core
        for layer in self.layers.values():
            layer.attention.core = core

    def tp_plan(self, *, sequence_parallel: bool = True, loss_parallel: bool = True) -> dict:
        """Megatron tensor-parallel plan: module-name pattern -> DTensor ``ParallelStyle``
        (`trainer.models.llama_tp.llama_tp_plan`; a subclass extends it, as `MoETransformer` does)."""
        return llama_tp_plan(self, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Number of parameters present in this module (tied weights counted once).

        With ``exclude_embeddings``, the input embedding table is left out
        (when embeddings are tied this also leaves out ``output.weight``, the
        same tensor).
        """
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings and self.tok_embeddings is not None:
            n -= self.tok_embeddings.weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> float:
        """Estimated training FLOPs per token (forward + backward) of the full model.

        ``6 * N + 12 * n_layers * (n_heads * head_dim) * seq_len`` (Kaplan et al. 2020;
        PaLM, Chowdhery et al. 2022, appendix B; as used by Chinchilla). N
        counts the weights of every matmul: the attention and MLP projections
        of all ``n_layers`` blocks plus the output projection (counted even
        when tied), but not the embedding lookup or the norms. The second term
        is the attention score and value matmuls, without the causal halving, over the heads' width
        (``dim`` unless the model sets its own ``head_dim``: Qwen3, GPT-OSS). Computed from the config, so it is the same on every pipeline stage.

        Raises:
            ValueError: if ``seq_len`` is not positive.
        """
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        attn = self.dim * q_dim + 2 * self.dim * kv_dim + q_dim * self.dim
        mlp = 3 * self.dim * self.ffn_dim
        n_matmul = self.n_layers * (attn + mlp) + self.dim * self.vocab_size
        return float(6 * n_matmul + 12 * self.n_layers * q_dim * seq_len)


def _rope_rows(
    cos_tf: torch.Tensor, sin_tf: torch.Tensor, position_ids_bt: torch.Tensor | None, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The RoPE rows of the positions, ``[B or 1, T, 1, E/2]`` each (``arange(T)`` when None)."""
    if position_ids_bt is None:
        return cos_tf[:seq_len][None, :, None, :], sin_tf[:seq_len][None, :, None, :]
    return cos_tf[position_ids_bt][:, :, None, :], sin_tf[position_ids_bt][:, :, None, :]
