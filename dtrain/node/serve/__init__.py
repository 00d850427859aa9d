"""Serving the live model the way agents call models (OpenAI-compatible), and capturing what it served."""
