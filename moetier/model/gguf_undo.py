"""What llama.cpp's converter changed in a tensor's values, undone, for the GGUF reader (moetier.model.gguf_file).

Each function is exact where the change can be undone exactly: Mixtral's Q/K
rows (LlamaModel.permute, for llama.cpp's interleaved RoPE) and GLM-5.3's
kv_b_proj (Glm5NextModel splits each head's rows into k_b, transposed, and v_b)
move whole elements back. GLM-5.3's ssm_a = -exp(A_log) cannot
be undone bit for bit (exp is not one to one in float32); `exp_preimage` gives
an A_log whose exp is the stored value, which is what the engine computes with
(it only ever takes exp(A_log)) and what llama.cpp computes with.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from moetier.model.safetensors_mmap import CheckpointError


def unpermute(values: np.ndarray, heads: int) -> np.ndarray:
    """Undo LlamaModel.permute (conversion/llama.py): per head, rows [pairs..., 2] back to [2, pairs...]."""
    rows = values.shape[0]
    return values.reshape(heads, rows // heads // 2, 2, *values.shape[1:]).swapaxes(1, 2).reshape(values.shape)


def kv_b_proj(k_b: np.ndarray | torch.Tensor, v_b: np.ndarray | torch.Tensor):
    """kv_b_proj [H (dn + dv), r] from the converter's k_b [H, r, dn] (each head's key rows, transposed) and v_b
    [H, dv, r]: per head its key rows, then its value rows, as transformers' kv_b_proj holds them."""
    if isinstance(k_b, np.ndarray):
        return np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, v_b.shape[-1])
    return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, v_b.shape[-1])


def exp_preimage(target: np.ndarray, where: str) -> np.ndarray:
    """float32 a [H] with torch.exp(a) == target bit for bit where one exists (always, for a target this machine's
    torch.exp made from a tensor of this shape: the converter's -exp(A_log)), else the a whose exp is nearest;
    exp is evaluated on the whole [H] tensor, as the engine evaluates it, so each element takes the same path."""
    goal = torch.from_numpy(np.ascontiguousarray(target, dtype=np.float32))
    if not bool((goal > 0).all()) or not bool(torch.isfinite(goal).all()):
        raise CheckpointError(f"{where}: holds a value >= 0 or not finite (expected -exp(A_log) < 0)")
    guess = torch.log(goal.double()).float()
    best, error = guess, (torch.exp(guess).double() - goal.double()).abs()
    up = down = guess
    for _ in range(64):  # a few ulps either side: exp's rounding moves a result by about one
        if not bool(error.any()):
            break
        up, down = torch.nextafter(up, torch.tensor(math.inf)), torch.nextafter(down, torch.tensor(-math.inf))
        for candidate in (up, down):
            miss = (torch.exp(candidate).double() - goal.double()).abs()
            best, error = torch.where(miss < error, candidate, best), torch.minimum(miss, error)
    return best.numpy()
