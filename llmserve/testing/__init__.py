"""Test facilities shipped with the package: the fake OpenAI-compatible server (fake_openai.py)."""
