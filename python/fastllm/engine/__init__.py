"""The engine: requests, the scheduler (the one owner of KV state), the model runner and the
step loop that ties them together."""

from fastllm.engine.engine import Engine, EngineConfig, EngineStats

__all__ = ["Engine", "EngineConfig", "EngineStats"]
