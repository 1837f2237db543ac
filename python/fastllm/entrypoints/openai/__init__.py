"""The OpenAI-compatible server (``fastllm serve``): request and response models
(``protocol``), the endpoints' work (``serving``, ``rerank``), Prometheus metrics and the app."""
