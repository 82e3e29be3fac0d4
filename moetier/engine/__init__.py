"""Engine core: model forward, router, generation and teacher-forced scoring."""

from moetier.engine.core import Engine, ExpertExecutor, ResidentExperts, group_by_expert
from moetier.engine.generate import Generation, Sampling, generate, score
from moetier.engine.router import Route, route

__all__ = ["Engine", "ExpertExecutor", "Generation", "ResidentExperts", "Route", "Sampling", "generate", "group_by_expert", "route", "score"]
