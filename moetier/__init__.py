"""moetier: run Mixture-of-Experts models whose experts do not fit in GPU memory."""
