"""Profiles and the quality dial: sessions -> phase-balanced brightness -> bias tables, and what they cost.

sessions (JSONL workload) -> brightness (router mass per phase, teacher-forced)
-> bias (graded / flat / hard tables, applied by the engine's router) -> kl
(teacher-forced KL against the plain model) -> sweep (KL, hit rate and tok/s
per arm over a layout) and write (a table baked into a glm4_moe checkpoint).
Importing the package imports none of its modules.
"""
