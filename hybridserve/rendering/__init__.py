"""Prompt formats that are not Hugging Face chat templates (the Kimi-K3 format)."""
