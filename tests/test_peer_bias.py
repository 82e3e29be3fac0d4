"""`bias write` on a GGUF, judged by llama.cpp (marker `peer`): llama.cpp routing with the baked copy computes what
moetier computes on the original file with the table (teacher-forced logits, F32 file, F32 KV cache)."""

from __future__ import annotations

import numpy as np
import pytest

from moetier.engine import Engine, score
from moetier.engine.router_bias import apply_router_options
from moetier.model import open_checkpoint
from moetier.model.gguf_write import write_gguf
from moetier.model.synth import write_synthetic
from moetier.profile.bias import build_table
from moetier.profile.brightness import profile_requests
from moetier.profile.sessions import load_sessions, write_example_sessions
from moetier.profile.write import write_biased_checkpoint
from test_peer_llama import llama_logits

pytestmark = pytest.mark.peer


def test_llama_cpp_routes_a_baked_gguf_as_moetier_routes_the_table(tmp_path):
    folder = write_synthetic(tmp_path / "hf", arch="glm4_moe", preset="tiny", seed=2)
    source = write_gguf(folder, tmp_path / "f32.gguf", "F32")[0]
    original = open_checkpoint(source)
    sessions = write_example_sessions(folder, tmp_path / "s.jsonl", sessions=1, tokens_per_phase=32)
    requests = load_sessions(sessions, folder, original.spec.vocab_size)
    table = build_table(profile_requests(Engine(original), requests), 8, "graded", -0.05).save(tmp_path / "t.safetensors")
    write_biased_checkpoint(source, table, tmp_path / "biased.gguf")
    ids = [int(t) for t in requests[0].ids[:128]]
    engine = Engine(original)
    apply_router_options(engine, table)
    ours = score(engine, np.array(ids))
    theirs = llama_logits(tmp_path / "biased.gguf", ids)
    unbiased = llama_logits(source, ids)
    scale = np.abs(theirs).max()
    assert np.abs(ours - theirs).max() <= 1e-4 * scale
    assert np.abs(unbiased - theirs).max() > 1e-2 * scale  # the table changes llama.cpp's routing
