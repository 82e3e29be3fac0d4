"""Profiles and the quality dial: sessions -> phase-balanced brightness -> bias tables, and what they cost.

sessions (JSONL workload) -> brightness (router mass per phase, teacher-forced)
-> bias (graded / flat / hard tables, applied by the engine's router) -> kl
(teacher-forced KL against the plain model) -> sweep (KL, hit rate and tok/s
per arm over a layout) and write (a table baked into a glm4_moe checkpoint).
Imports here stay light: nothing heavier than numpy is imported by the package.
"""

from moetier.profile.bias import BiasError, BiasTable, apply_router_options, build_table, load_table
from moetier.profile.brightness import Profile, ProfileError, profile_requests
from moetier.profile.sessions import Request, SessionError, load_sessions, write_example_sessions

__all__ = ["BiasError", "BiasTable", "Profile", "ProfileError", "Request", "SessionError", "apply_router_options",
           "build_table", "load_sessions", "load_table", "profile_requests", "write_example_sessions"]
