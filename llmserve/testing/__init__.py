"""Test facilities shipped with the package: the fake OpenAI-compatible server (fake_openai.py) and
the launcher that starts servers, routers and fleets on loopback for tests and benchmarks
(launcher.py)."""
