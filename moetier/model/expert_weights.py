"""One SwiGLU FFN's weights as the engine and every tier see them: gate and up stacked, down beside them.

Both checkpoint readers (HF safetensors in moetier.model.checkpoint, GGUF in
moetier.model.gguf_file) hand out experts, dense MLPs and shared experts as
this type, so neither reader imports the other. `NamedWeights` is what both
readers answer the same way once a tensor is found by its HF name: the router,
its correction bias, dense and shared MLPs (with Qwen3-Next's shared-expert
gate), and norm weights as the normalisation multiplies by them (a HF
Qwen3-Next file stores them as offsets from 1; its GGUF stores 1 + offset).
`DeltaNetTensors` is a Qwen3-Next linear-attention layer in the one layout
the engine computes with, which each reader builds from its file's layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetier.model.formats import F32, format_of
from moetier.model.host_memory import host_cat, host_copy


@dataclass(frozen=True)
class ExpertWeights:
    """One routed (or shared, or dense) SwiGLU FFN: down(silu(gate x) * up x).

    gate and up are stacked (rows) so one matmul computes both. Each matrix is
    held in its stored format (moetier.model.formats): a float tensor of its
    dtype [rows, cols] for F32/F16/BF16, else uint8 [rows, row_bytes] of GGML
    blocks; `gate_up_type` and `down_type` are the GGML type ids. `mapped` is
    True when the tensors alias the checkpoint's file mapping (whose pages the
    OS may drop and re-read at any time); `resident()` returns a copy in
    process memory, in the same stored bytes.
    """

    gate_up: torch.Tensor  # [2I, D] gate rows, then up rows (uint8 [2I, row bytes] for a block format)
    down: torch.Tensor  # [D, I] (uint8 [D, row bytes] for a block format)
    mapped: bool = False
    gate_up_type: int = F32
    down_type: int = F32
    # the activations each matrix is multiplied with: True keeps them float32 for F16 / BF16 weights (what a HF
    # checkpoint means, computed as transformers computes it); False converts them as llama.cpp's dot product for
    # the weight format does (GGUF files: F16 / BF16 activations for F16 / BF16 weights). Block formats always dot
    # with the activations llama.cpp quantizes for them (Q8_K, Q8_0, Q8_1: moetier.backends.activations).
    float_acts: bool = True
    # GLM-5.3's clamped SwiGLU: gate clamped to <= limit and up to [-limit, limit] before silu(gate) * up (None: none)
    swiglu_limit: float | None = None

    @property
    def inter(self) -> int:
        return self.gate_up.shape[0] // 2  # I

    @property
    def hidden(self) -> int:
        return self.down.shape[0]  # D

    @property
    def float32(self) -> bool:
        """Whether both matrices are held as float32 (the format every kernel reads directly)."""
        return self.gate_up_type == F32 and self.down_type == F32

    @property
    def formats(self) -> str:
        """What the matrices are held in, e.g. "Q4_K" or "Q4_K/Q6_K" (gate_up/down)."""
        a, b = format_of(self.gate_up_type).name, format_of(self.down_type).name
        return a if a == b else f"{a}/{b}"

    @property
    def gate(self) -> torch.Tensor:
        return self.gate_up[: self.inter]  # [I, D]

    @property
    def up(self) -> torch.Tensor:
        return self.gate_up[self.inter :]  # [I, D]

    @property
    def nbytes(self) -> int:
        """Bytes of the stored matrices."""
        return self.gate_up.numel() * self.gate_up.element_size() + self.down.numel() * self.down.element_size()

    def resident(self) -> "ExpertWeights":
        if not self.mapped:
            return self
        return self.with_tensors(host_copy(self.gate_up), host_copy(self.down))

    def to(self, device: torch.device | str) -> "ExpertWeights":
        return self.with_tensors(self.gate_up.to(device), self.down.to(device), self.mapped and torch.device(device).type == "cpu")

    def with_tensors(self, gate_up: torch.Tensor, down: torch.Tensor, mapped: bool = False) -> "ExpertWeights":
        """The same formats over other tensors (a copy, a device upload, a slot of an arena)."""
        return ExpertWeights(gate_up, down, mapped, self.gate_up_type, self.down_type, self.float_acts, self.swiglu_limit)


DENSE_NAMES = ("gate_proj", "up_proj", "down_proj")

Stored = tuple[torch.Tensor, int]  # a matrix as stored, with its GGML type id (Checkpoint.stored)


@dataclass(frozen=True)
class DeltaNetTensors:
    """A Gated DeltaNet layer's tensors in the engine's layout (moetier.engine.deltanet), whichever file they came
    from: the conv channels' rows are every key head's q, then every key head's k, then every value head's v (the
    GGUF converter's order; a HF file interleaves q, k, v, z per key head and its reader regroups the rows)."""

    qkv: Stored  # [C, D]
    z: Stored  # [Hv*dv, D] the output gate's rows
    ba: Stored  # [2*Hv, D]: per key head, r beta rows then r alpha rows (both files' order)
    conv: torch.Tensor  # [C, K] float32
    dt_bias: torch.Tensor  # [Hv] float32
    decay_rate: torch.Tensor  # [Hv] float32: -exp(A_log)
    norm: torch.Tensor  # [dv] float32
    out: Stored  # [D, Hv*dv]


class NamedWeights:
    """The engine's structured reads over HF tensor names, for a reader with `tensor`, `load`, `stored`, `has`,
    `spec` and `_mlp` (the MoE block's name: "mlp", or "block_sparse_moe" for Mixtral)."""

    _mlp: str
    # F16 / BF16 matrices multiply float32 activations (a HF checkpoint); a GGUF reader says False: as llama.cpp
    float_acts: bool = True
    norm_offset: bool = False  # RMSNorm weights stored as offsets from 1 (a HF Qwen3-Next checkpoint)

    def router_weight(self, layer: int) -> torch.Tensor:
        return self.tensor(f"model.layers.{layer}.{self._mlp}.gate.weight")  # [E, D]

    def router_bias(self, layer: int) -> torch.Tensor | None:
        name = f"model.layers.{layer}.{self._mlp}.gate.e_score_correction_bias"
        return self.tensor(name) if self.has(name) else None  # [E]

    def dense_mlp(self, layer: int, stored: bool = False) -> ExpertWeights:
        """The SwiGLU MLP of a dense (non-MoE) layer (float32, or in its stored formats)."""
        return self._ffn(f"model.layers.{layer}.mlp", stored=stored)

    def norm(self, name: str) -> torch.Tensor:
        """The weight an RMSNorm multiplies by, float32 in process memory: 1 + the stored offset where the file
        stores norms zero-centred (`norm_offset`; computed as transformers does, 1.0 + w in float32)."""
        weight = self.load(name)
        return 1.0 + weight if self.norm_offset else weight

    def shared_experts(self, layer: int, stored: bool = False) -> ExpertWeights | None:
        """A MoE layer's shared expert MLP (always applied: GLM's shared_experts, Qwen3-Next's shared_expert), or
        None (float32, or in their stored formats). None too where the file holds one of width 0: transformers
        writes [0, D] matrices for n_shared_experts = 0 (GLM), which add nothing."""
        for prefix in (f"model.layers.{layer}.mlp.shared_experts", f"model.layers.{layer}.mlp.shared_expert"):
            if self.has(f"{prefix}.gate_proj.weight"):
                shared = self._ffn(prefix, stored=stored)
                return shared if shared.inter > 0 else None
        return None

    def shared_expert_gate(self, layer: int) -> torch.Tensor | None:
        """Qwen3-Next's shared-expert gate [1, D] float32 (the shared output is scaled by sigmoid(x . w)), or None."""
        name = f"model.layers.{layer}.mlp.shared_expert_gate.weight"
        return self.load(name) if self.has(name) else None

    def _ffn(self, prefix: str, names: tuple[str, str, str] = DENSE_NAMES, stored: bool = False) -> ExpertWeights:
        gate, up, down = (f"{prefix}.{n}.weight" for n in names)
        if stored:
            (g, g_type), (u, u_type), (d, d_type) = self.stored(gate), self.stored(up), self.stored(down)
            if g_type != u_type:  # stacked rows share one format: both as float32 values then
                g, u, g_type = self.tensor(gate), self.tensor(up), F32
            # gate and up are copied by the stacking: copy down too, so the result owns its memory
            return ExpertWeights(host_cat([g, u]), host_copy(d), False, g_type, d_type, self.float_acts,
                                 self.spec.swiglu_limit)  # [2I, D], [D, I]
        # gate and up must be stacked, which copies them anyway: copy down too, so the result owns its
        # memory and a later resident() copies nothing a second time
        return ExpertWeights(host_cat([self.tensor(gate), self.tensor(up)]), host_copy(self.tensor(down)),
                             swiglu_limit=self.spec.swiglu_limit)  # [2I, D], [D, I]
