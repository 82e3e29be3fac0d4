"""Tiers: where experts live (VRAM cache, helper GPU, CPU lane, remote worker) behind one interface."""

from moetier.tiers.base import ExpertJob, Tier

__all__ = ["ExpertJob", "Tier"]
